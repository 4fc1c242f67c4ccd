"""boundpass as the Dynamo backend of a per-block ``torch.compile`` (torchtitan's own ``apply_compile``).

torchtitan compiles every TransformerBlock on its own (``block.compile(backend=..., fullgraph=True)``) and keeps
FSDP2's hooks outside the block graphs. ``CompiledBlocks.backend`` is that backend: each block graph Dynamo
hands it goes through boundpass's passes (dispatch -> PipelinedLLEP, the block's checkpoint boundary -> SCO) and
the planning partitioner of ``boundpass.backend.compiler`` (its peak from the partitioned graphs, or Inductor's final
schedule), then through the lowering torchtitan asked for ("inductor" or "aot_eager").

The budget each block graph is checked against is the whole step's, composed from what the graph cannot see:
- the saved tensors of the other blocks. A block's forward runs while the blocks before it hold what they saved
  for backward, and its backward while they still do: ``sum_{j < i} saved_j``. One graph serves every block of
  the same structure, so a graph is checked for the last block that may run it: the blocks that already ran this
  step count with their own graph's saved bytes, the blocks still to run with the largest any graph saves. When
  a new graph appears every earlier graph is checked again with what is now known (``recheck``), before the
  blocks that run it execute again: nothing runs whose memory was not checked.
- FSDP2's parameter units: the running block's units, unsharded, and the next module's, prefetched and held twice
  while copied out of the all-gather buffer or, on gloo, in flight (``fsdp_units``, ``_units_row``: in the
  forward the next block's, in the backward the block before's, the embedding's before block 0's); units that
  are not resharded after forward (torchtitan's ``[norm, lm_head]``) stay gathered through the step.
- the gradients FSDP2 already reduce-scattered: those of the blocks after block i (and the head's) while block i's
  backward runs, none in its forward. The rows that depend on the block are counted for the block and phase
  (forward / backward) whose rows sum the largest (``_block_rows``), not each at its own worst.
- the reduce-scatter of one unit's gradients. With every unit on ``boundpass.backend.gloo_release`` (the recipe
  installs it on gloo: synchronous, its buffers freed in the call) each reduce-scatter runs between two graphs
  and is a phase of its own (``sync_reduce``: ``reduce_tables`` per block graph, ``head_reduce``, the tail), with
  what FSDP2 holds then: the block's other units, the next module's prefetched all-gather buffer, and the unit's
  gradients, copy-in temporary and reduce buffer in ``foreach_reduce``'s order (``_scatter_cost``);
  otherwise (FSDP2's own, NCCL's reduce-scatter stream beside the next block's backward) the largest one is
  counted inside every graph's table, with gloo's held clones where the group is gloo.
- the parameters, gradients and optimizer state of the whole model (``boundpass.backend.compiler.state_terms_of``).
The head (lm_head -> loss, compiled by ``boundpass.compile(VocabHead(model), ...)``) is checked with every
block's saved tensors held (``head_carry_terms``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import sympy
import torch
import torch.nn as nn

from boundpass.bound.bounds import BoundTerm, BudgetTable, raise_infeasible
from boundpass.backend.compiler import BoundedModule
from boundpass.measure.step_peak import int_or_hint
from boundpass.planning.planner import raise_step_infeasible
from boundpass.core.config import Config
from boundpass.core.errors import BoundpassInputError

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
    releasing: bool = False  # reduce-scatters through boundpass.backend.gloo_release (no gloo clone, none held)
    copy_in: int = 0     # FSDP2's copy-in temporary when the reduce dtype differs: torch._chunk_cat into the fp32
                         # reduce buffer from bf16 gradients converts one gradient at a time (measured: three 12 MiB
                         # bf16 gradients -> a 12 MiB temporary, not 36), so the largest gradient in its own dtype
    single_rank: bool = False  # its shard group has one rank: FSDP2 divides into a temporary instead of reducing
    nccl: bool = False   # its shard group runs on NCCL (no gloo copies)
    aliases: list = field(default_factory=list)  # other module paths sharing this group

    def covers(self, path: str) -> bool:
        """True when ``path`` is this unit's module (or one sharing its group) or inside one."""
        return any(p.split("[")[0] == path or p.startswith(path + ".") for p in [self.path, *self.aliases])


def fsdp_units(model: nn.Module) -> list[FSDPUnit]:
    """The FSDP2 units of ``model`` (empty when it is not FSDP2-wrapped)."""
    from boundpass.backend.gloo_release import fsdp_param_groups
    out, seen = [], {}
    for name, group in fsdp_param_groups(model):
        if id(group) in seen:
            # one group shared by several modules (torchtitan's fully_shard([norm, lm_head])): one unit, one
            # all-gather, one reduce-scatter; counted once, under the first module's path
            seen[id(group)].aliases.append(name)
            continue
        seen[id(group)] = unit = _unit(name, group)
        out.append(unit)
    return out


def _unit(path: str, group) -> FSDPUnit:
    """One FSDP2 parameter group's unsharded bytes (its all-gather output) and its gradients' (reduce-scatter input)."""
    gathered = reduce = sharded = copy_in = 0
    single = False
    for fp in group.fsdp_params:
        mesh = fp.mesh_info
        shards = getattr(mesh, "shard_mesh_size", None) or mesh.mesh.size()
        single = single or shards == 1
        numel = fp.padded_sharded_param_size.numel() * shards
        # FSDPParam's own dtype attributes are set at FSDP2's lazy init (the first forward): read the policy
        dtype = group.mp_policy.param_dtype or fp.sharded_param.dtype
        gathered += numel * dtype.itemsize
        if fp.sharded_param.requires_grad:
            reduce_dtype = group.mp_policy.reduce_dtype or dtype
            reduce += numel * reduce_dtype.itemsize
            copy_in = max(copy_in, numel * dtype.itemsize if reduce_dtype != dtype else 0)
            local = getattr(fp.sharded_param, "_local_tensor", fp.sharded_param)
            sharded += local.numel() * local.element_size()
    import torch.distributed as dist

    from boundpass.backend.gloo_release import uses_releasing_reduce_scatter
    nccl = dist.get_backend(group.mesh_info.shard_process_group) == "nccl"
    return FSDPUnit(path, gathered, reduce, sharded, group.post_forward_mesh_info is not None,
                    releasing=uses_releasing_reduce_scatter(group), copy_in=copy_in, single_rank=single, nccl=nccl)


class CompiledBlocks(BoundedModule):
    """The planning state of every block graph of one model: the Dynamo backend and the step's composition."""

    def __init__(self, model: nn.Module, blocks: list[nn.Module], config: Config, *, state_terms, optimizer_plan):
        """config: the head's boundpass.Config (the same budgets and knobs; its ``inner`` lowers the block graphs).
        A block graph holds no vocab region and no optimizer: vocab.* and optimizer.* are the head's to use."""
        super().__init__(model, None, config, state_terms=state_terms, optimizer_plan=optimizer_plan,
                         fullgraph=False, dynamic=False)
        # OffloadStreamAdamW's bucket is fitted once, by the head's boundpass.compile (its owner); a block graph
        # must not narrow it again from its own view of the optimizer phase (the planner fits it only for an owner
        # whose bucket is not set)
        inner = list(getattr(getattr(optimizer_plan, "optimizer", None), "optimizers", []) or [])
        self.optimizer_bucket = next((o.bucket_params for o in inner if hasattr(o, "bucket_params")), None)
        self.num_blocks = len(blocks)
        self.block_modules = list(blocks)
        self.units = fsdp_units(model)
        by_module = {id(m): p for p, m in model.named_modules()}
        self.block_paths = [by_module.get(id(b), "") for b in blocks]
        under = lambda u, p: u.covers(p)  # noqa: E731
        self.block_units = [u for u in self.units if any(under(u, p) for p in self.block_paths)]
        # per block, its units: they unshard together (a block with routed experts has two groups)
        self.units_of_block = [[u for u in self.block_units if under(u, p)] for p in self.block_paths]
        # the gradients each block's backward leaves reduced on this rank (its units' local shards)
        self.block_grads = [sum(u.sharded_grads for u in self.units if under(u, p)) for p in self.block_paths]
        if not self.units:  # not FSDP2-wrapped: a block's backward leaves its parameters' whole gradients
            self.block_grads = [sum(_local_bytes(p) for p in b.parameters() if p.requires_grad) for b in blocks]
        self.held_units = [u for u in self.units if not u.resharded and u not in self.block_units]
        # units whose backward runs after every block's (the embedding, the root): their reduce-scatter ends the step's
        # backward, when no block holds anything; the others outside the blocks (the head's) run before the blocks'
        first_block = min((i for i, (_, m) in enumerate(model.named_children()) if any(
            b is m or any(b is c for c in m.modules()) for b in blocks)), default=0)
        before = {name for i, (name, _) in enumerate(model.named_children()) if i < first_block}
        self.input_units = [u for u in self.units if u not in self.block_units
                            and any(p == "" or p.split(".")[0].split("[")[0] in before for p in [u.path, *u.aliases])]
        self.head_units = [u for u in self.units if u not in self.block_units and u not in self.input_units]
        self.tail = self._tail_table()
        self.head_reduce: BudgetTable | None = None  # built with the head's certificate (head_carry_terms)
        self.reduce_tables: dict[int, BudgetTable] = {}  # block graph -> its reduce-scatter phase (sync_reduce)
        self.graph_saved: list[int] = []   # per compiled block graph: what one block's forward leaves for backward
        self.runs: list[int] = []          # this step: the graph each block forward ran, in order
        self.graph_rows: list[list[BoundTerm]] = []  # per graph: the carry rows its certificate holds
        self.graph_cert: list[int | None] = []  # per graph: its index in self.certificates (None: no backward)
        self.first_input = 0               # the first block's input, held for its backward through the step
        # SCO across the blocks (one runtime for every block graph; boundpass/passes/sco_pass.SCOPass.find_block): the
        # first ``sco_count`` blocks (forward order) offload their input boundary to the host pool
        # a block graph's input and output are the trunk's hidden states, which the caller passes from block to block
        # and does not hold through backward: the graph analysis counts them as the graph sees them, the rows below
        # count them as the other blocks' (step_peak.analyze_graphs ctx["per_block"])
        self.per_block = True
        # certify only (the recipe's --boundpass.certify_only): a block graph compiles and is checked, then its calls
        # return uninitialised tensors of its outputs' shapes without running a kernel (``_dry``)
        self.dry = False
        self.sco_runtime = None
        self.sco_count = 0
        self.sco_ok = True                 # False once a block graph could not be rewritten: no block is planned off
        self.boundary = 0                  # bytes of one block's boundary (its input hidden states)
        self.hidden = 0                    # bytes of a block graph's first input (the hidden states it is passed)

    # ------------------------------------------------------------------------------------------- backend
    def backend(self, gm, example_inputs):
        """The Dynamo backend of every block's torch.compile."""
        index = len(self.graph_saved)
        outputs = _output_examples(gm) if self.dry else None  # before the passes rewrite the graph
        self.graph_saved.append(0)
        self.graph_rows.append([])
        self._compiling = index
        before = len(self.certificates)
        compiled = self._backend(gm, example_inputs)
        self.graph_cert.append(before if len(self.certificates) > before else None)  # inference: nothing planned
        plan = self.sco_plans[-1]
        if plan.dynamic and plan.eligible and self.graph_cert[-1] is not None:
            if plan.rewritten:
                self.sco_count = max(self.sco_count, plan.offloaded)
            else:
                self.sco_ok = False
            self.sco_runtime.set_offload_count(self.sco_count if self.sco_ok else 0)
        self.recheck()
        if self.dry:
            return _dry(outputs, self, index, plan.rewritten and plan.dynamic and bool(plan.eligible))
        return _counting(compiled, self, index)

    def dispatch_root(self) -> nn.Module:
        # a block graph's module paths start at the block being compiled: the one about to run
        return self.block_modules[min(len(self.runs), self.num_blocks - 1)]

    def begin_step(self) -> None:
        """A training step starts: no block has run yet (nor offloaded anything)."""
        self.runs.clear()
        if self.sco_runtime is not None:
            self.sco_runtime.offloaded = [False] * self.num_blocks

    def _find_sco(self, gm, host_pool: int | None):
        """Every block graph shares one SCO runtime; the host pool takes a forward prefix of the blocks."""
        from boundpass.passes.pipeline import SCO
        from boundpass.passes.sco_pass import boundary_device, cap_plan
        from boundpass.runtime import sco as sco_rt
        if self.sco_runtime is None and self.boundpass_config.sco.enable is not False:
            runs = self.runs  # not self: the runtime is reachable from the compiled graphs (see _counting)
            self.sco_runtime = sco_rt.BlockSCO(self.num_blocks, 0, boundary_device(gm),
                                               current_block=lambda: len(runs) - 1)
        first = next((n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"), None)
        if isinstance(first, torch.Tensor) and first.is_floating_point():
            # the block's first argument: the trunk's hidden states, block i-1's output (see _block_rows)
            self.hidden = max(self.hidden, first.numel() * first.element_size())
            self._batch_row(int(first.numel() // first.shape[-1]))
        plan = SCO.find_block(gm, self.boundpass_config, runtime=self.sco_runtime)
        if plan.eligible:
            self.boundary = max(self.boundary, plan.eligible[0].boundary_bytes)
            pool = host_pool if host_pool is not None else self.num_blocks * self.boundary
            self.sco_runtime.host_budget = pool
            plan.host_pool = host_pool
            cap_plan(plan, sco_rt.planned_offloaded_layers([self.boundary] * self.num_blocks, pool),
                     self.boundpass_config.sco.max_layers)
        return plan

    def offloaded_blocks(self, trial: int | None = None) -> list[bool]:
        """Per block, whether its boundary is on the host this step: what the runtime did for the blocks that ran,
        the plan (the first ``sco_count`` blocks, or ``trial`` while a graph's planner tries more) for the rest."""
        n, ran = self.num_blocks, min(len(self.runs), self.num_blocks)
        if self.sco_runtime is None:
            return [False] * n
        planned = max(self.sco_count, trial or 0) if self.sco_ok else 0
        return [self.sco_runtime.offloaded[j] if j < ran else j < planned for j in range(n)]

    # --------------------------------------------------------------------------------------- composition
    @property
    def sync_reduce(self) -> bool:
        """Every FSDP2 unit reduce-scatters through boundpass.backend.gloo_release: synchronously, between two graphs,
        its buffers freed in the call. Then a reduce-scatter never overlaps a graph's workspace, and each block's
        (and the head's) is a phase of its own. Otherwise (NCCL: FSDP2's reduce-scatter stream runs beside the next
        block's backward; stock gloo: copies held by worker threads) it is counted inside every graph's table."""
        return bool(self.units) and all(u.releasing for u in self.units)

    def _next_units(self, i: int, phase: str) -> int:
        """Bytes of the module FSDP2 prefetches while block i runs (torchtitan's explicit prefetch): in the forward the
        next block's units (after the last block, the head's), in the backward the block before's (before block 0's
        backward, the embedding's: the input units)."""
        if phase == "forward":
            units = self.units_of_block[i + 1] if i + 1 < self.num_blocks else self.head_units
        else:
            units = self.units_of_block[i - 1] if i > 0 else self.input_units
        return sum(u.gathered for u in units)

    def _units_row(self, i: int, phase: str) -> BoundTerm:
        # A block's units unshard together (a block with routed experts has two: torchtitan's EP experts are a group
        # of their own), and FSDP2 prefetches the next module's while one computes (``_next_units``). The next
        # module's units are held twice: while copied out of the all-gather buffer into the unsharded parameters,
        # and on gloo while the collective is in flight (ProcessGroupGloo's own output beside FSDP2's buffer,
        # _reduce_gather_rows). Counted for the block and phase the table is for: the largest block's units and
        # 2x the largest module, whatever the block, left 37 MiB of qwen3's block graph table unused (4 ranks: block
        # 0's backward prefetches the 16 MiB embedding, not a 39 MiB block)
        running = sum(u.gathered for u in self.units_of_block[i]) if self.units_of_block else 0
        held = running + 2 * self._next_units(i, phase)
        return BoundTerm(f"FSDP2 all-gathered block units (block {i}'s + the {phase} prefetch's, held twice while "
                         "copied out or in flight)", sympy.Integer(held), held, kind="transient", knob=SHARD)

    def _gather_rows(self, scatter: bool = True) -> list[BoundTerm]:
        """FSDP2's rows of a block graph's table that do not depend on the block (its units: ``_units_row``)."""
        return ([_scatter_row(self.block_units)] if scatter else []) + self._gloo_row() + self._held_rows()

    def _passed_row(self) -> BoundTerm:
        passed = 2 * self.hidden
        return BoundTerm("the gradient passed to the block before (and its input's, while FSDP2's hook runs)",
                         sympy.Integer(passed), passed, kind="transient", knob=KNOB)

    def _block_reduce_table(self, graph: int, own_saved: int, trial: int | None = None) -> BudgetTable:
        """Right after the backward of the worst block that may run ``graph``, while its units reduce-scatter
        (``sync_reduce``): the same rows as its graph's table, the graph's own workspace replaced by the gradient
        it passes on, plus the reduce-scatter."""
        table = BudgetTable(budget=self.budget, host_budget=self.host_budget)
        table.terms += ([t for t in self.state_terms]
                        + self._block_rows(graph, own_saved, trial, per_block=self._reduce_gather_rows,
                                           phases=("backward",))
                        + [self._passed_row()] + self._gloo_row() + self._held_rows(after_head=True)
                        + self._sco_host_rows(trial))
        return table

    def _reduce_gather_rows(self, i: int, phase: str = "backward") -> list[BoundTerm]:
        """FSDP2's units while one unit of a block reduce-scatters, after the block's backward. FSDP2's post-backward
        reshards a unit before reducing it, so the running block holds only its other units (a block with routed
        experts has two: torchtitan's EP experts are a group of their own), gathered until their own post-backward;
        the next module's units were all-gathered by the backward prefetch (their all-gather buffer: the copy-out
        waits for that module's pre-backward, which comes after this post-backward). The head's units were resharded
        after the head's backward, the step's first. Measured (qwen3 debug, 4 ranks, experts reducing): the block's
        other unit (3 MiB) and the embedding's prefetched buffer (16 MiB), where the graph's rows count 3x the
        largest unit (108 MiB) and the head's units (16 MiB). For block i (the block whose phase the table is):
        its largest reduce-scatter and the module its backward prefetched (block i-1's units, the embedding's before
        block 0)."""
        worst, reducing = 0, None
        units = self.units_of_block[i] if self.units_of_block else []
        for u in units:
            cost = _scatter_cost(u) + sum(g.gathered for g in units if g is not u)
            if cost > worst:
                worst, reducing = cost, u
        ahead = self._next_units(i, phase)
        # on gloo the prefetch's collective may still be in flight, and ProcessGroupGloo's all-gather holds an output
        # of its own beside FSDP2's buffer until then (measured in a MoP layout's forward prefetch: both 15 MiB)
        copies = 2 if any(not u.nccl for u in self.units) else 1
        return [BoundTerm(f"FSDP2 gradient reduce-scatter of block {i}'s largest unit "
                          f"({reducing.path if reducing else '-'}), its other units still unsharded",
                          sympy.Integer(worst), worst, kind="transient", knob=SHARD),
                BoundTerm(f"FSDP2 units of the module block {i}'s backward prefetched (its buffer"
                          + (", and gloo's own output while the collective is in flight)" if copies == 2 else ")"),
                          sympy.Integer(copies * ahead), copies * ahead, kind="transient", knob=SHARD)]

    def _check_reduce_table(self, table: BudgetTable, which: str) -> None:
        if not table.fits():
            raise_infeasible(table, table.breaking_term(),
                             detail=f"({which}: its FSDP2 units' gradients reduce-scattered)")

    def _gloo_row(self) -> list[BoundTerm]:
        """ProcessGroupGloo's reduce_scatter runs on a copy of its input, which its worker thread releases after the
        collective; measured on 2 ranks: up to two such copies of earlier reduce-scatters still live at a later one
        (timing-dependent). Counted as the two largest units' reduce buffers (NCCL makes no copy: a GPU run
        measures 0 here and the row could go; bench/gpu_check.sh). A unit that reduce-scatters through
        boundpass.backend.gloo_release (the recipe installs it on gloo) makes no copy and leaves none held."""
        sizes = sorted((u.reduce for u in self.units if not (u.releasing or u.single_rank)), reverse=True)[:2]
        if not sizes:
            return []
        return [BoundTerm("gloo's copies of up to two earlier reduce-scatter inputs, not yet released",
                          sympy.Integer(sum(sizes)), sum(sizes), kind="transient", knob=SHARD)]

    def _held_rows(self, after_head: bool = False) -> list[BoundTerm]:
        """Units FSDP2 does not reshard after forward (torchtitan's last one), gathered until their post-backward;
        ``after_head``: the head's have been resharded after the head's backward, the step's first."""
        units = [u for u in self.held_units if not (after_head and u in self.head_units)]
        held = sum(u.gathered for u in units)
        if not held:
            return []
        return [BoundTerm("FSDP2 units held unsharded from forward to backward ("
                          + ", ".join("+".join(p or "root" for p in [u.path, *u.aliases]) for u in units)
                          + ")",
                          sympy.Integer(held), held, kind="transient",
                          knob="--parallelism.fsdp_reshard_after_forward always")]

    def _tail_table(self) -> BudgetTable:
        """The end of the backward, outside any graph: every unit's gradients reduced, and the reduce-scatter of the
        units whose backward comes last (the embedding's): state + gradients + that reduce-scatter."""
        table = BudgetTable(budget=self.budget, host_budget=self.host_budget)
        table.terms += [t for t in self.state_terms]
        reduced = sum(u.sharded_grads for u in self.units)
        table.terms += [_grads_row(reduced, "every unit's"), _scatter_row(self.input_units, output_counted=True),
                        *self._gloo_row()]
        return table

    def _batch_row(self, tokens: int) -> None:
        """The batch beside the tail (state + every gradient reduced): this step's token ids and labels (int64), and
        what the data loader held of the last step's until this step's replaced them (measured on torchtitan's
        loader at torch's allocator: six int64 per token, allocated before the step and freed in it, which a
        step's measurement counts from its start), and the step's scalar tensors (the loss, token counts: 36 B
        measured; 256 B allowed). The block graphs' tables hold a block's activations instead."""
        nbytes = tokens * 8 * (2 + 6) + 256
        rows = [t for t in self.tail.terms if t.name.startswith("the batch")]
        if rows and rows[0].value >= nbytes:
            return
        self.tail.terms = [t for t in self.tail.terms if t not in rows] + [BoundTerm(
            f"the batch ({tokens:,} tokens: token ids and labels, and the data loader's last batch, int64; the "
            "step's scalars)",
            sympy.Integer(nbytes), nbytes, kind="transient", knob=KNOB)]
        self.check_tail()

    def _block_rows(self, graph: int, own_saved: int, trial: int | None = None, per_block=None,
                    phases: tuple = ("forward", "backward")) -> list[BoundTerm]:
        """The other blocks while block i runs its forward or backward: the saved tensors of the blocks before it and
        the reduced gradients of the blocks after it (and of the head), for the worst block i that may run ``graph``
        (a block that already ran it this step, or any block still to run). Blocks still to run save at most what
        the widest graph known saves.

        SCO: block j's saved bytes include its output, block j+1's boundary. An offloaded boundary of a block before
        block i is on the host while block i runs (the first block's input likewise), except the one block i's
        backward prefetches: block i-1's, copied back while block i's backward runs.

        ``per_block(i, phase)``: the rows that depend on the block and the phase (default: its FSDP2 units,
        ``_units_row``). The block and the phase are the ones whose rows sum the largest: the reduced gradients of
        the blocks after block i exist in its backward only, and its units and the prefetch differ per block."""
        per_block = per_block or (lambda i, phase: [self._units_row(i, phase)])
        ran = len(self.runs)
        widest = max([own_saved, *self.graph_saved])
        saved = [self.graph_saved[g] for g in self.runs[:self.num_blocks]] + [widest] * (self.num_blocks - ran)
        head = sum(u.sharded_grads for u in self.head_units)
        off = self.offloaded_blocks(trial)
        candidates = [i for i, g in enumerate(self.runs[:self.num_blocks]) if g == graph]
        candidates += list(range(min(ran, self.num_blocks), self.num_blocks))

        def rows_of(i: int):
            # block 0 counts its own input; block i > 0 counts its input, which is also block i-1's output (in
            # saved[i-1]): counted once, by block i's graph
            first = 0 if i == 0 or off[0] else self.first_input
            on_host = sum(off[1:i]) * self.boundary + (min(self.hidden, saved[i - 1]) if i > 0 else 0)
            prefetch = self.boundary if i > 0 and off[i - 1] else 0
            return first, sum(saved[:i]) - on_host, prefetch, sum(self.block_grads[i + 1:]) + head, sum(off[1:i])
        def total(i, phase):
            first, before, prefetch, after, _ = rows_of(i)
            return first + before + prefetch + (after if phase == "backward" else 0) + sum(
                t.value for t in per_block(i, phase))
        worst, phase = max(((i, ph) for i in (candidates or [0]) for ph in phases), key=lambda ip: total(*ip))
        first, before, prefetch, after, hosted = rows_of(worst)
        after = after if phase == "backward" else 0
        rows = [BoundTerm("the first block's input (the embedding's output, held for that block's backward)"
                          + ("; on the host (SCO)" if worst > 0 and off[0] else "")
                          + ("; counted by this graph" if worst == 0 else ""),
                          sympy.Integer(first), first, kind="transient", knob=KNOB),
                BoundTerm(f"saved tensors of the {worst} block(s) before block {worst} (the worst block that may run "
                          "this graph" + (f"; its input, block {worst - 1}'s output, counted by the graph" if worst
                                          else "") + ")"
                          + (f", {hosted} boundaries of them on the host (SCO)" if hosted else ""),
                          sympy.Integer(before), before, kind="transient", knob=KNOB)]
        if self.sco_runtime is not None and self.sco_ok and any(off):
            # each block's forward saves an 8-byte token (int64) in place of its boundary; the graphs count their own
            # and earlier blocks' while they are saved, autograd may release the running block's a little later
            tokens = 8 * self.num_blocks
            rows.append(BoundTerm(f"SCO tokens (one int64 per block, {self.num_blocks} blocks)",
                                  sympy.Integer(tokens), tokens, kind="transient", knob=KNOB))
        if prefetch:
            rows.append(BoundTerm(f"SCO prefetch of block {worst - 1}'s boundary (block {worst}'s backward copies it "
                                  "back)", sympy.Integer(prefetch), prefetch, kind="transient", knob=KNOB))
        rows.append(_grads_row(after, f"the head's and those of the {self.num_blocks - 1 - worst} block(s) after it"
                               if phase == "backward" else f"none yet in block {worst}'s forward"))
        return rows + per_block(worst, phase)

    def _sco_host_rows(self, trial: int | None = None) -> list[BoundTerm]:
        """The SCO host pool: one buffer per offloaded block, reused across steps."""
        from boundpass.runtime import sco as sco_rt
        count = max(self.sco_count, trial or 0) if self.sco_ok and self.sco_runtime is not None else 0
        if not count:
            return []
        return [BoundTerm(f"SCO boundary pool on host (the first {count} of {self.num_blocks} blocks)",
                          sco_rt.sco_host_bound(), count * self.boundary, kind="host",
                          knob="--boundpass.host_budget <larger> or --boundpass.sco.enable False")]

    def carry_terms(self, peak, backed: dict) -> list[BoundTerm]:
        own = int_or_hint(peak.saved_bytes, backed)
        self.graph_saved[self._compiling] = own
        inputs = sum(int_or_hint(st.nbytes, backed) for st in peak.storages
                     if st.kind == "input" and not st.name.startswith("tangents"))
        self.first_input = max(self.first_input, inputs)
        plan = self.sco_plans[-1] if self.sco_plans else None
        trial = plan.offloaded if plan is not None and plan.dynamic and plan.rewritten else None
        if plan is not None and plan.dynamic and plan.eligible and not plan.rewritten:
            trial = None
            self.sco_ok = False  # this graph saves its boundary as usual: no block is counted off the device
        rows = self._compose(self._compiling, own, trial)
        self.graph_rows[self._compiling] = rows
        return rows

    def _compose(self, graph: int, own_saved: int, trial: int | None = None) -> list[BoundTerm]:
        """The rows a block graph's certificate carries; with ``sync_reduce`` also its reduce-scatter phase, built
        and checked here (raises before the graph runs)."""
        sync = self.sync_reduce
        rows = (self._block_rows(graph, own_saved, trial) + self._gather_rows(scatter=not sync)
                + self._sco_host_rows(trial))
        if sync:
            self.reduce_tables[graph] = table = self._block_reduce_table(graph, own_saved, trial)
            self._check_reduce_table(table, f"after a backward of block graph {graph}")
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
            rows = self._compose(graph, self.graph_saved[graph])
            old[:] = rows
            table.terms += rows
            cert.planner.carry = sum(t.value for t in rows if t.kind != "host")
            if not table.host_fits():
                raise_infeasible(table, max((t for t in table.terms if t.kind == "host"), key=lambda t: t.value))
            if not table.fits():
                raise_step_infeasible(cert, cert.planner.knobs, self.sco_plans[graph], optimizer_plan=self.optimizer_plan)

    def trunk_saved(self) -> int:
        """Bytes every block's forward of this step left for backward (the head runs with all of them held)."""
        if len(self.runs) >= self.num_blocks:
            return sum(self.graph_saved[g] for g in self.runs[:self.num_blocks])
        widest = max(self.graph_saved, default=0)
        return sum(self.graph_saved[g] for g in self.runs) + (self.num_blocks - len(self.runs)) * widest

    def head_carry_terms(self) -> list[BoundTerm]:
        """The rows the head's certificate adds while its graph runs: every block's saved tensors and the head's units
        held unsharded; its backward is the step's first, so nothing is reduced before it. The head's units are
        reduce-scattered after its graph (FSDP2's post-backward fires once the group's gradients exist): that
        phase is its own table (``head_reduce``), built and checked here too, before the head runs."""
        if not self.sync_reduce:
            return self._head_held_rows() + [_scatter_row(self.head_units)] + self._gloo_row() + self._held_rows()
        self.head_reduce = self._head_reduce_table()
        self._check_reduce_table(self.head_reduce, "after the head's backward, every block's saved tensors held")
        return self._head_held_rows() + self._gloo_row() + self._held_rows()

    def _head_held_rows(self) -> list[BoundTerm]:
        """The first block's input and every block's saved tensors (those SCO put on the host excepted)."""
        off = self.offloaded_blocks()
        hosted = sum(off[1:])  # block j's saved bytes hold block j+1's boundary; the last block's output is the head's
        # the last block's output is the head's input, which the head's graph counts
        saved = max(self.trunk_saved() - hosted * self.boundary - self.hidden, 0)
        first = 0 if off[0] else self.first_input
        return [BoundTerm("the first block's input (the embedding's output, held for that block's backward)"
                          + ("; on the host (SCO)" if off[0] else ""),
                          sympy.Integer(first), first, kind="transient", knob=KNOB),
                BoundTerm(f"saved tensors of the {self.num_blocks} blocks (held through the head)"
                          + (f", {hosted} boundaries of them on the host (SCO)" if hosted else ""),
                          sympy.Integer(saved), saved, kind="transient", knob=KNOB)]

    def _head_reduce_table(self) -> BudgetTable:
        """Right after the head's backward: state, every block's saved tensors, the gradient the head passes to the
        last block (and, while the final norm's backward runs, the norm's input gradient beside it), the head's
        units held unsharded, and their reduce-scatter. The head graph's own workspace is gone by then."""
        table = BudgetTable(budget=self.budget, host_budget=self.host_budget)
        table.terms += [t for t in self.state_terms] + self._head_held_rows()
        # the head's unit was resharded before its reduce-scatter (FSDP2 reshards, then reduces); a second head
        # unit would still be gathered: counted then
        table.terms += [self._passed_row(), _scatter_row(self.head_units)] + self._gloo_row() + self._held_rows(
            after_head=len(self.head_units) == 1)
        return table

    def phases(self) -> list[tuple[str, BudgetTable]]:
        """(name, table) of the step's phases outside any graph: with ``sync_reduce`` each block graph's and the
        head's reduce-scatter (once compiled), and the backward's tail."""
        out = [(f"after block graph {g}'s backward (its reduce-scatter)", t) for g, t in self.reduce_tables.items()]
        if self.head_reduce is not None:
            out.append(("after the head's backward (its reduce-scatter)", self.head_reduce))
        return out + [("the backward's tail (the embedding's reduce-scatter)", self.tail)]

    def phase_tables(self) -> list[BudgetTable]:
        return [table for _, table in self.phases()]

    def certified_peak(self) -> int:
        """The largest of the block graphs' totals and the phases outside them (bytes)."""
        return max([c.table.total for c in self.certificates] + [t.total for t in self.phase_tables()])

    def check_tail(self) -> None:
        """Raise before anything runs if the backward's tail (state + gradients + the embedding's reduce-scatter)
        cannot fit: it depends on the model and FSDP2's units only."""
        if not self.tail.fits():
            raise_infeasible(self.tail, self.tail.breaking_term(), detail="(the end of the backward: every gradient "
                             "reduced, the embedding's reduce-scatter in flight)")


def _local_bytes(t) -> int:
    t = getattr(t, "_local_tensor", t)
    return t.numel() * t.element_size()


def _grads_row(nbytes: int, which: str) -> BoundTerm:
    return BoundTerm(f"gradients already reduce-scattered by FSDP2 (sharded; {which})", sympy.Integer(nbytes), nbytes,
                     kind="transient", knob=SHARD)


def _scatter_cost(unit: FSDPUnit, output_counted: bool = False) -> int:
    """Peak bytes of one unit's reduce-scatter, in FSDP2's order (``foreach_reduce``): first its unsharded gradients
    (param dtype), the reduce-dtype input buffer and the copy-in temporary while the gradients are copied in; then
    the gradients are dropped (``unsharded_grads.clear()``) before the sharded output is allocated, so the second
    part is the input, gloo's clone of it (ProcessGroupGloo; none through boundpass.backend.gloo_release) and the
    output (unless a gradients row counts it). Measured (qwen3 debug experts, 4 ranks): gradients 36 MiB + input
    72 MiB + a 12 MiB temporary at the peak, no output. A one-rank shard group (EP = 2 on 2 ranks: the experts)
    makes no collective: FSDP2 copies ``input / gradient_divide_factor`` into the output, a temporary as large as
    the input (measured: input 72 + output 72 + the division's 72 MiB, qwen3 debug experts on 2 ranks)."""
    copying = unit.gathered + unit.copy_in + unit.reduce
    # a second input-sized buffer: gloo's clone, or the one-rank division's temporary
    inputs = 1 if unit.releasing and not unit.single_rank else 2
    return max(copying, inputs * unit.reduce + (0 if output_counted else unit.sharded_grads))


def _scatter_row(units: list[FSDPUnit], output_counted: bool = False) -> BoundTerm:
    """The largest reduce-scatter among ``units`` (``_scatter_cost``)."""
    widest = max(units, key=lambda u: _scatter_cost(u, output_counted), default=None)
    nbytes = _scatter_cost(widest, output_counted) if widest is not None else 0
    return BoundTerm(f"FSDP2 gradient reduce-scatter of the largest unit ({widest.path if widest else '-'})",
                     sympy.Integer(nbytes), nbytes, kind="transient", knob=SHARD)


def _output_examples(gm) -> list:
    """(shape, stride, dtype, device, requires_grad) of each output as Dynamo traced it: what a dry call returns."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    values = [n.meta.get("example_value") if isinstance(n, torch.fx.Node) else n for n in out.args[0]]
    if not all(isinstance(v, torch.Tensor) and all(isinstance(d, int) for d in v.shape) for v in values):
        raise BoundpassInputError("--boundpass.certify_only: a block graph returns something other than tensors of "
                                  f"static shapes ({[type(v).__name__ for v in values]}); run the step instead")
    # what a dry call makes, not the fake tensors themselves (they would keep the graph's fake mode alive)
    return [(tuple(v.shape), v.stride(), v.dtype, v.device, v.requires_grad) for v in values]


def _dry(outputs: list, blocks: CompiledBlocks, index: int, sco: bool):
    """A compiled block graph that does not compute: each call records the block (as ``_counting``) and returns
    uninitialised tensors of the graph's output shapes, dtypes and strides, requiring grad where the graph's do, so
    the graphs after it (the next blocks, the head) trace and are checked as in a real step. The certificate is a
    function of shapes, never of values (docs/step_peak.md), so it is the one the step would get; the certified-only
    lengths where attention's quadratic time makes a real forward take hours cost compile time alone. A block whose
    graph offloads its boundary records SCO's decision for it as the op would (the plan's forward-order prefix):
    the composition reads it."""
    runs, runtime = blocks.runs, blocks.sco_runtime

    def run(*args, **kwargs):
        runs.append(index)
        if sco and runtime is not None:
            runtime.offloaded[len(runs) - 1] = runtime.plan[len(runs) - 1]
        return tuple(torch.empty_strided(shape, stride, dtype=dtype, device=device, requires_grad=grad)
                     for shape, stride, dtype, device, grad in outputs)
    return run


def _counting(compiled, blocks: CompiledBlocks, index: int):
    """``compiled`` that records, on each forward call, which graph a block ran; arguments pass through as Dynamo
    gives them (its boxed flag copied).

    It holds ``blocks.runs`` (a list cleared in place each step), not ``blocks``: Dynamo installs the compiled
    function as a global of the traced module (torchtitan's decoder), where ``torch._dynamo.reset()`` leaves it, so a
    reference to ``blocks`` kept every trainer's model alive for the rest of the process (2 GiB of parameters per
    trainer on the 3-block qwen3 at EP = 2; docs/results/test_times.md, session 11)."""
    runs = blocks.runs

    def run(*args, **kwargs):
        runs.append(index)
        return compiled(*args, **kwargs)
    if hasattr(compiled, "_boxed_call"):
        run._boxed_call = compiled._boxed_call
    return run

