"""How `./dev test` spreads the suite over pytest-xdist workers (`-n 2 --dist loadfile --no-loadscope-reorder`; docs/results/test_times.md).

`--dist loadfile` keeps each test module on one worker, so a module-scoped fixture (a multi-rank torchtitan run, a
compiled model, a pool of gloo ranks) is built once. (`--dist loadgroup` with per-fixture groups would split modules
finer, but with pytest 9.2 and pytest-xdist 3.8 it ignores xdist_group marks: checked with a static mark, the
grouped tests still went to both workers.) Modules start longest first (longest-processing-time scheduling), by the
per-test seconds in tests/durations.json (a `--durations=0` run of the suite; a test missing there counts
DEFAULT_SECONDS), so the long multi-rank modules overlap each other and the short ones fill in at the end.
Without `-n` (`pytest tests/x.py`) the order changes and nothing else does; a stale durations file only costs time.
"""
import json
import pathlib

DEFAULT_SECONDS = 2.0
DURATIONS = pathlib.Path(__file__).with_name("durations.json")


def pytest_collection_modifyitems(config, items):
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    cost, first = {}, {}
    for i, item in enumerate(items):
        module = item.nodeid.partition("::")[0]
        cost[module] = cost.get(module, 0.0) + seconds.get(item.nodeid, DEFAULT_SECONDS)
        first.setdefault(module, i)
    # the longest module first; a module's tests stay in their collected order (stable sort)
    items.sort(key=lambda item: (-cost[item.nodeid.partition("::")[0]], first[item.nodeid.partition("::")[0]]))
