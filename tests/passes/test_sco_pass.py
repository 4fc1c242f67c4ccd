"""SCO as the partition-stage pass (boundpass.passes.protocol.PartitionPass): its plan records, the cap on how many
boundaries the host pool may take, its host rows and the fix it offers (the partitioned rewrite itself:
tests/backend/test_compile_sco.py and test_block_sco.py)."""
import pytest
import torch

from boundpass.core.config import Config
from boundpass.passes.pipeline import SCO
from boundpass.passes.protocol import PartitionPass
from boundpass.passes.sco_pass import SCOPlan, SCORegion, cap_plan


def _plan(mode, eligible: int, skipped: int = 0, most: int = 0, capped: bool = False) -> SCOPlan:
    regions = [SCORegion(layer=i, module_path=f"layers.{i}", boundary_bytes=1024 * (i + 1)) for i in range(eligible)]
    regions += [SCORegion(layer=-1, module_path=f"head.{i}", reason="a graph input") for i in range(skipped)]
    return SCOPlan(mode=mode, regions=regions, most=most, capped=capped)


def test_sco_follows_the_partition_pass_protocol_and_its_config():
    members = [m for m in vars(PartitionPass) if not m.startswith("_")]
    assert {"enabled", "find", "rewrite", "host_terms", "diagnose"} <= set(members)
    assert all(callable(getattr(SCO, m)) for m in members) and SCO.name == "sco"
    assert SCO.enabled(Config(sco={"enable": "auto"})) and SCO.enabled(Config(sco={"enable": True}))
    assert not SCO.enabled(Config(sco={"enable": False}))


@pytest.mark.parametrize("most,cap,expected", [(5, None, (5, False)), (5, 3, (3, True)), (2, 3, (2, False))])
def test_the_host_pools_count_is_capped_by_sco_max_layers(most, cap, expected):
    plan = _plan("auto", 6)
    cap_plan(plan, most, cap)
    assert (plan.most, plan.capped) == expected


def test_the_fix_offered_names_the_knob_that_can_offload_more():
    off = SCO.diagnose(_plan(False, 4))
    assert "sco_enable='auto'" in off and "host_budget" in off
    capped = SCO.diagnose(_plan("auto", 4, most=2, capped=True))
    assert "sco_max_layers=<larger>" in capped and "2 of 4" in capped
    small_pool = SCO.diagnose(_plan("auto", 4, most=1))
    assert "host_budget=<larger>" in small_pool and "holds 1 of 4" in small_pool


def test_no_fix_is_offered_when_more_offload_cannot_help():
    assert SCO.diagnose(_plan("auto", 4, most=4)) is None   # every eligible boundary can go already
    assert SCO.diagnose(_plan("auto", 0, skipped=3)) is None  # nothing SCO could offload
    assert SCO.diagnose(_plan(True, 3, most=3)) is None


def test_the_host_row_counts_what_is_offloaded_and_a_per_block_plan_has_none():
    plan = _plan("auto", 3, most=3)
    assert SCO.host_terms(plan) == []  # nothing offloaded yet
    plan.regions[0].offloaded = plan.regions[1].offloaded = True
    plan.offloaded = 2
    (row,) = SCO.host_terms(plan)
    assert row.kind == "host" and row.value == 1024 + 2048 and "L_off=2" in row.name
    plan.dynamic = True  # per-block: the composition owns the pool's row (block_compile.carry_terms)
    assert SCO.host_terms(plan) == []


def test_a_plan_with_nothing_eligible_is_not_rewritten():
    plan = _plan("auto", 0, skipped=2)
    graph = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    assert SCO.rewrite(plan, 1, graph, graph, graph, 1, waits=False) == [] and plan.offloaded == 0
