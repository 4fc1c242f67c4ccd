"""Narrow workarounds for AOTAutograd bugs boundpass's partitioner meets, each with its upstream cause.

saved_tensors_before_opaque -- torch 2.13, ``torch/_functorch/partitioners.py`` ``functionalize_rng_ops``:
    when a partitioned graph recomputes an RNG op in backward (activation checkpointing of a block that draws
    random numbers, as torchtitan's FullAC / SelectiveAC blocks do under torch.compile), the partitioner adds the
    op's saved RNG state as a forward output "just before the saved symints" (``len(outputs) - num_sym_nodes``)
    and as a backward placeholder just before the first tangent. AOTAutograd's runtime reads the saved values
    of the forward by position -- tensors, then opaque objects, then symints (``ViewAndMutationMeta``'s slices
    in ``_aot_autograd/schemas.py``) -- and passes them to the backward in that order. When the block also saves an
    opaque object (a ``DeviceMesh`` graph input that the backward uses: torchtitan's expert-parallel MoE blocks
    under FSDP2, EP = 2), the RNG-state tensor lands after it, the slices are off by one, and the first forward
    call fails in ``_AutogradSavedState.save_from_forward`` with "expected all tensors_saved_with_vc_check to be
    Tensors, got types: [..., DeviceMesh]" (measured: stock torchtitan 0.3.0 with ``--compile.enable`` at EP = 2 +
    FSDP2 on 2 gloo ranks). This moves every saved tensor that follows an opaque object to just before the first
    one, in the forward's outputs and the backward's placeholders alike: the layout the partitioner produces when
    no opaque object is saved. tests/backend/test_block_compile.py checks it on the trainer and on a hand-made pair.

static_placeholders -- torch 2.13, ``_aot_autograd/frontend_utils.py`` (``static_input_indices``, one per
    parameter Dynamo lifted) and the subclass flattening after it: the partitioner's
    ``static_lifetime_input_indices`` count a DTensor parameter as one input, but its flattened placeholders are
    its local tensor followed by an opaque ``DeviceMesh``. Past the first opaque placeholder the indices fall short
    by the opaque placeholders before them (measured: qwen3 debug at EP = 2 + FSDP2, the three expert weights at
    placeholders 12, 14, 16, each followed by its mesh, arrive as 12, 13, 14; the third weight, 12 MiB, was
    counted as a graph input beside FSDP2's units row, which holds it). This maps them to placeholder positions.
"""
from __future__ import annotations

import torch.fx as fx

applied = 0  # how many partitioned pairs saved_tensors_before_opaque reordered in this process (tests read it)


def _is_opaque(node) -> bool:
    try:
        from torch._functorch._aot_autograd.graph_compile import is_opaque_node
    except ImportError:  # torch 2.11 (the GPU image) has no opaque graph values: nothing is opaque there
        return False
    return is_opaque_node(node)


def static_placeholders(joint: fx.GraphModule, indices) -> set[int]:
    """Placeholder positions of ``joint`` (primals first) that AOTAutograd's ``static_lifetime_input_indices``
    name. Each placeholder's descriptor (``meta["desc"]``) leads back to the flat input it came from
    (``PlainAOTInput.idx``, through ``SubclassGetAttrAOTInput.base`` for a subclass's pieces), which is what the
    indices count (module docstring); where a primal has no such descriptor, inputs are counted as AOTAutograd
    does, an opaque placeholder (a subclass's DeviceMesh) not being one of its own."""
    indices = set(indices)
    primals = [n for n in joint.graph.find_nodes(op="placeholder") if n.name.startswith("primals")]
    roots = []
    for node in primals:
        desc = node.meta.get("desc")
        while desc is not None and hasattr(desc, "base"):
            desc = desc.base
        roots.append(getattr(desc, "idx", None))
    if primals and all(isinstance(r, int) for r in roots):
        return {i for i, r in enumerate(roots) if r in indices}
    out, position = set(), 0
    for i, node in enumerate(joint.graph.find_nodes(op="placeholder")):
        if _is_opaque(node):
            continue
        if position in indices:
            out.add(i)
        position += 1
    return out


def _is_sym(node) -> bool:
    from torch._functorch.partitioners import is_sym_node
    return isinstance(node, fx.Node) and is_sym_node(node)


def _misplaced(saved: list) -> list:
    """Saved tensors that come after the first opaque object (they belong before it)."""
    first = next((i for i, n in enumerate(saved) if _is_opaque(n)), None)
    if first is None:
        return []
    return [n for n in saved[first:] if isinstance(n, fx.Node) and not _is_opaque(n) and not _is_sym(n)]


def saved_tensors_before_opaque(fw: fx.GraphModule, bw: fx.GraphModule | None, num_fwd_outputs: int) -> bool:
    """Reorder the partitioned pair so saved tensors precede saved opaque objects (module docstring); True if it
    changed anything. The backward's placeholders are matched to the forward's outputs by name (the partitioner
    names a saved value's placeholder after the forward node, an RNG state ``rng_state_output_<i>``), in order."""
    out = fw.graph.output_node()
    outs = list(out.args[0])
    saved = outs[num_fwd_outputs:]
    moved = _misplaced(saved)
    if not moved:
        return False
    keep = [n for n in saved if all(n is not m for m in moved)]
    first_kept = next(i for i, n in enumerate(keep) if _is_opaque(n))
    new_saved = keep[:first_kept] + moved + keep[first_kept:]
    out.args = (tuple(outs[:num_fwd_outputs]) + tuple(new_saved),) + tuple(out.args[1:])
    fw.recompile()
    if bw is not None:
        placeholders = bw.graph.find_nodes(op="placeholder")
        opaque_ph = [p for p in placeholders if _is_opaque(p)]
        tensor_after = []
        if opaque_ph:
            seen_opaque = False
            for p in placeholders:
                if p.name.startswith("tangents"):
                    break
                if _is_opaque(p):
                    seen_opaque = True
                elif seen_opaque and not _is_sym(p):
                    tensor_after.append(p)
        if len(tensor_after) != len(moved):
            raise AssertionError(
                f"boundpass (aot_workarounds): {len(moved)} saved tensor(s) follow an opaque object in the forward's "
                f"outputs but {len(tensor_after)} in the backward's inputs; the partitioner's layout is not the one "
                "this workaround knows (torch 2.13 functionalize_rng_ops)")
        for p in tensor_after:  # placeholders must stay in argument order: move each before the first opaque one
            opaque_ph[0].prepend(p)
        bw.graph.lint()
        bw.recompile()
    global applied
    applied += 1
    return True
