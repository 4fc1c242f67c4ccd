"""boundpass as the backend of torchtitan's per-block compile (boundpass/block_compile.py, recipes/trainer.py).

The trainer test runs torchtitan's own Trainer on 2 gloo ranks, deepseek_v3 debug at EP = 2 + FSDP2 with
``--compile.enable`` (torchtitan's apply_compile, lowered by aot_eager here: Inductor's cold-cache C++ builds of
six block graphs on two ranks would cost minutes; bench/e2e.py runs Inductor): every MoE block's dispatch is
rewritten to PipelinedLLEP, step 1's loss follows stock torchtitan, every steady step's measured peak (torch's
allocator) stays under the certified one, also after all tokens are routed to experts of EP rank 0, and the
certified peak does not move when the routing does.
"""
import json
import os

import pytest
import torch
import torch.fx as fx

from boundpass.aot_workarounds import saved_tensors_before_opaque


from torch._opaque_base import OpaqueBase  # noqa: E402


class _Opaque(OpaqueBase):
    """A stand-in for an opaque reference object saved for backward (torchtitan saves a DeviceMesh)."""


def _register_opaque():
    from torch._library.opaque_object import is_opaque_type, register_opaque_type
    if not is_opaque_type(_Opaque):
        register_opaque_type(_Opaque, typ="reference")


def _pair():
    """A forward / backward pair laid out as torch 2.13's functionalize_rng_ops leaves it when an opaque object is
    saved: forward outputs (out, t, opaque, rng_state), backward placeholders (t, opaque, rng_state, tangents)."""
    _register_opaque()
    fw_graph = fx.Graph()
    x = fw_graph.placeholder("x")
    x.meta["val"] = torch.ones(2)
    opq = fw_graph.placeholder("mesh")
    opq.meta["val"] = _Opaque()
    t = fw_graph.call_function(torch.sin, (x,))
    t.meta["val"] = torch.ones(2)
    out = fw_graph.call_function(torch.cos, (t,))
    out.meta["val"] = torch.ones(2)
    rng = fw_graph.call_function(torch.exp, (x,))
    rng.meta["val"] = torch.ones(2)
    fw_graph.output((out, t, opq, rng))
    bw_graph = fx.Graph()
    names = ("t", "mesh", "rng_state_output_0", "tangents_1")
    phs = [bw_graph.placeholder(n) for n in names]
    for ph, val in zip(phs, (torch.ones(2), _Opaque(), torch.ones(2), torch.ones(2))):
        ph.meta["val"] = val
    bw_graph.output((bw_graph.call_function(torch.mul, (phs[0], phs[3])), None))
    return fx.GraphModule(torch.nn.Module(), fw_graph), fx.GraphModule(torch.nn.Module(), bw_graph)


def test_saved_tensors_move_before_opaque_objects():
    fw, bw = _pair()
    assert saved_tensors_before_opaque(fw, bw, num_fwd_outputs=1)
    assert [n.name for n in fw.graph.output_node().args[0]] == ["cos", "sin", "exp", "mesh"]
    assert [p.name for p in bw.graph.find_nodes(op="placeholder")] == ["t", "rng_state_output_0", "mesh",
                                                                       "tangents_1"]
    # already in AOTAutograd's layout: nothing to do
    assert not saved_tensors_before_opaque(fw, bw, num_fwd_outputs=1)


def test_layouts_it_does_not_know_are_refused():
    fw, bw = _pair()
    bw.graph.find_nodes(op="placeholder")[2].name = "tangents_0"  # the RNG state no longer among the saved inputs
    with pytest.raises(AssertionError, match="layout is not the one"):
        saved_tensors_before_opaque(fw, bw, num_fwd_outputs=1)


# ---------------------------------------------------------------------------------------------- the trainer
pytorch_distributed = pytest.importorskip("torchtitan")

SHORT = ["--training.seq_len", "64", "--training.local_batch_size", "2", "--lr_scheduler.decay_ratio", "0"]
REL_TOL = 1e-4  # the Ring-DTP head against ChunkedLossWrapper: same function, other summation order (test_recipe.py)


def _losses(path):
    with open(path) as f:
        return {row["step"]: row["loss"] for row in map(json.loads, f)}


def _per_block_run(rank, world, tmp, assets):
    os.environ["BOUNDPASS_ASSETS"] = assets
    from boundpass.recipes.train import build_in_process, train_in_process
    from boundpass import aot_workarounds
    from boundpass.testing.routing import route_all_to

    stock = os.path.join(tmp, "stock.jsonl")
    train_in_process(["--module", "boundpass.recipes", "--config", "deepseek_v3_debug_ep2", *SHORT,
                      "--training.steps", "1", "--dump_folder", f"{tmp}/stock", "--boundpass.record_losses", stock])
    ours = os.path.join(tmp, "bp.jsonl")
    trainer = build_in_process(["--module", "boundpass.recipes", "--config", "deepseek_v3_debug_ep2", *SHORT,
                                "--training.steps", "4", "--dump_folder", f"{tmp}/bp", "--compile.enable",
                                "--compile.backend", "aot_eager", "--boundpass.budget", "2GiB",
                                "--boundpass.measure_peak", "--boundpass.record_losses", ours])
    certified = []
    step = trainer.train_step

    def train_step(data_iterator):
        out = step(data_iterator)
        certified.append(trainer.certified_peak())
        if trainer.step == 2:  # from step 3 on every token picks experts 0..k-1, all on EP rank 0
            route_all_to(trainer.model_parts[0], range(3))
        return out
    trainer.train_step = train_step
    try:
        trainer.train()
    finally:
        trainer.close()
    return {"summary": trainer.summary(), "peaks": trainer.peaks, "certified": certified,
            "losses": _losses(ours) if rank == 0 else None, "stock": _losses(stock) if rank == 0 else None,
            "graphs": len(trainer.blocks.graph_saved), "runs": list(trainer.blocks.runs),
            "reordered": aot_workarounds.applied}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from boundpass.recipes.assets import ensure_assets
    root = tmp_path_factory.mktemp("assets") / "a"
    ensure_assets(root)
    return str(root)


@pytest.mark.torchtitan
@pytest.mark.distributed
def test_per_block_compile_at_ep2_fsdp2(tmp_path, assets):
    from boundpass.testing.distributed import run_on_ranks
    results = run_on_ranks(_per_block_run, 2, str(tmp_path), assets, timeout_s=900)
    first = results[0]
    # every MoE block's dispatch went through the pass: one graph serves blocks 1..5 (block 0 is dense)
    assert first["graphs"] == 2 and first["runs"] == [0, 1, 1, 1, 1, 1], first["summary"]
    assert first["summary"].count("REWRITTEN dispatch") == 1, first["summary"]
    assert "blocks [1, 2, 3, 4, 5]" in first["summary"]
    # the MoE block saves a DeviceMesh for backward: without the workaround its first call fails in AOTAutograd
    assert first["reordered"] >= 1
    # step 1 against stock torchtitan (eager: stock --compile.enable fails at EP = 2, aot_workarounds.py)
    assert abs(first["losses"][1] - first["stock"][1]) <= REL_TOL * abs(first["stock"][1])
    for result in results:
        certified = result["certified"]
        assert len(set(certified)) == 1, f"the certified peak moved with the routing: {certified}"
        steady = [peak for step, peak in result["peaks"] if step >= 2]
        assert steady and max(steady) <= certified[0], (result["peaks"], certified[0])
        # tight: the worst steady step within 1.25x (gloo's reduce-scatter copies are released at a time its worker
        # thread decides, so a short run may not show the step the bound covers: docs/recipe.md)
        assert certified[0] <= 1.25 * max(steady), (result["peaks"], certified[0])
