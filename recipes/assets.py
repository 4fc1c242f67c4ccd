"""Tiny tokenizer + text dataset for the recipe, generated locally on first use (nothing is downloaded).

torchtitan's debug configs expect `./tests/assets/tokenizer` and `./tests/assets/c4_test` relative to the working
directory, and the 0.3.0 wheel ships neither. We write an equivalent pair under a cache folder instead of
committing binaries:

- `<root>/c4_synthetic/train.jsonl`: `{"text": ...}` lines of deterministic pseudo-English (a Zipf-weighted
  made-up lexicon, fixed seed), read by torchtitan's own `c4_test` loader (`load_dataset(path, split="train")`)
  through `dataloader.dataset_path`.
- `<root>/tokenizer/tokenizer.json` (+ `tokenizer_config.json` with bos/eos): a ByteLevel BPE trained on that
  text with the `tokenizers` library, loaded by torchtitan's HuggingFaceTokenizer through `hf_assets_path`.

The root is $BOUNDPASS_ASSETS, else $XDG_CACHE_HOME/boundpass/recipe_assets (~/.cache/...). Generation is
deterministic and written atomically (temp dir + rename), so concurrent ranks never read half a file.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

ASSET_VERSION = 1
DOCS = 2000           # lines of text
WORDS_PER_DOC = 220   # ~300 tokens each: ~600k tokens, enough for long sequences without re-looping much
LEXICON = 3000
TOKENIZER_VOCAB = 4096
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def assets_root() -> Path:
    root = os.environ.get("BOUNDPASS_ASSETS")
    if root:
        return Path(root)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "boundpass" / f"recipe_assets_v{ASSET_VERSION}"


def _text_lines(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    weights = [12.7, 9.1, 8.2, 7.5, 7.0, 6.7, 6.3, 6.1, 6.0, 4.3, 4.0, 2.8, 2.8, 2.4, 2.4, 2.2, 2.0, 2.0, 1.9, 1.5,
               1.0, 0.8, 0.15, 0.15, 0.1, 0.07]
    lexicon = sorted({"".join(rng.choices(letters, weights, k=rng.randint(1, 9))) for _ in range(LEXICON * 2)})
    rng.shuffle(lexicon)
    lexicon = lexicon[:LEXICON]
    zipf = [1.0 / (rank + 1) for rank in range(len(lexicon))]
    lines = []
    for _ in range(DOCS):
        words = rng.choices(lexicon, zipf, k=WORDS_PER_DOC)
        sentences, start = [], 0
        while start < len(words):
            end = min(len(words), start + rng.randint(6, 18))
            sentence = " ".join(words[start:end])
            sentences.append(sentence[0].upper() + sentence[1:] + rng.choice([".", ".", ".", "?", "!"]))
            start = end
        lines.append(" ".join(sentences))
    return lines


def _write(root: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    lines = _text_lines()
    data = root / "c4_synthetic"
    data.mkdir(parents=True)
    with open(data / "train.jsonl", "w") as f:
        for line in lines:
            f.write(json.dumps({"text": line}) + "\n")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(lines, trainer=trainer)
    tok_dir = root / "tokenizer"
    tok_dir.mkdir(parents=True)
    tokenizer.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": False,
         "tokenizer_class": "PreTrainedTokenizerFast"}, indent=1))
    (root / "DONE").write_text(f"boundpass recipe assets v{ASSET_VERSION}\n")


def ensure_assets(root: Path | None = None) -> dict[str, str]:
    """Generate the assets if missing; returns {"tokenizer": dir, "dataset": dir}."""
    root = Path(root) if root is not None else assets_root()
    if not (root / "DONE").exists():
        root.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".assets-", dir=root.parent))
        try:
            _write(staging)
            try:
                os.rename(staging, root)
            except OSError:  # another rank won the race: its copy is identical
                if not (root / "DONE").exists():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return {"tokenizer": str(root / "tokenizer"), "dataset": str(root / "c4_synthetic")}


def point_config_at_assets(config, root: Path | None = None) -> dict[str, str]:
    """Make a Trainer.Config read the generated tokenizer and dataset (torchtitan's c4_test loader)."""
    paths = ensure_assets(root)
    config.hf_assets_path = paths["tokenizer"]
    dataloader = config.dataloader
    if getattr(dataloader, "dataset", None) == "c4_test":
        dataloader.dataset_path = paths["dataset"]
    validator_loader = getattr(getattr(config, "validator", None), "dataloader", None)
    if getattr(validator_loader, "dataset", None) == "c4_test" or (
            validator_loader is not None and getattr(validator_loader, "dataset", None) == "c4_validation"):
        validator_loader.dataset = "c4_test"
        validator_loader.dataset_path = paths["dataset"]
    return paths
