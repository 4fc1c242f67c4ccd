"""Hugging Face transformers MoE configs as a model source of `boundpass.plan` (boundpass/core/model_source.py).

`plan` reads a torchtitan-shaped decoder: an embedding, ``layers`` of blocks with ``attention`` and ``moe`` /
``feed_forward``, a final norm and an lm_head. An HF causal LM has the same parts under other names
(``model.embed_tokens``, ``model.layers[i].self_attn`` / ``.mlp``, ``model.norm``, ``lm_head``), and its decoder
layers take their rotary embeddings as an argument. ``_Decoder`` and ``_Block`` below are views that give HF's
real modules the names the planner reads, without copying or wrapping a weight: the block traces then run HF's
own decoder layer (its attention through HF's sdpa interface, its experts through HF's ``grouped_mm``
implementation, the one ``boundpass.compile`` rewrites) at symbolic N, and the head trace runs HF's own loss
(``transformers.loss.loss_utils.ForCausalLMLoss``: logits upcast to fp32, labels shifted).

A model is named by its config: ``"hf:<path to config.json>"``, ``"hf:MixtralConfig"`` (the class at its
defaults: the model it describes at full scale), or, from Python, a ``transformers.PreTrainedConfig`` instance or
class given as ``model`` to ``boundpass.plan``. The flavor is ``"default"`` (a config names one model).
"""
from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path

from boundpass.core.errors import BoundpassInputError

PREFIX = "hf:"
FLAVOR = "default"
# the routed experts inside a block's MoE module (HF's experts interface: use_experts_implementation)
ROUTED_PATH = "moe.experts"
# the parts block_trace's sub-phases are read from (boundpass/planning/block_trace.py: _split): HF's attention kernel is a
# function (the attention interface), not a module, so the attention's backward runs to the block's end
TAGS = {"attention": "attention", "attention.o_proj": "wo", "feed_forward": "ffn", "moe": "ffn"}


class HFSource:
    """boundpass.core.model_source.ModelSource over transformers configs. Configs given as objects are held by
    name ("hf:<class name>#<n>") so that PlanInput.model stays a string."""
    name = "transformers"

    def __init__(self):
        self._given: dict[str, object] = {}

    def register(self, config) -> str:
        """The name of a config object (instance or class) given to plan."""
        name = f"{PREFIX}{getattr(config, '__name__', type(config).__name__)}#{len(self._given)}"
        self._given[name] = config
        return name

    def resolve(self, model: str) -> str:
        if not isinstance(model, str) or not model.startswith(PREFIX):
            raise BoundpassInputError(f"{model!r} is not a Hugging Face model name: give 'hf:<path to config.json>', "
                                      f"'hf:<transformers config class>' or a transformers config object")
        if model in self._given:
            return model
        spec = model[len(PREFIX):]
        if spec.endswith(".json") or "/" in spec:
            path = Path(spec).expanduser()
            if path.is_dir():
                path = path / "config.json"
            if not path.is_file():
                raise BoundpassInputError(f"{model}: no such config file {str(path)!r}")
            try:
                data = json.loads(path.read_text())
            except json.JSONDecodeError as err:
                raise BoundpassInputError(f"{model}: {path} is not JSON ({err})") from None
            if "model_type" not in data:
                raise BoundpassInputError(f"{model}: {path} has no model_type (not a transformers config.json)")
            return f"{PREFIX}{path}"
        if not spec.isidentifier():
            raise BoundpassInputError(f"{model}: expected a config.json path or a transformers config class name "
                                      f"such as MixtralConfig")
        return model

    def flavors(self, model: str) -> tuple[str, ...]:
        return (FLAVOR,)

    def hf_config(self, model: str):
        """The transformers config object (loaded, or the class at its defaults), attention and experts set to the
        implementations boundpass.compile captures and rewrites (sdpa, grouped_mm)."""
        import transformers
        given = self._given.get(model)
        spec = model[len(PREFIX):]
        if given is not None:
            config = given() if isinstance(given, type) else given
        elif spec.endswith(".json"):
            config = transformers.AutoConfig.from_pretrained(str(Path(spec).parent))
        else:
            cls = getattr(transformers, spec, None)
            if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedConfig)):
                raise BoundpassInputError(f"{model}: transformers {transformers.__version__} has no config class "
                                          f"{spec!r}")
            config = cls()
        return config

    def config(self, model: str, flavor: str, *, seq_len: int | None = None) -> "_DecoderConfig":
        if flavor != FLAVOR:
            raise BoundpassInputError(f"{model}: a transformers config names one model; its flavor is "
                                      f"{FLAVOR!r}, not {flavor!r}")
        return _DecoderConfig(model, self.hf_config(model), seq_len)

    def notes(self, model: str, flavor: str) -> list[str]:
        return ["transformers model: HF's own decoder layers traced (sdpa attention, grouped_mm experts) through "
                "views that name its parts as the planner reads them (recipes/hf.py)",
                "W > 1 is composed for the MoP layout (torchtitan's trainer, docs/mop.md); boundpass.compile runs a "
                "transformers model on one rank (docs/huggingface.md)"]

    @staticmethod
    def loss():
        """HF's causal-LM loss as its models call it (logits upcast to fp32, labels shifted, mean over tokens)."""
        from transformers.loss.loss_utils import ForCausalLMLoss

        def hf_loss(logits, labels, tokens):
            return ForCausalLMLoss(logits, labels, logits.shape[-1])
        return hf_loss


SOURCE = HFSource()


# ------------------------------------------------------------------------------------------- views
@functools.lru_cache(maxsize=None)
def _modules():
    import torch

    class Block(torch.nn.Module):
        """An HF decoder layer under torchtitan's part names: ``attention`` (its self_attn), ``moe`` (its sparse MoE
        block, routed experts at ``moe.experts``) or ``feed_forward`` (a dense MLP). Called as torchtitan calls a
        block, ``block(x, freqs_cis, mask)``: positions 0..N-1, HF's rotary embedding, causal attention."""
        boundpass_routed_path = ROUTED_PATH
        boundpass_tags = TAGS

        def __init__(self, layer, rotary):
            super().__init__()
            self.attention = layer.self_attn
            if getattr(layer.mlp, "experts", None) is not None:
                self.moe, self.feed_forward = layer.mlp, None
            else:
                self.moe, self.feed_forward = None, layer.mlp
            self.layer, self.rotary = layer, rotary  # after the parts: parameters keep the parts' names

        def forward(self, x, freqs_cis=None, mask=None):
            positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
            with _as_under_dynamo():
                return self.layer(x, position_embeddings=self.rotary(x, positions), attention_mask=None,
                                  position_ids=positions)

    class Decoder(torch.nn.Module):
        """An HF causal LM under torchtitan's names: tok_embeddings, layers, norm, lm_head."""

        def __init__(self, net):
            super().__init__()
            self.tok_embeddings, self.norm, self.lm_head = net.model.embed_tokens, net.model.norm, net.lm_head
            self.layers = torch.nn.ModuleDict({str(i): Block(layer, net.model.rotary_emb)
                                               for i, layer in enumerate(net.model.layers)})
            self._rotary_dim = 2 * net.model.rotary_emb.inv_freq.numel()

        @property
        def shared_block_input_bytes(self) -> int:
            """Per token: HF's rotary cos and sin (the rotary dims, the weights' dtype) and the int64 position id,
            made once per forward and held by every checkpointed layer (composed.ModelShape)."""
            return 2 * self._rotary_dim * self.tok_embeddings.weight.element_size() + 8
    return Block, Decoder


@contextlib.contextmanager
def _as_under_dynamo():
    """HF's experts pick their matmul kernel by whether Dynamo is compiling (transformers.integrations.moe: under
    torch.compile, weights other than bf16 take its grouped_mm_fallback op). boundpass.compile runs the model under
    Dynamo, so the block trace (AOTAutograd without Dynamo) is made to see the same choice."""
    from transformers.integrations import moe
    saved = moe.is_torchdynamo_compiling
    moe.is_torchdynamo_compiling = lambda: True
    try:
        yield
    finally:
        moe.is_torchdynamo_compiling = saved


class _Part:
    def __init__(self, build):
        self.build = build


class _Heads:
    """What the composed budget reads of a block's attention: heads, kv heads, head dim. HF's MLA (unequal qk and v
    head dims) runs HF's sdpa on the math path, as the trace sees it; the head dim given is the larger."""

    def __init__(self, config):
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = getattr(config, "num_key_value_heads", None) or self.n_heads
        qk = getattr(config, "qk_nope_head_dim", 0) + getattr(config, "qk_rope_head_dim", 0)
        self.head_dim = max(qk, getattr(config, "v_head_dim", 0) or 0) or getattr(config, "head_dim", None) \
            or config.hidden_size // self.n_heads


class _Router:
    def __init__(self, top_k):
        self.top_k = top_k


class _MoE:
    def __init__(self, top_k):
        self.router = _Router(top_k)


class _Layer:
    def __init__(self, owner: "_DecoderConfig", index: int, moe: bool):
        self.attention = _Heads(owner.hf)
        self.moe = _MoE(owner.top_k) if moe else None
        self.build = lambda: owner.block(index)


class _DecoderConfig:
    """The torchtitan-shaped config `plan` reads (layers with attention / moe, build(), norm, lm_head, dim), over a
    transformers config: built on meta once to learn the layer kinds and classes, each part rebuilt on demand in
    the caller's device and mode (meta, or FakeTensorMode in plan.trace)."""

    def __init__(self, model: str, hf, seq_len: int | None):
        import torch
        import transformers
        self.name, self.hf = model, hf
        if seq_len is not None and getattr(hf, "max_position_embeddings", seq_len) < seq_len:
            hf.max_position_embeddings = seq_len
        hf.use_cache = False
        try:
            with torch.device("meta"):
                net = transformers.AutoModelForCausalLM.from_config(hf, attn_implementation="sdpa")
        except ValueError as err:
            raise BoundpassInputError(f"{model}: transformers cannot build a causal LM of {type(hf).__name__} "
                                      f"({err})") from None
        if getattr(hf, "_experts_implementation", None) not in (None, "grouped_mm"):
            hf._experts_implementation = "grouped_mm"
        self._classes = [type(layer) for layer in net.model.layers]
        self._rotary = type(net.model.rotary_emb)
        self._net_class = type(net)
        kinds = [getattr(layer.mlp, "experts", None) is not None for layer in net.model.layers]
        if not any(kinds):
            raise BoundpassInputError(f"{model}: {type(hf).__name__} has no MoE layer (its MLPs have no experts): "
                                      f"boundpass plan composes MoE training")
        self.top_k = getattr(hf, "num_experts_per_tok", None) or getattr(hf, "top_k", None) or 1
        self.dim = hf.hidden_size
        self.layers = [_Layer(self, i, moe) for i, moe in enumerate(kinds)]
        self.norm = _Part(lambda: type(net.model.norm)(hf.hidden_size, eps=getattr(hf, "rms_norm_eps", 1e-6)))
        self.lm_head = _Part(lambda: torch.nn.Linear(hf.hidden_size, hf.vocab_size, bias=False))

    def build(self):
        _, Decoder = _modules()
        return Decoder(self._net_class(self.hf))

    def block(self, index: int):
        Block, _ = _modules()
        return Block(self._classes[index](self.hf, index), self._rotary(config=self.hf))
