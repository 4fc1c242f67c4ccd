"""boundpass as the Dynamo backend of a per-block ``torch.compile`` (torchtitan's own ``apply_compile``).

torchtitan compiles every TransformerBlock on its own (``block.compile(backend=..., fullgraph=True)``) and keeps
FSDP2's hooks outside the block graphs. ``CompiledBlocks.backend`` is that backend: each block graph Dynamo
hands it goes through boundpass's passes (dispatch -> PipelinedLLEP, the block's checkpoint boundary -> SCO) and
the planning partitioner of ``boundpass.compiler`` (its peak from the partitioned graphs, or Inductor's final
schedule), then through the lowering torchtitan asked for ("inductor" or "aot_eager").

The budget each block graph is checked against is the whole step's, composed from what the graph cannot see:
- the saved tensors of the other blocks. A block's forward runs while the blocks before it hold what they saved
  for backward, and its backward while they still do: ``sum_{j < i} saved_j``. One graph serves every block of
  the same structure, so a graph is checked for the last block that may run it: the blocks that already ran this
  step count with their own graph's saved bytes, the blocks still to run with the largest any graph saves. When
  a new graph appears every earlier graph is checked again with what is now known (``recheck``), before the
  blocks that run it execute again: nothing runs whose memory was not checked.
- FSDP2's parameter units: the unit of the block running, unsharded, and the next unit prefetched, each held
  twice while it is copied out of the all-gather buffer, plus the reduce-scatter buffer of one unit's gradients
  (``fsdp_units``); units that are not resharded after forward (torchtitan's last unit) stay gathered through the
  step.
- the parameters, gradients and optimizer state of the whole model (``boundpass.compiler._state_terms``).
The head (lm_head -> loss, compiled by ``boundpass.compile(VocabHead(model), ...)``) is checked with every
block's saved tensors held (``head_carry_terms``).
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch.nn as nn

from boundpass.bounds import BoundTerm, BudgetTable, raise_infeasible
from boundpass.compiler import BoundedModule, _int_or_hint, _raise_step_infeasible
from boundpass.units import format_bytes

SHARD = "shard over more ranks (--parallelism.data_parallel_shard_degree) or raise --boundpass.budget"
KNOB = ("reduce tokens per rank (--training.local_batch_size / --training.seq_len), checkpoint every block "
        "(--activation_checkpoint.mode full) and give SCO host memory (--boundpass.host_budget), or raise "
        "--boundpass.budget")


@dataclass
class FSDPUnit:
    """One FSDP2 parameter group: its module path and the bytes it holds unsharded."""
    path: str
    gathered: int        # the unsharded parameters, in FSDP2's param dtype (the all-gather output)
    reduce: int          # the unsharded gradients in FSDP2's reduce dtype (the reduce-scatter input)
    sharded_grads: int   # the gradients it leaves on this rank (its parameters' local shards)
    resharded: bool      # freed after forward (False: held from forward to backward)


def fsdp_units(model: nn.Module) -> list[FSDPUnit]:
    """The FSDP2 units of ``model`` (empty when it is not FSDP2-wrapped)."""
    from torch.distributed.fsdp import FSDPModule
    out = []
    for path, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        # several groups per module when parameters live on different meshes (torchtitan's EP experts)
        groups = getattr(state, "_fsdp_param_groups", None)
        groups = list(groups) if groups is not None else [state._fsdp_param_group]
        for i, group in enumerate(g for g in groups if g is not None):
            out.append(_unit(f"{path}[{i}]" if len(groups) > 1 else path, group))
    return out


def _unit(path: str, group) -> FSDPUnit:
    """One FSDP2 parameter group's unsharded bytes (its all-gather output) and its gradients' (reduce-scatter input)."""
    gathered = reduce = sharded = 0
    for fp in group.fsdp_params:
        mesh = fp.mesh_info
        shards = getattr(mesh, "shard_mesh_size", None) or mesh.mesh.size()
        numel = fp.padded_sharded_param_size.numel() * shards
        # FSDPParam's own dtype attributes are set at FSDP2's lazy init (the first forward): read the policy
        dtype = group.mp_policy.param_dtype or fp.sharded_param.dtype
        gathered += numel * dtype.itemsize
        if fp.sharded_param.requires_grad:
            reduce += numel * (group.mp_policy.reduce_dtype or dtype).itemsize
            local = getattr(fp.sharded_param, "_local_tensor", fp.sharded_param)
            sharded += local.numel() * local.element_size()
    return FSDPUnit(path, gathered, reduce, sharded, group.post_forward_mesh_info is not None)


class CompiledBlocks(BoundedModule):
    """The planning state of every block graph of one model: the Dynamo backend and the step's composition."""

    def __init__(self, model: nn.Module, blocks: list[nn.Module], *, budget: int, host_budget: int | None,
                 state_terms, optimizer_plan, inner: str, sco="auto", dispatch: bool = True,
                 dispatch_cap: int | None = None, max_tokens_per_rank: int | None = None):
        super().__init__(model, None, budget=budget, ring_group=None, vocab_block=None,
                         max_tokens_per_rank=max_tokens_per_rank, inner=inner, fullgraph=False, dynamic=False,
                         state_terms=state_terms, optimizer_plan=optimizer_plan, host_budget=host_budget, sco=sco,
                         dispatch=dispatch, dispatch_cap=dispatch_cap)
        # OffloadStreamAdamW's bucket is fitted once, by the head's boundpass.compile (its owner); a block graph
        # must not narrow it again from its own view of the optimizer phase (compiler._fit_offload_bucket skips an
        # owner whose bucket is set)
        inner = list(getattr(getattr(optimizer_plan, "optimizer", None), "optimizers", []) or [])
        self.optimizer_bucket = next((o.bucket_params for o in inner if hasattr(o, "bucket_params")), None)
        self.num_blocks = len(blocks)
        self.block_modules = list(blocks)
        self.units = fsdp_units(model)
        by_module = {id(m): p for p, m in model.named_modules()}
        self.block_paths = [by_module.get(id(b), "") for b in blocks]
        under = lambda u, p: u.path.split("[")[0] == p or u.path.startswith(p + ".")  # noqa: E731
        self.block_units = [u for u in self.units if any(under(u, p) for p in self.block_paths)]
        # the gradients each block's backward leaves reduced on this rank (its units' local shards)
        self.block_grads = [sum(u.sharded_grads for u in self.units if under(u, p)) for p in self.block_paths]
        self.held_units = [u for u in self.units if not u.resharded and u not in self.block_units]
        # units whose backward runs after every block's (the embedding, the root): their reduce-scatter ends the step's
        # backward, when no block holds anything; the others outside the blocks (the head's) run before the blocks'
        first_block = min((i for i, (_, m) in enumerate(model.named_children()) if any(
            b is m or any(b is c for c in m.modules()) for b in blocks)), default=0)
        before = {name for i, (name, _) in enumerate(model.named_children()) if i < first_block}
        self.input_units = [u for u in self.units if u not in self.block_units
                            and (u.path == "" or u.path.split(".")[0].split("[")[0] in before)]
        self.head_units = [u for u in self.units if u not in self.block_units and u not in self.input_units]
        self.tail = self._tail_table()
        self.graph_saved: list[int] = []   # per compiled block graph: what one block's forward leaves for backward
        self.runs: list[int] = []          # this step: the graph each block forward ran, in order
        self.graph_rows: list[list[BoundTerm]] = []  # per graph: the carry rows its certificate holds
        self.graph_cert: list[int | None] = []  # per graph: its index in self.certificates (None: no backward)
        self.first_input = 0               # the first block's input, held for its backward through the step

    # ------------------------------------------------------------------------------------------- backend
    def backend(self, gm, example_inputs):
        """The Dynamo backend of every block's torch.compile."""
        index = len(self.graph_saved)
        self.graph_saved.append(0)
        self.graph_rows.append([])
        self._compiling = index
        before = len(self.certificates)
        compiled = self._backend(gm, example_inputs)
        self.graph_cert.append(before if len(self.certificates) > before else None)  # inference: nothing planned
        self.recheck()
        return _counting(compiled, self, index)

    def dispatch_root(self) -> nn.Module:
        # a block graph's module paths start at the block being compiled: the one about to run
        return self.block_modules[min(len(self.runs), self.num_blocks - 1)]

    def begin_step(self) -> None:
        """A training step starts: no block has run yet."""
        self.runs.clear()

    # --------------------------------------------------------------------------------------- composition
    def _gather_rows(self) -> list[BoundTerm]:
        largest = max((u.gathered for u in self.block_units), default=0)
        # FSDP2 copies a unit out of its flat all-gather buffer into the unsharded parameters (2x while it does),
        # and prefetches the next unit while one computes: the running unit + the next one being copied out
        return [BoundTerm("FSDP2 all-gathered block units (the running unit + the next, copied out of its buffer)",
                          sympy.Integer(3 * largest), 3 * largest, kind="transient", knob=SHARD),
                _scatter_row(self.block_units), self._gloo_row()] + self._held_rows()

    def _gloo_row(self) -> BoundTerm:
        """ProcessGroupGloo's reduce_scatter runs on a copy of its input, which its worker thread releases after the
        collective; measured on 2 ranks: up to two such copies of earlier reduce-scatters still live at a later one
        (timing-dependent). Counted as the two largest units' reduce buffers (NCCL makes no copy: a GPU run
        measures 0 here and the row could go; bench/gpu_check.sh)."""
        sizes = sorted((u.reduce for u in self.units), reverse=True)[:2]
        return BoundTerm("gloo's copies of up to two earlier reduce-scatter inputs, not yet released",
                         sympy.Integer(sum(sizes)), sum(sizes), kind="transient", knob=SHARD)

    def _held_rows(self) -> list[BoundTerm]:
        held = sum(u.gathered for u in self.held_units)
        if not held:
            return []
        return [BoundTerm("FSDP2 units held unsharded from forward to backward ("
                          + ", ".join(u.path or "root" for u in self.held_units) + ")",
                          sympy.Integer(held), held, kind="transient",
                          knob="--parallelism.fsdp_reshard_after_forward always")]

    def _tail_table(self) -> BudgetTable:
        """The end of the backward, outside any graph: every unit's gradients reduced, and the reduce-scatter of the
        units whose backward comes last (the embedding's): state + gradients + that reduce-scatter."""
        table = BudgetTable(budget=self.budget, host_budget=self.host_budget)
        table.terms += [t for t in self.state_terms]
        reduced = sum(u.sharded_grads for u in self.units)
        table.terms += [_grads_row(reduced, "every unit's"), _scatter_row(self.input_units, output_counted=True),
                        self._gloo_row()]
        return table

    def _block_rows(self, graph: int, own_saved: int) -> list[BoundTerm]:
        """The other blocks while block i runs its forward or backward: the saved tensors of the blocks before it and
        the reduced gradients of the blocks after it (and of the head), for the worst block i that may run ``graph``
        (a block that already ran it this step, or any block still to run). Blocks still to run save at most what
        the widest graph known saves."""
        ran = len(self.runs)
        widest = max([own_saved, *self.graph_saved])
        saved = [self.graph_saved[g] for g in self.runs[:self.num_blocks]] + [widest] * (self.num_blocks - ran)
        head = sum(u.sharded_grads for u in self.head_units)
        candidates = [i for i, g in enumerate(self.runs[:self.num_blocks]) if g == graph]
        candidates += list(range(min(ran, self.num_blocks), self.num_blocks))
        worst = max(candidates or [0], key=lambda i: sum(saved[:i]) + sum(self.block_grads[i + 1:]))
        before, after = sum(saved[:worst]), sum(self.block_grads[worst + 1:]) + head
        return [BoundTerm("the first block's input (the embedding's output, held for that block's backward)",
                          sympy.Integer(self.first_input), self.first_input, kind="transient", knob=KNOB),
                BoundTerm(f"saved tensors of the {worst} block(s) before block {worst} (the worst block that may run "
                          "this graph)", sympy.Integer(before), before, kind="transient", knob=KNOB),
                _grads_row(after, f"the head's and those of the {self.num_blocks - 1 - worst} block(s) after it")]

    def carry_terms(self, peak, backed: dict) -> list[BoundTerm]:
        own = _int_or_hint(peak.saved_bytes, backed)
        self.graph_saved[self._compiling] = own
        inputs = sum(_int_or_hint(st.nbytes, backed) for st in peak.storages
                     if st.kind == "input" and not st.name.startswith("tangents"))
        self.first_input = max(self.first_input, inputs)
        rows = self._block_rows(self._compiling, own) + self._gather_rows()
        self.graph_rows[self._compiling] = rows
        return rows

    def recheck(self) -> None:
        """Check every block graph's certificate again with what is known now (a new graph may save more)."""
        for graph, at in enumerate(self.graph_cert):
            if at is None:
                continue
            cert, old = self.certificates[at], self.graph_rows[graph]
            table = cert.table
            table.terms = [t for t in table.terms if all(t is not o for o in old)]
            # the check is for the last block that may run this graph: the runs so far, the rest at the widest
            rows = self._block_rows(graph, self.graph_saved[graph]) + self._gather_rows()
            old[:] = rows
            table.terms += rows
            cert.planner.carry = sum(t.value for t in rows)
            if not table.fits():
                _raise_step_infeasible(self, cert, cert.planner.knobs, self.sco_plans[graph])

    def trunk_saved(self) -> int:
        """Bytes every block's forward of this step left for backward (the head runs with all of them held)."""
        if len(self.runs) >= self.num_blocks:
            return sum(self.graph_saved[g] for g in self.runs[:self.num_blocks])
        widest = max(self.graph_saved, default=0)
        return sum(self.graph_saved[g] for g in self.runs) + (self.num_blocks - len(self.runs)) * widest

    def head_carry_terms(self) -> list[BoundTerm]:
        """The rows the head's certificate adds: every block's saved tensors, the head's units (held unsharded,
        reduce-scattered after its backward); its backward is the step's first, so nothing is reduced before it."""
        saved = self.trunk_saved()
        return [BoundTerm("the first block's input (the embedding's output, held for that block's backward)",
                          sympy.Integer(self.first_input), self.first_input, kind="transient", knob=KNOB),
                BoundTerm(f"saved tensors of the {self.num_blocks} blocks (held through the head)",
                          sympy.Integer(saved), saved, kind="transient", knob=KNOB),
                _scatter_row(self.head_units), self._gloo_row()] + self._held_rows()

    def certified_peak(self) -> int:
        """The largest of the block graphs' totals and the backward's tail (bytes)."""
        return max([c.table.total for c in self.certificates] + [self.tail.total])

    def check_tail(self) -> None:
        """Raise before anything runs if the backward's tail (state + gradients + the embedding's reduce-scatter)
        cannot fit: it depends on the model and FSDP2's units only."""
        if not self.tail.fits():
            binding = max((t for t in self.tail.terms if t.counted), key=lambda t: t.value)
            raise_infeasible(self.tail, binding, detail="(the end of the backward: every gradient reduced, the "
                             "embedding's reduce-scatter in flight)")


def _grads_row(nbytes: int, which: str) -> BoundTerm:
    return BoundTerm(f"gradients already reduce-scattered by FSDP2 (sharded; {which})", sympy.Integer(nbytes), nbytes,
                     kind="transient", knob=SHARD)


def _scatter_row(units: list[FSDPUnit], output_counted: bool = False) -> BoundTerm:
    """The largest reduce-scatter among ``units``: its unsharded gradient (param dtype), the reduce-dtype input
    buffer, the copy gloo's reduce_scatter makes of that input (ProcessGroupGloo; seen under torch's profiler),
    and the sharded output (unless a gradients row counts it)."""
    cost = lambda u: u.gathered + 2 * u.reduce + (0 if output_counted else u.sharded_grads)  # noqa: E731
    widest = max(units, key=cost, default=None)
    nbytes = cost(widest) if widest is not None else 0
    return BoundTerm(f"FSDP2 gradient reduce-scatter of the largest unit ({widest.path if widest else '-'})",
                     sympy.Integer(nbytes), nbytes, kind="transient", knob=SHARD)


def _counting(compiled, blocks: CompiledBlocks, index: int):
    """``compiled`` that records, on each forward call, which graph a block ran; arguments pass through as Dynamo
    gives them (its boxed flag copied)."""
    def run(*args, **kwargs):
        blocks.runs.append(index)
        return compiled(*args, **kwargs)
    if hasattr(compiled, "_boxed_call"):
        run._boxed_call = compiled._boxed_call
    return run
