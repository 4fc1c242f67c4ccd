"""boundpass.compile(..., launch=, model_shape=): the composed per-rank budget checked before any graph."""
import pytest
import torch

import boundpass
from boundpass.core.errors import BoundpassInputError, InfeasibleBudgetError

pytest.importorskip("torchtitan")
from boundpass.bound import composed  # noqa: E402
from boundpass.planning.full_scale import shape_of_module  # noqa: E402
from boundpass.recipes.models import build_debug_moe, debug_moe_config  # noqa: E402
from boundpass.core.textwidth import flat  # noqa: E402

pytestmark = pytest.mark.torchtitan
SEQ, VOCAB = 32, 256


def _shape_and_model():
    cfg = debug_moe_config("deepseek_v3", vocab_size=VOCAB, seq_len=SEQ).model_spec.model
    model = build_debug_moe("deepseek_v3", vocab_size=VOCAB, seq_len=SEQ)
    top_k = max(layer.moe.router.top_k for layer in cfg.layers if getattr(layer, "moe", None))
    shape = shape_of_module(model, name="deepseek_v3 debug", heads_config=cfg.layers[-1].attention, top_k=top_k)
    return shape, model


def test_composed_budget_fails_fast_with_its_binding_term_and_is_shown_by_explain():
    torch._dynamo.reset()
    shape, model = _shape_and_model()
    launch = composed.Launch(ranks=1, ep=1, ring=1, tokens_per_rank=2 * SEQ, b=4, b_acc=4)
    table = composed.compose(shape, launch, budget=2**40)
    with pytest.raises(InfeasibleBudgetError) as err:  # raised inside compile: no graph, no compute
        boundpass.compile(model, budget=table.total - 1, launch=launch, model_shape=shape)
    assert err.value.term == table.binding().name and "composed per-rank budget" in str(err.value)
    compiled = boundpass.compile(model, budget=max(table.total, 4 << 30), launch=launch, model_shape=shape)
    compiled(torch.randint(0, VOCAB, (2, SEQ)))
    text = flat(boundpass.explain(compiled).text(graph="none"))
    assert "composed per-rank budget of the launch configuration" in text and "FITS" in text
    assert table.binding().name in text
    with pytest.raises(BoundpassInputError, match="both launch="):
        boundpass.compile(model, budget="4GiB", launch=launch)


def test_fsdp_casts_count_in_the_embedding_backward():
    """composed.Launch.fsdp_param_b: under the b = 4 convention with bf16 compute and fp32 reduction (the MoP recipe),
    the embedding's backward holds three V x H copies in bf16 (autograd's dense gradient, its cast, FSDP2's copy-in)
    beside the fp32 reduce-scatter input: 3·2 + 4 = 10 bytes per V x H element where fp32 compute holds 4 + 4 (torch's
    allocator measured it: tests/recipes/test_recipe_mop.py). One rank has no such backward (nothing to reduce-scatter)."""
    import sympy

    from boundpass.core import symbols as sym

    def term(cast):
        terms = composed.term_formulas(True, True, False, frozenset(), "worst", False, "", fsdp_param_b=cast)
        return next(formula for name, formula, *_ in terms if name.startswith("embedding backward under ZeRO-3"))
    extra = sympy.simplify(term(2) - term(0))
    assert sympy.simplify(extra - sympy.Min(1, sym.W - 1) * sym.V * sym.H * (3 * 2 + sym.b - 2 * sym.b)) == 0, extra
    at = {sym.V: 32_768, sym.H: 256, sym.b: 4}
    assert extra.subs({**at, sym.W: 2}) == 2 * 32_768 * 256 and extra.subs({**at, sym.W: 1}) == 0
