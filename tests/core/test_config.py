"""boundpass.Config (issue 17): every knob has one name on every surface, its default is defined once (in
boundpass/core/config.py), __post_init__ refuses a bad value naming the knob, and compile(model, config) is compile(model,
**flat keywords)."""
import ast
import dataclasses
import inspect
import os
import re
import subprocess
import sys

import pytest
import torch

import boundpass
from boundpass.testing.dense_lm import LossLM
from boundpass.core import config as bc
from boundpass.core.config import Config, config_from, knob_paths

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KNOBS = knob_paths()  # keyword -> Config path
# what boundpass.compile takes beside the knobs: objects, not settings (and torch.compile's own capture flags)
COMPILE_OTHERS = {"model", "config", "loss_fn", "ring_group", "optimizer", "launch", "model_shape", "fullgraph",
                  "dynamic", "knobs"}
# Launch / plan's launch facts: degrees, sizes, dtypes, operator set (not knobs of Config)
LAUNCH_FACTS = {"ranks", "ep", "ring", "tokens_per_rank", "operators", "b", "b_acc", "routing",
                "grad_accumulation", "fsdp_param_b", "held_batch_per_token", "sequences_per_step",
                "layout", "loss_chunks", "attention_tiles"}
PLAN_OTHERS = LAUNCH_FACTS | {"model", "flavor", "context", "global_batch", "dtype", "source", "do_trace", "solve",
                              "search", "progress", "trace_blocks"}
# the names the knobs had before issue 17: none may come back on any surface
OLD_NAMES = ("chunk_cap", "offload_optimizer", "DEFAULT_CHUNK_CAP", "DEFAULT_VOCAB_BLOCK", "--chunk-cap",
             "--bucket", "--slots", "boundpass.sco\"", "boundpass.vocab\"", "boundpass.vocab_block",
             "boundpass.optimizer_bucket", "boundpass.optimizer_slots")


# ------------------------------------------------------------------------------------------- the rule
def test_the_naming_rule():
    assert KNOBS == {
        "budget": "budget", "host_budget": "host_budget", "allow_uncertified": "allow_uncertified",
        "max_tokens_per_rank": "max_tokens_per_rank", "inner": "inner", "vocab_enable": "vocab.enable", "vocab_block": "vocab.block",
        "vocab_keep_logits": "vocab.keep_logits",
        "dispatch_enable": "dispatch.enable", "dispatch_cap": "dispatch.cap",
        "dispatch_borrowed_slots": "dispatch.borrowed_slots", "attention_enable": "attention.enable",
        "attention_chunk": "attention.chunk", "attention_query_blocks": "attention.query_blocks",
        "attention_offload": "attention.offload", "feed_forward_enable": "feed_forward.enable",
        "feed_forward_chunk": "feed_forward.chunk",
        "sco_enable": "sco.enable", "sco_max_layers": "sco.max_layers", "optimizer_offload": "optimizer.offload",
        "optimizer_bucket": "optimizer.bucket", "optimizer_slots": "optimizer.slots"}
    for keyword, path in KNOBS.items():
        assert keyword == path.replace(".", "_")
    # a section's on/off switch is `enable` (the optimizer section has none: `offload` chooses what runs it)
    for name in ("vocab", "dispatch", "attention", "feed_forward", "sco"):
        assert "enable" in {f.name for f in dataclasses.fields(type(getattr(Config(), name)))}


def test_every_field_has_a_docstring():
    for path, classes in (("boundpass/core/config.py", None), ("recipes/trainer.py", {"BoundpassConfig"})):
        tree = ast.parse(open(os.path.join(REPO, path)).read())
        seen = 0
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            if classes is not None and cls.name not in classes:
                continue
            body = cls.body
            for i, node in enumerate(body):
                if isinstance(node, ast.AnnAssign):
                    seen += 1
                    doc = body[i + 1] if i + 1 < len(body) else None
                    assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and \
                        isinstance(doc.value.value, str) and doc.value.value.strip(), \
                        f"{path}: {cls.name}.{node.target.id} has no docstring"
        assert seen >= (len(KNOBS) if classes is None else 5)


def test_config_imports_without_torch():
    probe = ("import sys, boundpass; c = boundpass.Config(budget='1GiB', dispatch={'cap': 8}); "
             "from boundpass.core.config import config_from; config_from(c, vocab_block=256); "
             "print(sorted(m for m in ('torch', 'sympy', 'torchtitan') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------------------------------- one name per knob
def _params(fn) -> dict:
    return {n: p for n, p in inspect.signature(fn).parameters.items()}


def test_compile_takes_every_knob_by_its_keyword_and_nothing_else():
    from boundpass.backend.compiler import compile as bp_compile
    params = _params(bp_compile)
    assert set(params) == COMPILE_OTHERS, "a knob must reach compile through Config / **knobs, not its own argument"
    assert params["knobs"].kind is inspect.Parameter.VAR_KEYWORD
    defaults = Config().flat()
    for keyword in KNOBS:  # every keyword builds a Config whose path holds it
        value = {"budget": "2GiB", "host_budget": "3GiB", "inner": "inductor", "sco_enable": False,
                 "optimizer_offload": True}.get(keyword, 7 if defaults[keyword] is None else not defaults[keyword])
        assert config_from(**{keyword: value}).flat()[keyword] == value, keyword


def test_launch_plan_and_plan_input_use_the_same_names_and_defaults():
    from boundpass.bound.composed import Launch
    from boundpass.planning.full_scale import plan
    from boundpass.core.plan_input import PlanInput, make_input
    defaults = Config().flat()
    launch_fields = {f.name: f.default for f in dataclasses.fields(Launch)}
    input_fields = {f.name: f.default for f in dataclasses.fields(PlanInput)}
    launch_knobs = set(bc.PLAN_KNOBS) - {"budget", "host_budget"}  # the budgets are compose()'s arguments
    assert set(launch_fields) - LAUNCH_FACTS == launch_knobs
    assert set(input_fields) - PLAN_OTHERS - {"budget", "host_budget"} == launch_knobs
    for fn in (plan, make_input):
        params = _params(fn)
        assert set(params) - PLAN_OTHERS == set(bc.PLAN_KNOBS), fn.__name__
        for name in bc.PLAN_KNOBS:
            expected = bc.PLAN_BUDGET if name == "budget" else defaults[name]
            assert params[name].default == expected, (fn.__name__, name)
    for name in launch_knobs:
        assert launch_fields[name] == input_fields[name] == defaults[name] is None, name
    # a knob left at None is what boundpass/core/config.py says, in one place
    from boundpass.runtime import offload_adamw as oa
    launch = Launch(ranks=1, ep=1, ring=1, tokens_per_rank=8)
    assert launch.resolved("dispatch_cap") == bc.PLAN_DISPATCH_CAP
    assert launch.resolved("vocab_block") == bc.PLAN_VOCAB_BLOCK
    assert launch.resolved("optimizer_slots") == bc.OPTIMIZER_SLOTS == oa.DEFAULT_SLOTS
    assert launch.resolved("optimizer_bucket") == oa.DEFAULT_BUCKET == oa.default_bucket(bc.OPTIMIZER_SLOTS)
    assert oa.DEFAULT_STAGING_BYTES is bc.OPTIMIZER_STAGING_BYTES
    assert 16 * oa.DEFAULT_SLOTS * oa.DEFAULT_BUCKET == bc.OPTIMIZER_STAGING_BYTES
    assert Launch(ranks=1, ep=1, ring=1, tokens_per_rank=8, dispatch_cap=3).resolved("dispatch_cap") == 3


def test_cli_options_are_the_knobs_keywords():
    from boundpass.__main__ import _parser
    parser = _parser()
    plan_parser = parser._subparsers._group_actions[0].choices["plan"]
    options = {o: a for a in plan_parser._actions for o in a.option_strings}
    args = parser.parse_args(["plan", "deepseek_v3", "671B", "-W", "8", "-N", "8"])
    for keyword in bc.PLAN_KNOBS:
        option = "--" + keyword.replace("_", "-")
        assert option in options, option
        expected = bc.PLAN_BUDGET if keyword == "budget" else Config().flat()[keyword]
        assert getattr(args, keyword) == expected, keyword
    assert not {"--chunk-cap", "--bucket", "--slots"} & set(options)


def test_no_old_name_is_left_in_the_code():
    """The knobs' old names (chunk_cap, offload_optimizer, --bucket, --boundpass.sco, ...) appear nowhere in the code,
    the benches or the tests (the recorded results under docs/results/ keep what was run then)."""
    found = []
    for top in ("boundpass", "runtime", "recipes", "bench", "tests"):
        for root, _, files in os.walk(os.path.join(REPO, top)):
            for name in files:
                if not name.endswith((".py", ".sh")) or name == "test_config.py":
                    continue
                text = open(os.path.join(root, name)).read()
                found += [f"{os.path.relpath(os.path.join(root, name), REPO)}: {old}" for old in OLD_NAMES
                          if re.search(re.escape(old) + (r"\b" if old[-1].isalnum() else ""), text)]
    assert not found, found


@pytest.mark.torchtitan
def test_the_recipe_section_is_config_and_parses_every_knob():
    """--boundpass.<section>.<field> through torchtitan's own ConfigManager (tyro), as `python -m
    boundpass.recipes.train` parses it: every knob of Config, by its path, into the same Config."""
    pytest.importorskip("torchtitan")
    from boundpass.recipes.mop import MoPOptions
    from boundpass.recipes.train import config_manager_class
    from boundpass.recipes.trainer import BoundpassConfig
    assert issubclass(BoundpassConfig, Config)
    assert {f.name: f.default for f in dataclasses.fields(Config)}.items() <= \
        {f.name: f.default for f in dataclasses.fields(BoundpassConfig)}.items()
    assert BoundpassConfig().flat() == Config().flat()  # the same defaults: inherited, not repeated
    values = {"budget": "2GiB", "host_budget": "3GiB", "max_tokens_per_rank": 128, "inner": "inductor",
              "vocab_enable": False, "vocab_block": 256, "dispatch_enable": False, "dispatch_cap": 64,
              "dispatch_borrowed_slots": 3, "sco_enable": False, "sco_max_layers": 2, "optimizer_offload": True, "optimizer_bucket": 4096,
              "optimizer_slots": 1, "allow_uncertified": True, "vocab_keep_logits": True, "attention_enable": True,
              "attention_chunk": 128, "attention_query_blocks": False, "attention_offload": False,
              "feed_forward_enable": True, "feed_forward_chunk": 96}
    assert set(values) == set(KNOBS)
    argv = ["--module", "boundpass.recipes", "--config", "deepseek_v3_debug"]
    for keyword, value in values.items():  # a bool is a flag, as torchtitan's own: --boundpass.vocab.no-enable
        section, _, field = KNOBS[keyword].rpartition(".")
        argv += [f"--boundpass.{section}.no-{field}"] if value is False and (keyword.endswith("_enable") and
                                                                          section in ("vocab", "dispatch")
                                                                          or keyword in ("attention_query_blocks",
                                                                                         "attention_offload")) else [f"--boundpass.{KNOBS[keyword]}"] \
            if keyword in ("allow_uncertified", "vocab_keep_logits", "attention_enable", "feed_forward_enable") \
            else [f"--boundpass.{KNOBS[keyword]}", str(value)]
    parsed = config_manager_class()().parse_args(argv).boundpass
    assert isinstance(parsed, BoundpassConfig) and parsed.flat() == values
    assert config_from(parsed) == Config(**{f.name: getattr(parsed, f.name) for f in dataclasses.fields(Config)})
    with pytest.raises(SystemExit):  # tyro reports __post_init__'s error and exits, as for any bad argument
        config_manager_class()().parse_args([*argv[:4], "--boundpass.dispatch.cap", "0"])
    # the MoP layout's knobs carry the same names and defaults
    options = {f.name: f.default for f in dataclasses.fields(MoPOptions)}
    assert options["dispatch_cap"] is options["vocab_block"] is options["dispatch_borrowed_slots"] is None
    assert MoPOptions().cap == bc.PLAN_DISPATCH_CAP
    with pytest.raises(boundpass.BoundpassInputError, match=r"dispatch\.cap"):
        MoPOptions(dispatch_cap=0)
    with pytest.raises(boundpass.BoundpassInputError, match=r"dispatch\.borrowed_slots"):
        MoPOptions(dispatch_borrowed_slots=-1)


# ------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("knobs,names", [
    (dict(vocab_block=0), ("vocab.block", "vocab_block=", "--vocab-block")),
    (dict(vocab_enable="yes"), ("vocab.enable", "vocab_enable=")),
    (dict(dispatch_cap=-1), ("dispatch.cap", "dispatch_cap=", "--dispatch-cap")),
    (dict(dispatch_enable=None), ("dispatch.enable", "dispatch_enable=")),
    (dict(dispatch_borrowed_slots=-1), ("dispatch.borrowed_slots", "dispatch_borrowed_slots=",
                                        "--dispatch-borrowed-slots")),
    (dict(sco_enable=1), ("sco.enable", "sco_enable=")),  # 1 == True, but not True: refused
    (dict(sco_max_layers=-1), ("sco.max_layers", "sco_max_layers=", "--sco-max-layers")),
    (dict(optimizer_offload="yes"), ("optimizer.offload", "optimizer_offload=")),
    (dict(optimizer_bucket=True), ("optimizer.bucket", "optimizer_bucket=", "--optimizer-bucket")),
    (dict(optimizer_slots=1.5), ("optimizer.slots", "optimizer_slots=", "--optimizer-slots")),
    (dict(max_tokens_per_rank=0), ("max_tokens_per_rank",)),
    (dict(budget="lots"), ("budget",)),
    (dict(host_budget=-5), ("host_budget",)),
    (dict(inner="eager"), ("inner",)),
])
def test_post_init_refuses_a_bad_value_naming_the_knob(knobs, names):
    with pytest.raises(boundpass.BoundpassInputError) as info:
        config_from(**knobs)
    for name in names:
        assert name in str(info.value), (name, str(info.value))
    section, _, field = KNOBS[next(iter(knobs))].partition(".")
    with pytest.raises(boundpass.BoundpassInputError):  # the same check building the dataclasses directly
        if field:
            Config(**{section: {field: next(iter(knobs.values()))}})
        else:
            Config(**knobs)


def test_unknown_keyword_lists_the_known_ones_and_keywords_override_a_config():
    with pytest.raises(boundpass.BoundpassInputError) as info:
        config_from(chunk_cap=8)
    assert "chunk_cap" in str(info.value) and all(k in str(info.value) for k in KNOBS)
    with pytest.raises(boundpass.BoundpassInputError, match="must be a boundpass.Config"):
        config_from({"budget": "1GiB"})
    base = Config(budget="1GiB", dispatch={"cap": 8}, sco={"enable": False})
    over = config_from(base, dispatch_cap=16, budget="2GiB")
    assert (over.dispatch.cap, over.budget, over.sco.enable) == (16, "2GiB", False)  # the keyword wins
    assert base.dispatch.cap == 8 and base.budget == "1GiB"  # the Config given is not changed
    assert config_from(base) is base and base.replace(vocab_block=128).vocab.block == 128
    with pytest.raises(boundpass.BoundpassInputError, match="dispatch.cap"):
        config_from(base, dispatch_cap=0)  # validated again


# ------------------------------------------------------------------------------------------- compile
VOCAB, HIDDEN = 512, 16


def PlainLM():
    return LossLM(VOCAB, HIDDEN)


def _step(step, model, tok, labels):
    loss = step(tok, labels)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads, boundpass.explain(step)


def test_compile_with_a_config_is_compile_with_its_keywords():
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    tok, labels = (torch.randint(0, VOCAB, (2, 64), generator=gen) for _ in range(2))
    torch.manual_seed(0)
    base = PlainLM()
    knobs = dict(budget="1GiB", vocab_block=128, dispatch_enable=False, sco_enable=False, max_tokens_per_rank=128)
    runs = {}
    for how in ("config", "keywords"):
        model = PlainLM()
        model.load_state_dict(base.state_dict())
        torch._dynamo.reset()
        step = boundpass.compile(model, config_from(**knobs)) if how == "config" else boundpass.compile(model, **knobs)
        assert type(step.boundpass_config) is Config and step.boundpass_config.flat() == config_from(**knobs).flat()
        runs[how] = _step(step, model, tok, labels)
    (loss_a, grads_a, report_a), (loss_b, grads_b, report_b) = runs["config"], runs["keywords"]
    assert torch.equal(loss_a, loss_b) and all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
    assert report_a.table.total == report_b.table.total
    assert [(r.kind, r.rewritten) for r in report_a.regions] == [(r.kind, r.rewritten) for r in report_b.regions]
    assert report_a.rewritten_of("vocab") and report_a.certificate.planner.knobs[0].value == 128  # the user's C
    # a keyword beside the Config wins; vocab.enable False leaves the region as the model wrote it
    model = PlainLM()
    model.load_state_dict(base.state_dict())
    torch._dynamo.reset()
    step = boundpass.compile(model, config_from(**knobs), vocab_enable=False)
    loss_off, grads_off, report_off = _step(step, model, tok, labels)
    assert not report_off.rewritten_of("vocab")
    torch.testing.assert_close(loss_off, loss_a)
    for a, b in zip(grads_off, grads_a):
        torch.testing.assert_close(a, b)
    torch._dynamo.reset()


def test_compile_refuses_a_missing_budget_and_an_unknown_keyword():
    with pytest.raises(boundpass.BoundpassInputError, match="needs a budget"):
        boundpass.compile(PlainLM())
    with pytest.raises(boundpass.BoundpassInputError, match="unknown boundpass knob"):
        boundpass.compile(PlainLM(), budget="1GiB", offload_optimizer=True)
