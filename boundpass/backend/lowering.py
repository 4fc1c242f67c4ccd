"""The one lowering of a rewritten Dynamo graph, for every backend boundpass has: ``BoundedModule`` (boundpass.compile),
the per-block backend of torchtitan's per-block compile, and the MoP layout's backends.

AOTAutograd traces the joint graph; ``partition_fn`` splits it (the planning partitioner plans the knobs and checks
the budget inside that call, before any kernel exists); then the graphs run either as boxed eager callables (each
saved tensor dies at its last use) or through Inductor, whose partitioner hook is the same ``partition_fn``.
"""
from __future__ import annotations

import uuid

import torch
from torch._inductor.custom_graph_pass import CustomPartitionerFn


class InductorPartitioner(CustomPartitionerFn):
    """Inductor's ``custom_partitioner_fn`` around a partition function (its uuid keeps caches apart)."""

    def __init__(self, inner):
        self.inner = inner
        self._uuid = f"boundpass-partition-{uuid.uuid4().hex}"

    def __call__(self, joint, joint_inputs, **kwargs):
        return self.inner(joint, joint_inputs, **kwargs)

    def uuid(self):
        return self._uuid

    def __deepcopy__(self, memo):  # Inductor copies its config for the cache key; the partitioner is shared
        return self


def static_input_indices() -> tuple:
    """The parameter / buffer inputs of the graph AOTAutograd is compiling (its inference compiler is not told)."""
    ctx = torch._guards.TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None) if ctx is not None else None
    return tuple(getattr(meta, "static_input_indices", None) or ())


def lower(gm: torch.fx.GraphModule, example_inputs, inner: str, partition_fn, *, on_inference=None):
    """Compile ``gm`` through AOTAutograd with ``partition_fn`` and the kernels ``inner`` names ("aot_eager":
    boxed eager callables; "inductor"). ``on_inference(graph, static_input_indices)`` is called for a graph without a
    backward (no_grad / eval), which is never partitioned, before it is lowered."""
    from torch._dynamo.backends.common import aot_autograd

    from boundpass.passes.sco_pass import eager_callable
    # AOTAutograd's cache off: a hit would skip the partition function, and with it the planner
    with torch._functorch.config.patch(enable_autograd_cache=False):
        if inner == "inductor":
            from torch._inductor.compile_fx import compile_fx, compile_fx_inner

            def inner_compile(graph, inputs, **kw):
                if kw.get("is_inference") and on_inference is not None:
                    on_inference(graph, kw.get("static_input_idxs") or ())
                return compile_fx_inner(graph, inputs, **kw)
            # fx_graph_cache off: its key pickles the graphs, whose boundpass op arguments hold cyclic runtime
            # objects, so it cannot hit ("Failed to pickle cache key"), and on a deep checkpointed graph with SCO the
            # pickler's RecursionError is fatal. Inductor's kernel cache (compiled C++) is unaffected.
            patches = {"custom_partitioner_fn": InductorPartitioner(partition_fn), "fx_graph_cache": False}
            return compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=patches)

        def eager(graph, inputs):
            return eager_callable(graph)  # boxed: saved tensors die at their last use

        def inference(graph, inputs):
            if on_inference is not None:
                on_inference(graph, static_input_indices())
            return eager_callable(graph)
        # aot_autograd even for eager kernels: torchtitan's MoE mutates a buffer in forward
        return aot_autograd(fw_compiler=eager, bw_compiler=eager, partition_fn=partition_fn,
                            inference_compiler=inference)(gm, example_inputs)
