"""How `./dev test` spreads the suite over pytest-xdist workers (`-n 2 --dist loadgroup --no-loadscope-reorder`;
docs/results/test_times.md).

* Tests that share an expensive module-scoped fixture (a multi-rank torchtitan run, a compiled model, a pool of
  gloo ranks) run on one worker, as one unit: split over two workers, each would build the fixture again.
  Every other test is a unit of its own. Cheap module fixtures (a lazy model cache, tokenizer assets) do not group.
* Units start longest first (longest-processing-time scheduling), by the per-test seconds in tests/durations.json
  (a `--durations` run of the suite; a test missing there counts DEFAULT_SECONDS), so the long multi-rank units
  overlap each other and the short tests fill in at the end instead of one long unit running alone.
Without `-n` (`pytest tests/x.py`) the order changes and nothing else does. A stale tests/durations.json only
costs time, never a result.
"""
import json
import pathlib

import pytest

# module-scoped fixtures that cost seconds to minutes to build (every test that uses one runs where it was built)
SHARED_FIXTURES = frozenset({
    "runs", "other_models",        # test_mop, test_recipe_mop: multi-rank MoP trainings
    "model_runs",                  # test_compile_sco: compiled qwen3 / deepseek_v3 runs
    "deepseek_runs", "qwen3_runs",  # test_sco
    "compiled",                    # test_explain_plot
    "ranks",                       # test_gloo_reduce_scatter, test_seq_to_head: a pool of gloo ranks per W
})
DEFAULT_SECONDS = 2.0
DURATIONS = pathlib.Path(__file__).with_name("durations.json")


def _unit(item) -> str | None:
    """The xdist group of ``item``: its module and the shared fixtures it uses (with their parameters), or None."""
    shared = []
    for name in sorted(SHARED_FIXTURES.intersection(item.fixturenames)):
        param = getattr(getattr(item, "callspec", None), "params", {}).get(name)
        shared.append(name if param is None else f"{name}-{param}")
    if not shared:
        return None
    return f"{item.module.__name__.rpartition('.')[2]}.{'.'.join(shared)}"


def pytest_collection_modifyitems(config, items):
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    units, cost = {}, {}
    for item in items:
        group = _unit(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
        key = group or item.nodeid
        units[item.nodeid] = key
        cost[key] = cost.get(key, 0.0) + seconds.get(item.nodeid, DEFAULT_SECONDS)
    first = {}
    for i, item in enumerate(items):
        first.setdefault(units[item.nodeid], i)
    # longest unit first; a unit's tests stay together in their collected order
    items.sort(key=lambda item: (-cost[units[item.nodeid]], first[units[item.nodeid]]))
