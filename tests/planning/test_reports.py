"""Reports fit a 120-column terminal, and `python -m boundpass plan` refuses a bad argument before torch.

The plan CLI validates everything that needs no model (boundpass/core/plan_input.py) before torch or torchtitan is
imported; each refusal here runs in a fresh interpreter under a wall-clock limit of 1 s and must leave torch
unimported. The tables (BudgetTable.render, PlanResult.render) keep term, bytes, share and verdict within
textwidth.WIDTH columns; formulas come with formulas=True (wrapped) and in --json. explain's own widths are
tested on its compiled fixture in tests/planning/test_explain_plot.py. step_peak.max_of (the dominance-pruned Max the
block traces use) must equal sympy.Max.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
import time

import pytest
import sympy

from boundpass.bound import composed
from boundpass.core import textwidth
from boundpass.core import symbols as sym
from boundpass.bound.bounds import BoundTerm, BudgetTable
from boundpass.measure.step_peak import max_of

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WIDTH = textwidth.WIDTH
# imports boundpass's CLI, runs it on argv, and says whether torch was imported by then
_PROBE = ("import sys, boundpass.__main__ as m; rc = m.main(sys.argv[1:]); "
          "print('torch imported' if 'torch' in sys.modules else 'torch not imported'); sys.exit(rc)")


def _widest(text: str) -> int:
    return max(len(line) for line in text.splitlines())


@pytest.mark.parametrize("argv,match", [
    (["nosuch", "1B", "-W", "8", "--context", "8"], "unknown model 'nosuch'"),
    (["deepseek_v3", "700B", "-W", "8", "--context", "8"], "unknown flavor '700B'"),
    (["kimi_k2_7", "K3", "-W", "8", "--context", "8"], "unknown flavor 'K3' of kimi_k2_7; known: debugmodel,"),
    (["qwen3_moe", "9B", "-W", "8", "--context", "8"], "unknown flavor '9B' of qwen3"),  # the recipes' alias
    (["deepseek_v3", "671B", "-W", "6", "--ep", "4", "--context", "12"], "E_p = 4 does not divide W = 6"),
    (["deepseek_v3", "671B", "-W", "8", "--context", "8", "--budget", "12XB"], "unknown unit"),
    (["deepseek_v3", "671B", "-W", "8", "--context", "12"], "do not split evenly over W = 8"),
    (["deepseek_v3", "671B", "-W", "8", "-N", "8", "--operators", "ring_dtp,bogus"], "unknown operators"),
    (["deepseek_v3", "671B", "-W", "8", "-N", "8", "--dtype", "int8"], "dtype must be one of"),
    (["deepseek_v3", "671B", "-W", "8", "-N", "8", "--flops", "0"], "flops must be a finite number > 0"),
    (["deepseek_v3", "671B", "-W", "8", "--context", "8", "--global-batch", "4", "--layout", "dp"],
     "whole sequences on every rank"),
    (["deepseek_v3", "671B", "-W", "8", "-N", "8", "--loss-chunks", "0"], "loss_chunks must be"),
])
def test_cli_refuses_bad_arguments_before_importing_torch(argv, match):
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _PROBE, "plan", *argv], cwd=REPO, capture_output=True, text=True,
                         timeout=30)
    elapsed = time.perf_counter() - start
    assert out.returncode == 2 and match in out.stderr, (out.returncode, out.stderr)
    assert "torch not imported" in out.stdout, out.stdout
    assert elapsed < 1.0, f"refused after {elapsed:.2f} s"


def test_cli_usage_error_is_argparse_and_fast():
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "boundpass", "plan", "deepseek_v3"], cwd=REPO, capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 2 and "required" in out.stderr
    assert time.perf_counter() - start < 1.0


def test_budget_table_fits_120_columns_and_formulas_are_opt_in():
    long_name = "activations + op workspace (graph peak at backward pipelined_llep_bwd @ " + "layers.3.moe." * 8 + ")"
    formula = sympy.Max(*(k * sym.N * sym.H * sym.b + k * sym.V for k in range(1, 40)))
    table = BudgetTable(budget=1 << 30, host_budget=1 << 34, terms=[
        BoundTerm("parameters", sym.Theta * sym.b, 1 << 20, "knob", kind="persistent"),
        BoundTerm(long_name, formula, 123 << 20, "a smaller c", where="layers.3.moe.routed_experts"),
        BoundTerm("optimizer state on host", 3 * sym.Theta * sym.b_acc, 5 << 30, "host", kind="host")])
    text = table.render()
    assert _widest(text) <= WIDTH, text
    assert str(formula) not in text and "Max(" not in text             # no formula by default
    assert "123.00 MiB" in text and "FITS" in text and "host budget" in text
    rows = text.splitlines()
    assert rows[0].split() == ["term", "bytes", "share"]
    with_formulas = table.render(formulas=True)
    assert _widest(with_formulas) <= WIDTH
    assert "".join(with_formulas.split()).count("".join(str(formula).split())) == 1  # whole, only wrapped


def test_a_refusal_names_a_term_of_the_side_that_does_not_fit():
    """The device over its budget with a larger host term beside it (OffloadStreamAdamW's state): the refusal names
    the device budget and its largest device term, not the host's (which sent the user to a larger host_budget)."""
    from boundpass.bound.bounds import raise_infeasible
    from boundpass.core.errors import InfeasibleBudgetError
    terms = [BoundTerm("parameters", sym.Theta * sym.b, 300 << 20, "shard", kind="persistent"),
             BoundTerm("saved tensors", sym.N * sym.H * sym.b, 800 << 20, "SCO", kind="transient"),
             BoundTerm("optimizer state on host", 3 * sym.Theta * sym.b_acc, 900 << 20, "host", kind="host")]
    device_over = BudgetTable(budget=1 << 30, host_budget=64 << 30, terms=terms)
    assert device_over.breaking_term().name == "saved tensors"
    with pytest.raises(InfeasibleBudgetError, match=r"device budget 1\.00 GiB") as err:
        raise_infeasible(device_over, device_over.breaking_term())
    assert err.value.term == "saved tensors" and err.value.knob == "SCO"
    host_over = BudgetTable(budget=4 << 30, host_budget=512 << 20, terms=terms)
    assert host_over.breaking_term().name == "optimizer state on host"


def test_fit_drops_remarks_before_clipping():
    assert textwidth.fit("a name (a long remark)", 10) == "a name"
    assert textwidth.fit("traced block, forward: what it holds (where)", 25) == "traced block, forward"
    assert len(textwidth.fit("x" * 300, 40)) == 40 and textwidth.fit("x" * 300, 40).endswith("...")
    assert textwidth.fit("short", 40) == "short"


def test_plan_report_fits_120_columns_with_formulas_under_their_rows():
    from boundpass.planning.full_scale import plan
    for ranks, ep in ((1, 1), (2, 2)):
        result = plan("deepseek_v3", "debugmodel", ranks=ranks, ep=ep, tokens_per_rank=512, budget="2GiB",
                      host_budget="8GiB", do_trace=ranks == 1, solve=True)
        text = result.render()
        assert _widest(text) <= WIDTH, text
        assert next(ln for ln in text.splitlines() if ln.startswith("term")).split() == ["term", "bound", "traced",
                                                                                       "share"]
        assert "FITS" in text or "DOES NOT FIT" in text
        assert not any(str(t.formula) in text for t in result.table.terms if len(str(t.formula)) > 20)
        full = result.render(formulas=True)
        assert _widest(full) <= WIDTH
        flat = "".join(full.split())
        assert all("".join(str(t.formula).split()) in flat for t in result.table.terms)
        assert all(isinstance(t["formula"], str) for t in result.to_json()["terms"])  # --json keeps them


def test_composed_budget_in_explain_fits_too():
    """The composed table compile(..., launch=) puts in explain, hand-written terms (the traced ones' long names
    are in the plan report above): untraced, so this costs a meta build, not a block trace."""
    from boundpass.planning.full_scale import model_shape
    shape = model_shape("deepseek_v3", "debugmodel", trace=False)
    launch = composed.Launch(ranks=4, ep=2, ring=4, tokens_per_rank=4096)
    table = composed.compose(shape, launch, budget=1 << 33, host_budget=1 << 36)
    assert _widest(table.render()) <= WIDTH and _widest(table.render(formulas=True)) <= WIDTH


def test_max_of_equals_sympy_max():
    N, H = sym.N, sym.H
    rng = random.Random(0)
    for _ in range(12):  # sympy.Max of the reference is the slow part: a dozen random sets
        values = [rng.randint(0, 60) * N + rng.randint(0, 900) + rng.choice([0, H, 2 * H * N, sympy.floor(N / 3)])
                  for _ in range(rng.randint(1, 12))]
        pruned, reference = max_of(values), sympy.Max(*values)
        for n in (1, 7, 65_536):
            for h in (1, 7168):
                point = {N: n, H: h}
                assert pruned.subs(point) == reference.subs(point), (values, pruned, reference)
    linear = [rng.randint(0, 60) * N + rng.randint(0, 900) for _ in range(30)]
    assert max_of(linear) == sympy.Max(*linear)
    assert max_of([]) == 0


_WALK_WITHOUT_COMPILER = """
import sys, torch
from boundpass.planning.block_trace import block_peak
from boundpass.runtime.ring_dtp import ring_dtp_loss
assert "boundpass.backend.compiler" not in sys.modules and "boundpass.passes.vocab_pass" not in sys.modules
class Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(512, 16))
    def forward(self, h):
        labels = torch.zeros(h.shape[:-1], dtype=torch.long)
        return ring_dtp_loss(h.reshape(-1, 16), self.w, labels.reshape(-1), vocab_size=512)
peak, _ = block_peak(Head(), (torch.empty(1, 8, 16, device="meta", requires_grad=True),))
print(next(p.workspace for p in peak.points if p.workspace != 0))  # the forward op's
"""


def test_step_analysis_without_the_compiler_still_counts_op_workspaces():
    """`import boundpass` no longer imports the compiler and its passes (which register each op's workspace with
    the step analysis): a walk that meets a boundpass op registers them itself, so Ring-DTP's strips still count
    (the same formula as when `import boundpass` imported everything)."""
    out = subprocess.run([sys.executable, "-c", _WALK_WITHOUT_COMPILER], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "4*N*Min(512, C) + 83*N + 32772", out.stdout
