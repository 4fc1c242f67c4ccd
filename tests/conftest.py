"""How `./dev test` spreads the suite over pytest-xdist workers (`-n 2 --dist loadgroup`; docs/results/test_times.md).

A module whose tests share an expensive module-scoped fixture (a multi-rank torchtitan run, a traced model) runs
whole on one worker: split across two, each worker would build the fixture again. Every other test is scheduled
on its own. The grouped modules go first, slowest first, so the longest unit of work starts at once and the short
tests fill the other worker around it. Without xdist (`pytest tests/x.py`) none of this changes anything.
"""
import pytest

# modules with module-scoped fixtures, slowest first (measured per file in docs/results/test_times.md)
WHOLE_MODULES = (
    "test_block_compile", "test_mop", "test_plan", "test_step_peak", "test_recipe_mop", "test_recipe",
    "test_families", "test_compile_sco", "test_explain_plot", "test_sco", "test_seq_to_head",
    "test_gloo_reduce_scatter",
)


def _module(item) -> str:
    return item.module.__name__.rpartition(".")[2] if item.module is not None else ""


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(WHOLE_MODULES)}
    for item in items:
        name = _module(item)
        if name in rank:
            item.add_marker(pytest.mark.xdist_group(name))
    # stable sort: grouped modules first in the order above, the rest as collected
    items.sort(key=lambda item: rank.get(_module(item), len(rank)))
