"""The MoP rank layout on torchtitan's MoE models: FSDP2 dense weights, sequence-to-head attention, EP experts.

One rank set of W ranks, overlapping sub-groups (docs/design.md §2, docs/mop.md):
- every rank holds N/W consecutive tokens of every sequence (rank r: global positions [r*N/W, (r+1)*N/W)),
  fed to the model with those global positions, so RoPE is the unsharded one;
- attention: torchtitan's inner attention module is wrapped, before ``parallelize`` (as torchtitan's own
  context parallelism does), with the sequence-to-head all-to-all over all W ranks
  (boundpass.runtime.seq_to_head): A_q/W heads of the whole sequence per rank inside attention;
- dense weights: FSDP2 (``fully_shard`` per block over the W-rank "fsdp" mesh), experts: torchtitan's expert
  parallelism over the "ep" sub-mesh (E_p ranks) and FSDP over "efsdp" (W/E_p); all built by torchtitan's
  own ``parallelize_fn`` of the model (``parallelize_deepseekv3``, ...) from ParallelDims;
- expert dispatch (``pipelined_llep=True``): torchtitan's per-block compile hands every TransformerBlock graph to
  boundpass's dispatch pass (``boundpass.backend.layout_compile.DispatchBlocks``), which rewrites each routed-experts region
  into the PipelinedLLEP op (``boundpass::pipelined_llep_fwd``) over the EP sub-group, chunk cap c, in place of
  torchtitan's all-to-all dispatcher: its peak no longer depends on the routing; the model's forwards stay
  torchtitan's;
- vocabulary projection + loss (``ring_dtp=True``): lm_head's weight is sharded by vocab rows over the W ranks
  (a DTensor ``Shard(0)`` parameter, the same name and global shape as FSDP2's shard of it) and left out of
  FSDP2; ``mop_loss`` runs Ring-DTP over the W-rank ring, so no rank gathers the weight or forms [N, V] logits.
- gradients are summed, not averaged, over the W ranks (the loss is already divided by the global token
  count, torchtitan's convention); gloo has no PREMUL_SUM, so FSDP reduces with a plain sum.

Data-parallel replicas (whole sequences on disjoint rank sets) are left out: the W ranks hold one set of
sequences, split along the sequence.

The layout is applied in two halves around torchtitan's own parallelize function, so a trainer that calls that
function itself (torchtitan's Trainer) can wrap it: ``prepare_mop`` (before: module swaps that must run on local
tensors inside torchtitan's wrapping) and ``finish_mop`` (after: FSDP2 reduction settings, the vocab-sharded
head). ``parallelize_mop`` does both around the call for a model built outside a trainer.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from boundpass.core.config import PLAN_DISPATCH_CAP, DispatchConfig, VocabConfig
from boundpass.core.errors import BoundpassInputError
from boundpass.recipes.models import MODELS, apply_cpu_device_fix, debug_moe_config
from boundpass.runtime.ring_dtp import ring_dtp_loss
from boundpass.runtime.seq_to_head import SeqToHeadAttention, check_head_counts, shard_positions, shard_sequence

# torchtitan reads its device type once, at import: fix it before anything imports torchtitan (no-op on GPUs)
apply_cpu_device_fix()
from torchtitan.protocols.module import Module as TorchtitanModule  # noqa: E402

__all__ = ["mop_config", "build_model", "apply_seq_to_head", "apply_pipelined_llep", "compile_config_under_mop",
           "prepare_mop", "finish_mop", "parallelize_mop",
           "mop_loss", "shard_batch", "attention_heads", "MoPOptions"]


@dataclass(frozen=True)
class MoPOptions:
    """Which parts of the layout are on. The defaults are the plain layout (torchtitan's EP dispatcher and
    full-logits head); ``pipelined_llep`` / ``ring_dtp`` switch the two bounded operators on. ``dispatch_cap`` and
    ``vocab_block`` are boundpass.Config's knobs by the same names, validated by it (boundpass/core/config.py)."""
    sequence_to_head: bool = True
    pipelined_llep: bool = False
    # PipelinedLLEP chunk cap c (None: config.PLAN_DISPATCH_CAP; with a budget the trainer passes the planner's c)
    dispatch_cap: int | None = None
    dispatch_borrowed_slots: int | None = None  # PipelinedLLEP borrowed-expert slots s_b (None: e = E / E_p)
    ring_dtp: bool = False
    vocab_block: int | None = None  # Ring-DTP strip width C (None: the whole local vocab shard, the runtime's default)
    # C_s of sequence-to-head attention in tiles (runtime/seq_to_head_tiles.py); 0: the whole-tensor exchange
    attention_tiles: int = 0

    def __post_init__(self):
        DispatchConfig(cap=self.dispatch_cap, borrowed_slots=self.dispatch_borrowed_slots)
        VocabConfig(block=self.vocab_block)

    @property
    def cap(self) -> int:
        """The chunk cap PipelinedLLEP runs with."""
        return PLAN_DISPATCH_CAP if self.dispatch_cap is None else self.dispatch_cap


@dataclass
class MoPState:
    """What ``prepare_mop`` hands ``finish_mop``: the options and the lm_head it took out of FSDP2's reach."""
    options: MoPOptions
    lm_head: torch.nn.Module | None = None
    dispatch_backend: object = None  # the per-block compile backend giving PipelinedLLEP (DispatchBlocks), if on
    head_backend: object = None      # the head step's backend giving Ring-DTP (RingDTPHeadBackend), set by mop_loss
    released: int = 0                # FSDP2 groups on boundpass.backend.gloo_release's collectives

    @property
    def dispatch(self) -> list[str]:
        """The routed-experts modules whose regions the dispatch pass rewrote to PipelinedLLEP (``layers.1.moe.
        routed_experts``, ...): known once the blocks compiled, at the first forward."""
        return self.dispatch_backend.rewritten_paths() if self.dispatch_backend is not None else []


def mop_config(name: str = "deepseek_v3", *, world: int, ep: int, seq_len: int, vocab_size: int | None = None,
               param_dtype: str | None = None):
    """torchtitan Trainer.Config of a debug MoE model laid out over ``world`` ranks with EP degree ``ep``.

    ``param_dtype``: FSDP2's compute dtype; None: float32, except gpt_oss (bfloat16: its experts return bf16
    whatever their input, so torchtitan only runs it in bf16; fp32 fails inside torchtitan's combine)."""
    if name not in MODELS:
        raise BoundpassInputError(f"unknown model {name!r}; the MoP layout supports {sorted(MODELS)}")
    if world % ep:
        raise BoundpassInputError(f"the EP degree ({ep}) must divide the {world} ranks of the MoP layout")
    shard_sequence(seq_len, 0, world)  # refuses a ragged last shard before anything is built
    cfg = debug_moe_config(name, vocab_size=vocab_size, seq_len=seq_len)
    par = cfg.parallelism
    par.data_parallel_shard_degree = world
    par.expert_parallel_degree = ep
    # spmd_types cannot run on gloo (uneven list all_to_all, fully_shard on plain tensors): docs/design.md §7
    par.spmd_backend = "partial_dtensor"
    if param_dtype is None:
        param_dtype = "bfloat16" if name == "gpt_oss" else "float32"
    cfg.training.mixed_precision_param = param_dtype
    cfg.model_spec.model.update_from_config(config=cfg)  # EP sharding config now that ep is set
    A_q, A_kv = attention_heads(cfg)
    check_head_counts(A_q, A_kv, world)
    return cfg


def build_model(cfg, *, layers: int | None = None, seed: int = 0) -> torch.nn.Module:
    """The model of ``cfg`` materialised on CPU with the same full weights on every rank (seeded init, as one rank
    would have them), built with only its first ``layers`` blocks (None: all), in training mode: ``parallelize_mop``
    then shards it in place. (torchtitan's Trainer initialises after parallelizing instead: recipes/trainer.py.)

    The blocks are cut from the config, not from the built model: initialising blocks only to delete them cost
    qwen3's debug model (8 blocks of 64 experts) 2.4 s of its 3-block build. The weights are those of the same
    seed's smaller model (the head draws from the generator right after the last kept block)."""
    model_cfg = cfg.model_spec.model
    if layers is not None:
        model_cfg = dataclasses.replace(model_cfg, layers=list(model_cfg.layers)[:layers])
    with torch.device("meta"):
        model = model_cfg.build()
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights(buffer_device=None)
    return model.train()


def attention_heads(cfg) -> tuple[int, int]:
    """(query heads, kv heads) of the model's attention as the inner attention sees them (MLA: k per head)."""
    att = cfg.model_spec.model.layers[0].attention
    A_q = att.n_heads
    A_kv = getattr(att, "n_kv_heads", None) or A_q
    return A_q, A_kv


def apply_seq_to_head(model: torch.nn.Module, group, tiles: int = 0) -> None:
    """Wrap every block's inner attention with the sequence-to-head all-to-all over ``group`` (in place).

    Call before ``parallelize`` so the wrapper runs on local tensors inside torchtitan's wrapping, like its
    context-parallel ``apply_cp_to_forward``. Parameter names do not change (the inner module has none).
    """
    for block in model.layers.values():
        inner = block.attention.inner_attention
        if isinstance(inner, SeqToHeadAttention):
            raise BoundpassInputError("apply_seq_to_head: attention is already sequence-to-head")
        block.attention.inner_attention = SeqToHeadAttention(inner, group, tiles=tiles)


def apply_pipelined_llep(model: torch.nn.Module, cap: int, inner: str = "aot_eager",
                         borrowed_slots: int | None = None):
    """The backend that gives every MoE block's routed experts PipelinedLLEP through the dispatch pass: a
    ``boundpass.backend.layout_compile.DispatchBlocks`` for torchtitan's per-block compile (``prepare_mop`` hands it to the
    parallelize function as ``--compile.backend``). No forward is replaced: the module tree, its parameters, names and
    FSDP2/EP sharding stay torchtitan's, and each block graph's routed-experts region (the dispatcher's all-to-all +
    grouped experts + combine) becomes one ``boundpass::pipelined_llep_fwd`` over the EP group torchtitan wires into the
    dispatcher, with this rank's experts and torchtitan's bf16 expert matmuls, and at most ``borrowed_slots`` (s_b;
    None: e) other ranks' experts lent to a rank.

    Checked here, before anything is sharded or compiled, with the pass's own checks: a dispatcher or experts class
    other than torchtitan's plain SwiGLU ones (e.g. gpt_oss's biased experts, DeepEP) is refused, not
    reinterpreted.
    """
    from torchtitan.models.common.moe import RoutedExperts

    from boundpass.backend.layout_compile import DispatchBlocks
    from boundpass.passes.dispatch_pass import unsupported_reason

    for path, module in model.named_modules():
        if not isinstance(module, RoutedExperts):
            continue
        reason = unsupported_reason(module)
        if reason:
            raise BoundpassInputError(f"MoP pipelined_llep: {path}: {reason}; PipelinedLLEP reproduces only "
                                      "torchtitan's bias-free SwiGLU experts behind its local / all-to-all "
                                      "dispatcher: run this model's layout with pipelined_llep=False")
    return DispatchBlocks(model.layers, cap, inner, borrowed_slots)


def compile_config_under_mop(compile_config, state: "MoPState"):
    """The compile config to hand torchtitan's parallelize function: with PipelinedLLEP on, torchtitan's own
    per-block compile (``apply_compile``: every TransformerBlock, fullgraph) with ``state.dispatch_backend`` as its
    backend, lowered as ``--compile.backend`` asked when ``--compile.enable`` was given ("inductor" or "aot_eager"),
    else by aot_eager; otherwise ``compile_config`` unchanged."""
    import copy
    backend = state.dispatch_backend
    if backend is None:
        return compile_config
    asked = compile_config.backend if compile_config.enable and "model" in compile_config.components else None
    if asked is not None and asked not in ("inductor", "aot_eager"):
        raise BoundpassInputError(f"MoP pipelined_llep: --compile.backend {asked!r}: boundpass lowers block graphs "
                                  "with 'inductor' or 'aot_eager'")
    backend.inner = asked or "aot_eager"
    out = copy.copy(compile_config)
    out.enable = True
    out.components = sorted({*compile_config.components, "model"}) if compile_config.enable else ["model"]
    out.backend = backend
    return out


class RingDTPHead(TorchtitanModule):
    """lm_head under the MoP layout: this rank's vocab rows of the projection weight, as a DTensor ``Shard(0)`` over
    the W-rank ring (name ``lm_head.weight`` and global shape unchanged, so checkpoints and optimizers see what
    they saw under FSDP2). Its forward is the identity: the model returns the normed hidden state and
    ``mop_loss`` runs projection + cross-entropy as Ring-DTP. Ring-DTP's dW on each shard already holds every
    rank's tokens, so nothing reduces it (it is not an FSDP2 parameter)."""

    def __init__(self, weight: torch.nn.Parameter, mesh, init_fn=None):
        super().__init__()
        self.weight = weight
        self.mesh = mesh
        self.vocab_size = weight.shape[0]
        self._init_fn = init_fn

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h

    def _init_self_parameters(self) -> None:
        """torchtitan's init walk (models built on meta, parallelized, then initialised): lm_head's own init."""
        if self._init_fn is None:
            raise BoundpassInputError("RingDTPHead: no init function was kept from the original lm_head")
        with torch.no_grad():
            self._init_fn(self.weight)


def _shard_lm_head(head: torch.nn.Module, mesh) -> RingDTPHead:
    from torch.distributed.tensor import DTensor, Shard

    weight = head.weight
    rows = weight.shape[0] // mesh.size()  # prepare_mop refused a vocabulary the ring does not divide
    rank = mesh.get_local_rank()
    local = weight.detach()[rank * rows:(rank + 1) * rows].clone()  # meta stays meta: initialised later
    param = torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False))
    return RingDTPHead(param, mesh, (getattr(head, "_param_init", None) or {}).get("weight"))


def prepare_mop(model: torch.nn.Module, dims, options: MoPOptions) -> MoPState:
    """The half of the layout that runs before torchtitan's parallelize function (see the module docstring)."""
    state = MoPState(options)
    if options.sequence_to_head:
        apply_seq_to_head(model, dims.get_mesh("fsdp").get_group(), tiles=options.attention_tiles)
    if options.pipelined_llep:
        state.dispatch_backend = apply_pipelined_llep(model, options.cap,
                                                      borrowed_slots=options.dispatch_borrowed_slots)
    if options.ring_dtp:
        if getattr(model, "lm_head", None) is None:
            raise BoundpassInputError("MoP ring_dtp: the model has no lm_head to shard")
        V, W = model.lm_head.weight.shape[0], dims.get_mesh("fsdp").size()
        if V % W:
            raise BoundpassInputError(f"MoP ring_dtp: the vocabulary ({V}) must divide by the {W} ranks of the ring "
                                      "(equal vocab shards); pad the vocabulary or use ring_dtp=False")
        tok = getattr(model, "tok_embeddings", None)
        if tok is not None and tok.weight is model.lm_head.weight:
            raise BoundpassInputError("MoP ring_dtp: lm_head is tied to the token embedding; Ring-DTP shards the "
                                      "head by vocab rows, which the embedding cannot share: use ring_dtp=False")
        state.lm_head, model.lm_head = model.lm_head, None  # out of FSDP2's root unit; attached in finish_mop
    return state


def finish_mop(model: torch.nn.Module, dims, state: MoPState) -> None:
    """The half of the layout that runs after torchtitan's parallelize function."""
    from torch.distributed.fsdp import FSDPModule
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)           # the loss is already / global tokens
            module.set_force_sum_reduction_for_comms(True)   # gloo: no PREMUL_SUM
    if state.lm_head is not None:
        model.lm_head = _shard_lm_head(state.lm_head, dims.get_mesh("fsdp"))
        state.lm_head = None
    from boundpass.backend.gloo_release import install_releasing_collectives
    # a gloo worker thread keeps a finished collective's buffers alive until it is next scheduled (timing dependent):
    # the reduce-scatter's clone of its input (measured at torch's allocator on 4 ranks, bench/mop.py, L = 2,048,
    # fp32: 266 MiB against a composed budget of 252 MiB, which counts one reduce-scatter input and no clone) and
    # each unit's all-gather output after its copy-out (test_mop's shape with the CPU busy: up to 1.080x the budget in 12
    # of 96 steps). The layout installs the collectives whose buffers die when FSDP2 is done with them (bitwise the
    # same values; gloo groups only): boundpass/backend/gloo_release.py.
    state.released = install_releasing_collectives(model)


def parallelize_mop(model: torch.nn.Module, cfg, *, world: int, ac_config=None, sequence_to_head: bool = True,
                    pipelined_llep: bool = False, dispatch_cap: int | None = None, ring_dtp: bool = False,
                    vocab_block: int | None = None, dispatch_borrowed_slots: int | None = None):
    """Apply the MoP layout to a materialised model (same values on every rank); returns (model, parallel_dims).

    torchtitan's own parallelize function does EP + FSDP2; around it this adds sequence-to-head attention, the
    sum-reduction of gradients and, if asked, PipelinedLLEP dispatch (cap ``dispatch_cap``, borrowed slots
    ``dispatch_borrowed_slots``) and the Ring-DTP head
    (train with ``mop_loss(model, parallel_dims)``). ``ac_config``: torchtitan's activation checkpointing config
    (e.g. ``FullAC.Config()``), applied by the same parallelize function; None: off. With ``pipelined_llep`` every
    block is compiled by torchtitan's ``apply_compile`` with boundpass's dispatch backend (``compile_config_under_mop``;
    the blocks compile at the first forward, which every rank runs together); otherwise ``cfg.compile`` as given.
    """
    import torch.distributed as dist
    from torchtitan.distributed import ParallelDims

    options = MoPOptions(sequence_to_head=sequence_to_head, pipelined_llep=pipelined_llep, dispatch_cap=dispatch_cap,
                         dispatch_borrowed_slots=dispatch_borrowed_slots, ring_dtp=ring_dtp, vocab_block=vocab_block)
    if not dist.is_initialized() or dist.get_world_size() != world:
        raise BoundpassInputError(f"parallelize_mop needs an initialised process group of {world} ranks")
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.tools import utils as tt_utils

    if tt_utils.device_type == "cuda" and not torch.cuda.is_available():
        raise BoundpassInputError("torchtitan was imported before boundpass.recipes.mop on a machine without CUDA, "
                                  "so its device type is 'cuda'; import boundpass.recipes.mop (or call "
                                  "boundpass.recipes.models.apply_cpu_device_fix()) before importing torchtitan")

    dist_utils.set_spmd_backend(cfg.parallelism.spmd_backend)  # what torchtitan's Trainer does first
    dims = ParallelDims.from_config(cfg.parallelism, world)
    dims.build_mesh()
    state = prepare_mop(model, dims, options)
    cfg.model_spec.parallelize_fn(model, parallel_dims=dims, training=cfg.training, parallelism=cfg.parallelism,
                                  compile_config=compile_config_under_mop(cfg.compile, state), ac_config=ac_config, dump_folder=cfg.dump_folder)
    finish_mop(model, dims, state)
    model._mop = state  # what the layout did (options, PipelinedLLEP regions): for tests, reports and mop_loss
    return model, dims


def mop_loss(model: torch.nn.Module, dims=None, *, vocab_block: int | None = None, ignore_index: int = -100):
    """The training loss of a MoP-laid-out model, with torchtitan's signature and normalisation
    ``(pred, labels, global_valid_tokens) -> (loss, {})``: Ring-DTP over the W-rank ring when the head is a
    RingDTPHead (``pred`` is then the normed hidden state), torchtitan's CrossEntropyLoss otherwise.

    Ring-DTP comes from the vocab pass: the head step is written as the standard schedule (the vocab-sharded weight
    all-gathered over the ring, lm_head's projection, the cross-entropy summed over this rank's tokens) and compiled
    with ``boundpass.backend.layout_compile.RingDTPHeadBackend``, which rewrites gather + projection + loss into
    ``boundpass::ring_dtp_fwd`` on this rank's shard: no rank gathers the weight or forms [N, V] logits. It compiles
    at the first call, on every rank together (every rank of the ring calls the loss each step)."""
    import torch.distributed._functional_collectives as funcol
    import torch.nn.functional as F

    from boundpass.backend.layout_compile import RingDTPHeadBackend
    from boundpass.recipes.models import torchtitan_loss

    head = getattr(model, "lm_head", None)
    if not isinstance(head, RingDTPHead):
        return torchtitan_loss()
    state = getattr(model, "_mop", None)
    block = vocab_block if vocab_block is not None else (state.options.vocab_block if state else None)
    group = head.mesh.get_group() if head.mesh.size() > 1 else None

    def head_step(h, w_shard, labels):
        # the standard schedule, which the vocab pass replaces: gather the head's rows from every rank of the ring
        w = funcol.all_gather_tensor_autograd(w_shard, 0, group) if group is not None else w_shard
        logits = F.linear(h, w)
        return F.cross_entropy(logits.float(), labels, reduction="sum", ignore_index=ignore_index)

    backend = RingDTPHeadBackend(group, block or 0) if group is not None else None
    compiled = torch.compile(head_step, backend=backend, fullgraph=True) if backend is not None else None
    if state is not None:
        state.head_backend = backend

    def loss_fn(pred, labels, global_valid_tokens=None, **kwargs):
        del kwargs
        w = head.weight.to_local() if hasattr(head.weight, "to_local") else head.weight
        if w.dtype != pred.dtype:  # FSDP2 mixed precision: the trunk computes in param_dtype, and so does the head
            w = w.to(pred.dtype)   # (as FSDP2 would cast lm_head's weight; the gradient comes back in w's dtype)
        h, y = pred.reshape(-1, pred.shape[-1]), labels.reshape(-1)
        if compiled is not None:
            total = compiled(h, w, y)
        else:  # a ring of one rank: the whole vocabulary is this rank's shard
            total = ring_dtp_loss(h, w, y, vocab_size=head.vocab_size, block=block or 0, ignore_index=ignore_index)
        return (total / global_valid_tokens if global_valid_tokens is not None else total), {}
    return loss_fn


def shard_batch(tokens: torch.Tensor, labels: torch.Tensor, rank: int, world: int):
    """This rank's (tokens, labels, positions) of a [B, L] batch: L/W consecutive tokens at global positions."""
    s = shard_sequence(tokens.shape[1], rank, world)
    return tokens[:, s].contiguous(), labels[:, s].contiguous(), shard_positions(tokens.shape[1], rank, world)

