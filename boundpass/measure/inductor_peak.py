"""The step peak from Inductor's final schedule: what the kernels it emits keep live, not what the FX graph shows.

``step_peak.analyze_graphs`` walks the partitioned AOTAutograd graphs node by node. Inductor then fuses those
nodes: most intermediates of a fused kernel never become a buffer, and the scheduler reorders kernels for
peak memory. A bound taken before fusion is sound for Inductor but loose (1.28x process RSS on the plain LM of
bench/bound.py). This module records, for every graph Inductor lowers while ``recording()`` is active, the
scheduler's final node order (after fusion, ``reorder_for_peak_memory`` and comm reordering: ``Scheduler._init``
has returned) and the buffer lifetimes that torch's own ``torch._inductor.memory.compute_memory_timeline``
derives from it. What it adds to torch's model:

- bytes are sympy expressions (``layout.storage_size() * itemsize`` in the graph's ShapeEnv symbols), where
  torch's model takes an int hint of each symbolic size;
- parameters never count (persistent state) and the caller's batch is held through the step, where torch's
  model frees every graph input at its last read;
- the forward's saved outputs carry into the backward's inputs by the partitioner's names (both graphs are
  lowered at compile time: ``force_non_lazy_backward_lowering``), tangents live to backward's end;
- a boundpass custom op (a FallbackKernel) adds its declared workspace (``boundpass.runtime.contracts``), and SCO's
  held prefetch intervals are placed on the kernels their FX nodes were lowered into.

The result is a ``step_peak.GraphPeak`` (program points = scheduler nodes), so the planner, explain and the
error messages read it exactly like the graph walk's.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import sympy
import torch
import torch.fx as fx

from boundpass.runtime import contracts
from boundpass.runtime.contracts import as_expr
from boundpass.measure.step_peak import GraphPeak, Held, Storage, _Walk, module_path, op_bound


@dataclass
class Buffer:
    """One scheduler buffer: bytes, first and last step it is live at (end -1: a graph output)."""
    name: str
    nbytes: sympy.Expr
    start: int
    end: int
    shape: str
    dtype: str
    path: str
    label: str = ""                         # buffer name = the FX node it was lowered from


@dataclass
class Step:
    """One scheduler node in execution order."""
    name: str
    target: str
    path: str
    origins: set[str]                       # names of the FX nodes lowered into it
    reads: set[str]                         # buffer / input names it reads
    workspace_op: object = None             # a boundpass op with a declared bound (its FX node below)
    workspace_node: fx.Node | None = None


@dataclass
class Schedule:
    """What Inductor's scheduler will run for one lowered graph."""
    graph: fx.GraphModule
    steps: list[Step] = field(default_factory=list)
    buffers: list[Buffer] = field(default_factory=list)
    input_end: dict[str, int] = field(default_factory=dict)   # graph input -> last step reading it (-1: kept)
    outputs: list[str] = field(default_factory=list)          # per output position: buffer or input name


_ACTIVE: list[list[Schedule]] = []


@contextlib.contextmanager
def recording():
    """Record the final schedule of every graph Inductor lowers in this block (forward and backward both)."""
    from torch._inductor import scheduler as inductor_scheduler
    records: list[Schedule] = []
    original = inductor_scheduler.Scheduler._init

    def _init(sched, nodes):
        original(sched, nodes)
        if _ACTIVE:
            _ACTIVE[-1].append(_record(sched))

    _ACTIVE.append(records)
    inductor_scheduler.Scheduler._init = _init
    try:
        # lower backward with forward (not at the first backward call), so both schedules exist before any compute
        with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
            yield records
    finally:
        _ACTIVE.pop()
        inductor_scheduler.Scheduler._init = original


def _layout_bytes(node) -> sympy.Expr:
    layout = node.get_layout()
    try:
        numel = layout.storage_size()
    except (AttributeError, NotImplementedError):
        numel = node.get_numel()
    return sympy.sympify(numel) * node.get_dtype().itemsize


def _describe(node) -> tuple[str, str]:
    try:
        return str(tuple(node.get_size())), str(node.get_dtype()).replace("torch.", "")
    except Exception:  # noqa: BLE001 (layouts without a size: a multi-output holder)
        return "", ""


def _origin_path(ir_node) -> tuple[str, str, str]:
    """(module path, FX target, FX name) of the node an IR node was lowered from: its origin node, else the first
    of its origins with a module stack."""
    origin = ir_node.get_origin_node() if hasattr(ir_node, "get_origin_node") else None
    origins = sorted(getattr(ir_node, "origins", ()) or (), key=lambda n: n.name)
    if origin is not None:
        origins = [origin] + origins
    for candidate in origins:
        path = module_path(candidate)
        if path:
            return path, str(candidate.target), candidate.name
    return ("", str(origins[0].target), origins[0].name) if origins else ("", "", "")


def _record(sched) -> Schedule:
    from torch._inductor import ir
    from torch._inductor import memory as inductor_memory
    from torch._inductor.virtualized import V
    graph = V.graph
    inputs = set(graph.graph_inputs.keys())
    outputs = graph.get_output_names()
    freeable = inductor_memory.get_freeable_input_buf(sched.nodes, inputs)
    inductor_memory.assign_memory_planning_info_for_scheduler_buffers(sched.nodes, sched.name_to_buf)
    infos, _, _ = inductor_memory.compute_memory_timeline(sched.nodes, freeable, set(outputs))
    out = Schedule(graph=graph.module, outputs=list(outputs))
    multi_parent_step: dict[str, int] = {}
    for info in infos:
        buf = info.buffer
        if isinstance(buf, inductor_memory.FreeableInputBuffer):
            out.input_end[buf.get_name()] = info.end_step
            continue
        name, node = buf.get_name(), buf.node
        if name in sched.mutation_real_name or isinstance(node.layout, ir.NoneLayout):
            continue  # a rename of a mutated buffer (same storage) or no storage at all
        if isinstance(node.layout, ir.MultiOutputLayout):
            multi_parent_step[name] = info.start_step  # its parts are allocated when it runs
            continue
        start = info.start_step
        if isinstance(node, ir.MultiOutput) and node.inputs:
            start = multi_parent_step.get(node.inputs[0].get_name(), start)
        shape, dtype = _describe(node)
        path, _, fx_name = _origin_path(node)
        label = f"{name}={fx_name}" if fx_name else name
        out.buffers.append(Buffer(name, _layout_bytes(node), start, info.end_step, shape, dtype, path, label))
    for snode in sched.nodes:
        ir_node = snode.node
        path, target, _ = _origin_path(ir_node) if ir_node is not None else ("", "", "")
        origins = set()
        for sub in snode.get_nodes():
            if sub.node is not None:
                origins |= {o.name for o in (getattr(sub.node, "origins", ()) or ())}
        step = Step(snode.get_name(), target, path, origins, {d.name for d in snode.read_writes.reads})
        op = getattr(ir_node, "op_overload", None)
        if isinstance(ir_node, ir.FallbackKernel) and contracts.has_bound(op):
            step.target = str(op)
            step.workspace_op = op
            step.workspace_node = next((o for o in ir_node.origins if o.target is op), None)
        out.steps.append(step)
    return out


def schedule_for(records: list[Schedule], gm: fx.GraphModule) -> Schedule | None:
    """The recorded schedule Inductor lowered ``gm`` into (None: it did not lower it while recording).

    The forward is lowered as the partitioner returned it; AOTAutograd lowers a copy of the backward, recognised
    by its placeholders and outputs (the names the partitioner gave them).
    """
    found = next((r for r in records if r.graph is gm), None)
    if found is not None:
        return found

    def signature(g: fx.GraphModule):
        out = g.graph.find_nodes(op="output")[0].args[0]
        return [n.name for n in g.graph.find_nodes(op="placeholder")], [getattr(o, "name", None) for o in out]

    want = signature(gm)
    matches = [r for r in records if signature(r.graph) == want]
    return matches[-1] if matches else None


def _fake_storage_bytes(node: fx.Node) -> tuple[object, sympy.Expr] | None:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    storage = val.untyped_storage()
    return storage, as_expr(storage.nbytes())


def _walk(live: _Walk, sched: Schedule, phase: str, *, input_keys: dict, input_bytes: dict, keep: set, kind: str,
          held: list[Held], ctx: dict, output_kind: str | None = None) -> dict:
    """Run ``sched``'s steps; returns buffer name -> key for the buffers still live (graph outputs)."""
    by_start: dict[int, list[Buffer]] = {}
    for buf in sched.buffers:
        by_start.setdefault(buf.start, []).append(buf)
    by_end: dict[int, list[str]] = {}
    for buf in sched.buffers:
        if buf.end != -1:
            by_end.setdefault(buf.end, []).append(buf.name)
    for name, end in sched.input_end.items():
        if end != -1 and name in input_keys and input_keys[name] not in keep:
            by_end.setdefault(end, []).append(name)
    sizes = {b.name: b.nbytes for b in sched.buffers}
    step_of = {}
    for i, step in enumerate(sched.steps):
        for origin in step.origins:
            step_of.setdefault(origin, i)
    held_start, held_end = {}, {}
    for h in held:  # named by the partitioned graph's nodes (Inductor lowered a copy of it)
        if h.start.name not in step_of or (h.end is not None and h.end.name not in step_of):
            raise LookupError(f"SCO's held interval {h.label} starts or ends at an FX node Inductor did not keep")
        held_start.setdefault(step_of[h.start.name], []).append(h)
        if h.end is not None:
            held_end.setdefault(step_of[h.end.name], []).append(h)
    outputs = set(sched.outputs)
    keys: dict[str, object] = {}
    for i, step in enumerate(sched.steps):
        for h in held_end.get(i, ()):
            live.free(("held", id(h)))
        for buf in by_start.get(i, ()):
            keys[buf.name] = ("buf", id(sched), buf.name)
            this_kind = output_kind if (output_kind and buf.name in outputs) else kind
            live.add(keys[buf.name], Storage(buf.label or buf.name, buf.path, buf.shape, buf.dtype, buf.nbytes, this_kind))
        workspace = sympy.Integer(0)
        if step.workspace_op is not None and step.workspace_node is not None:
            io = sum((sizes[name] for name in step.reads if name in sizes), sympy.Integer(0))
            # graph inputs it reads, parameters included: the op's bound counts them, persistent state holds them
            io += sum((input_bytes[input_keys[n]] for n in step.reads if n in input_keys), sympy.Integer(0))
            io += sum((b.nbytes for b in by_start.get(i, ())), sympy.Integer(0))
            workspace = sympy.Max(0, op_bound(step.workspace_node, ctx) - io)
            live.note_host(step.workspace_node, ctx)
        live.record(phase, step.name, step.target, step.path, workspace)
        for name in by_end.get(i, ()):
            key = keys.get(name) or input_keys.get(name)
            if key is not None and key not in keep:
                live.free(key)
        for h in held_start.get(i, ()):
            live.add(("held", id(h)), Storage(h.label, step.path, "", "", h.nbytes, "held"))
    return keys


def analyze_schedules(fw_sched: Schedule, bw_sched: Schedule | None, fw: fx.GraphModule, bw: fx.GraphModule | None,
                      *, static_inputs: set[int], num_user_outputs: int, held: list[Held] = (),
                      ctx: dict | None = None) -> GraphPeak:
    """The GraphPeak of one compiled graph's forward then backward, program points = Inductor's scheduler nodes.

    Arguments as ``step_peak.analyze_graphs``; ``fw`` / ``bw`` are the partitioned graphs Inductor lowered (they
    name the saved tensors that pass from one to the other). Raises LookupError when a schedule cannot be read.
    """
    ctx = ctx or {}
    result = GraphPeak()
    live = _Walk(result, {})
    placeholders = fw.graph.find_nodes(op="placeholder")
    input_keys: dict[str, object] = {}
    input_bytes: dict[object, sympy.Expr] = {}   # every input storage's bytes (parameters too)
    persistent: set = set()
    for i, ph in enumerate(placeholders):
        found = _fake_storage_bytes(ph)
        if found is None:
            continue
        storage, nbytes = found
        key = ("storage", id(storage))
        input_keys[ph.name] = key
        input_bytes[key] = nbytes
        if i in static_inputs:
            persistent.add(key)
        elif key not in live.live:
            val = ph.meta["val"]
            live.add(key, Storage(ph.name, "", str(tuple(val.shape)), str(val.dtype).replace("torch.", ""),
                                  nbytes, "input"))
    caller_inputs = {k for k in live.live}
    fw_keys = _walk(live, fw_sched, "forward", input_keys=input_keys, input_bytes=input_bytes, keep=caller_inputs | persistent,
                    kind="activation", held=[], ctx=ctx)  # SCO's held intervals are backward's (prefetch)
    fw_out = [o for o in fw.graph.find_nodes(op="output")[0].args[0]]
    if len(fw_out) != len(fw_sched.outputs):
        raise LookupError(f"forward has {len(fw_out)} outputs, Inductor's schedule {len(fw_sched.outputs)}")

    def key_of(name: str):
        return fw_keys.get(name) or input_keys.get(name)

    user_keys = {key_of(n) for n in fw_sched.outputs[:num_user_outputs]} - {None}
    result.caller_bytes = sum((live.live[k].nbytes for k in (user_keys | caller_inputs) if k in live.live),
                              sympy.Integer(0))
    if bw is None or bw_sched is None:
        return result
    bw_placeholders = bw.graph.find_nodes(op="placeholder")
    saved_by_fx_name = {}
    for o, name in zip(fw_out, fw_sched.outputs):
        if isinstance(o, fx.Node):
            saved_by_fx_name[o.name] = key_of(name)
    saved_keys = {saved_by_fx_name[ph.name] for ph in bw_placeholders if saved_by_fx_name.get(ph.name)}
    for key in list(live.live):  # forward outputs neither returned nor saved die when forward returns
        if key not in user_keys and key not in saved_keys and key not in caller_inputs:
            live.free(key)
    for s in live.live.values():
        if s.kind == "activation":
            s.kind = "saved"
    result.saved_bytes = live.total - sum((live.live[k].nbytes for k in caller_inputs if k in live.live),
                                          sympy.Integer(0))
    keep = set(user_keys) | caller_inputs | persistent
    if ctx.get("per_block"):  # the caller drops the block's input and passes its output on (step_peak.analyze_graphs)
        keep = set(persistent)
        result.caller_bytes = sympy.Integer(0)
        for key in list(live.live):
            if key in (user_keys | caller_inputs) and key not in saved_keys:
                live.free(key)
    bw_input_keys: dict[str, object] = {}
    for ph in bw_placeholders:
        if ph.name in saved_by_fx_name and saved_by_fx_name[ph.name] is not None:
            bw_input_keys[ph.name] = saved_by_fx_name[ph.name]
        elif ph.name.startswith("tangents"):  # autograd's engine holds the incoming gradients until backward returns
            found = _fake_storage_bytes(ph)
            if found is None:
                continue
            key = ("tangent", ph.name)
            val = ph.meta["val"]
            live.add(key, Storage(ph.name, "", str(tuple(val.shape)), str(val.dtype).replace("torch.", ""),
                                  found[1], "input"))
            bw_input_keys[ph.name] = key
            keep.add(key)
    # a storage several placeholders share dies at the last of their reads; one no backward kernel reads dies as
    # backward starts (the boxed call clears its argument list)
    last_read: dict[object, int] = {}
    for name, key in bw_input_keys.items():
        last_read[key] = max(last_read.get(key, -1), bw_sched.input_end.get(name, -1))
    for key, end in last_read.items():
        if end == -1 and key in saved_keys and key not in keep:
            live.free(key)
    bw_sched = _with_input_ends(bw_sched, {n: last_read[k] for n, k in bw_input_keys.items()})
    bw_outputs = list(bw.graph.find_nodes(op="output")[0].args[0])
    grad_names = set()
    for i, (o, name) in enumerate(zip(bw_outputs, bw_sched.outputs)):
        if isinstance(o, fx.Node):
            grad_names.add(name)
            if i in static_inputs:
                buf = next((b for b in bw_sched.buffers if b.name == name), None)
                if buf is not None:
                    result.gradient_bytes += buf.nbytes
    for name, key in bw_input_keys.items():
        if key not in input_bytes and key in live.live:
            input_bytes[key] = live.live[key].nbytes
    for key, storage in list(live.live.items()):
        input_bytes.setdefault(key, storage.nbytes)
    _walk(live, bw_sched, "backward", input_keys=bw_input_keys, input_bytes=input_bytes, keep=keep, kind="activation", held=list(held),
          ctx=ctx, output_kind="gradient")
    return result


def _with_input_ends(sched: Schedule, ends: dict[str, int]) -> Schedule:
    out = Schedule(graph=sched.graph, steps=sched.steps, buffers=sched.buffers, outputs=sched.outputs,
                   input_end=dict(sched.input_end))
    out.input_end.update(ends)
    return out
