"""`boundpass.plan` on Hugging Face transformers configs (issue 35, plan): the model named by its config, planned
through the same block traces as torchtitan's (HF's own decoder layer and loss, recipes/hf.py's views), predicted
against a measured training step, at full scale from a config class's defaults, and refused with the reason."""
import subprocess
import sys

import pytest
import torch

import boundpass
from boundpass.bound import composed
from boundpass.core.errors import BoundpassInputError
from boundpass.measure.memtrack import LiveStorageTracker
from boundpass.core.model_source import source_for
from boundpass.planning.full_scale import model_shape

transformers = pytest.importorskip("transformers")
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              eos_token_id=None, pad_token_id=None, bos_token_id=None, max_position_embeddings=4096)


def _config(family: str, vocab: int):
    if family == "mixtral":
        return transformers.MixtralConfig(vocab_size=vocab, num_local_experts=4, num_experts_per_tok=2, **COMMON)
    # Qwen2-MoE: its first layer dense (mlp_only_layers), the others with a gated shared expert
    return transformers.Qwen2MoeConfig(vocab_size=vocab, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                       shared_expert_intermediate_size=64, mlp_only_layers=[0], **COMMON)


def _measured(config, seq: int) -> int:
    """A steady-state step of the HF model itself (eager, HF's activation checkpointing, torch AdamW): live
    storages, parameters, buffers and optimizer state counted from the start."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.activation_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, config.vocab_size, (1, seq), generator=gen) for _ in range(2))
    with LiveStorageTracker() as tracker:
        tracker.track_existing(*model.parameters(), *model.buffers())
        for p in model.parameters():  # AdamW's state, as a first step leaves it (test_plan.py)
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tracker.reset_peak()
        model(input_ids=tokens, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return tracker.peak_bytes()


@pytest.mark.parametrize("family,vocab,seq", [("mixtral", 2048, 1024), ("mixtral", 32768, 1024),
                                              ("qwen2_moe", 2048, 2048)])
def test_predicted_peak_of_an_hf_model_is_within_10_percent_and_never_below(family, vocab, seq):
    config = _config(family, vocab)
    source, name = source_for(config)
    shape = model_shape(name, "default", dtype_bytes=4, source=source, traces="one_rank")
    assert shape.traced and shape.moe_layers == (3 if family == "mixtral" else 2)
    assert shape.experts == 4 and shape.top_k == 2 and shape.shared_hidden == (64 if family == "qwen2_moe" else 0)
    launch = composed.Launch(ranks=1, ep=1, ring=1, tokens_per_rank=seq, operators=frozenset(), b=4, b_acc=4)
    table = composed.compose(shape, launch, budget=2 ** 40)
    assert any(t.name.startswith("traced moe block") for t in table.terms)
    assert any(t.name.startswith("per-token inputs every block takes") for t in table.terms)
    measured = _measured(config, seq)
    assert measured <= table.total <= 1.10 * measured, (table.total, measured)


def test_a_config_class_is_planned_at_full_scale():
    result = boundpass.plan(transformers.MixtralConfig, ranks=8, ep=8, context=32768, budget="80GiB")
    assert 46e9 < result.shape.params < 47.5e9 and result.shape.layers == 32 and result.shape.experts == 8
    assert result.shape.traced  # W > 1: HF's block traced with its routed experts stood in
    assert any("transformers model" in note for note in result.trace_notes)
    assert result.table.total > 0 and isinstance(result.fits, bool)


def test_a_config_json_is_planned_from_the_cli(tmp_path):
    _config("mixtral", 2048).to_json_file(str(tmp_path / "config.json"))
    run = subprocess.run([sys.executable, "-m", "boundpass", "plan", f"hf:{tmp_path / 'config.json'}", "--ranks", "1",
                          "-N", "1024", "--budget", "1GiB", "--dtype", "fp32", "-q"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "FITS" in run.stdout and "transformers block" in run.stdout


@pytest.mark.parametrize("model,flavor,match", [
    ("hf:/no/such/config.json", None, "no such config file"),
    ("hf:NoSuchConfig", None, "has no config class"),
    ("hf:LlamaConfig", None, "has no MoE layer"),
    ("hf:MixtralConfig", "8x7B", "unknown flavor '8x7B' of hf:MixtralConfig; known: default"),
    ("deepseek_v3", None, "give the flavor of deepseek_v3"),
])
def test_bad_hf_names_are_refused_with_the_reason(model, flavor, match):
    with pytest.raises(BoundpassInputError, match=match):
        boundpass.plan(model, flavor, ranks=1, tokens_per_rank=1024, budget="1GiB", do_trace=False)
