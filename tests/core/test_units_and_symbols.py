"""Byte sizes for budgets, and the shared sympy vocabulary."""
import pytest
import sympy

from boundpass.core import symbols as sym
from boundpass.core.errors import BoundpassInputError
from boundpass.core.units import format_bytes, parse_bytes


@pytest.mark.parametrize("text,expected", [
    ("60GiB", 60 * 2**30), ("64 GiB", 64 * 2**30), ("1.5 TB", 1_500_000_000_000), ("1.5TiB", 3 * 2**39),
    (1_000_000, 1_000_000), ("1_000_000", 1_000_000), ("512 MiB", 512 * 2**20), ("2G", 2 * 2**30),
    ("100mb", 100_000_000), ("4096", 4096), ("4096 B", 4096), (2.5e9, 2_500_000_000), ("1e3 KiB", 1_024_000),
])
def test_parse_bytes_reads_common_spellings(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad,match", [
    ("60 GiBs", "unknown unit"), ("12 parsecs", "unknown unit"), ("-1GiB", "positive"), (-5, "positive"),
    (0, "positive"), ("0 GiB", "positive"), ("", "cannot read"), ("GiB", "cannot read"), ("1..5GB", "cannot read"),
    (True, "byte size"), (None, "byte size"), (float("inf"), "positive, finite"), ("0.1 B", "less than one byte"),
])
def test_parse_bytes_refuses_bad_input_clearly(bad, match):
    with pytest.raises(BoundpassInputError, match=match):
        parse_bytes(bad, what="budget")


def test_error_names_what_was_being_parsed():
    with pytest.raises(BoundpassInputError, match="^host budget"):
        parse_bytes("lots", what="host budget")


def test_format_bytes_round_trips_readably():
    assert format_bytes(512) == "512 B"
    assert format_bytes(60 * 2**30) == "60.00 GiB"
    assert parse_bytes(format_bytes(3 * 2**20).replace(" ", "")) == 3 * 2**20


def test_symbols_evaluate_by_symbol_or_name():
    expr = sym.N * sym.H * sym.b + sympy.ceiling(sym.V / sym.P)
    assert sym.evaluate(expr, {"N": 4, "H": 8, "b": 2, sym.V: 10, sym.P: 4}) == 64 + 3
    with pytest.raises(ValueError, match="free symbols"):
        sym.evaluate(expr, {"N": 4})
    assert all(s.is_integer and s.is_nonnegative for s in sym.ALL.values())
    assert sym.evaluate(sym.s_b * sym.H + sympy.Max(sym.R, 1), {"s_b": 0, "H": 8, "R": 0}) == 1


def test_bounds_built_with_max_kept_are_their_evaluated_expressions():
    """sym.max_kept builds a Max unevaluated (sympy's pairwise comparisons cost ~0.5 s of every plan): each bound
    built with it must be the expression sympy's evaluation gives, for every flag the bound takes; and
    sym.evaluated tells when an argument would have been dropped."""
    import importlib
    import itertools
    pl = importlib.import_module("boundpass.runtime.pipelined_llep")
    sh = importlib.import_module("boundpass.runtime.seq_to_head")
    bounds = [pl.pipelined_llep_bound(mixed_precision=m, narrow_compute=n, count_own_weights=o, overlap=v)
              for m, n, o, v in itertools.product((False, True), repeat=4)]
    bounds += [sh.seq_to_head_bound(count_io=io, caller_keeps_inputs=keep)
               for io, keep in itertools.product((False, True), repeat=2)]
    for bound in bounds:
        assert bound.has(sympy.Max)
        assert sym.evaluated(bound) == bound and str(sym.evaluated(bound)) == str(bound)
    dominated = sym.max_kept(sym.N, 2 * sym.N)
    assert sym.evaluated(dominated) == 2 * sym.N != dominated
    assert sym.max_kept(sym.N, sym.H) == sympy.Max(sym.N, sym.H)
