"""Hugging Face transformers MoE models as their users call them (issue 35, the logits): `cm(input_ids=x, labels=y)`.

In training the [N, V] logits HF returns beside the loss are not materialised (None in the output: Liger-Kernel's
convention), so the vocab region is rewritten to Ring-DTP; loss and every gradient equal eager HF's (up to Ring-DTP's
strip-wise sums), and the certificate equals the measured whole step (live storages) within 1.10x both ways. In eval
the model's outputs are unchanged; vocab_keep_logits=True keeps the logits (the region is then skipped, as before).
Families: Mixtral, Qwen2-MoE (shared expert), Qwen3-MoE, OLMoE, GLM-4-MoE (group-limited routing); gpt-oss skipped with
its reason. Tiny configs built from the config classes (no hub), transformers pinned in the test extra.
"""
import copy

import pytest
import torch

import boundpass
from boundpass.testing.whole_step import allocator_step_peak, measured_step_peak

transformers = pytest.importorskip("transformers")
V, H = 1024, 64


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _common(**over) -> dict:
    """The tiny config every family's test model shares (no hub, no cache, no special tokens)."""
    return dict(dict(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, use_cache=False, eos_token_id=None, pad_token_id=None, bos_token_id=None),
                **over)


def _matches_eager(step, model, plain) -> None:
    """One training call as HF's users make it: the loss and every gradient as eager HF's (the fused-kernel class)."""
    tokens, labels = _batch()
    out, ref = step(input_ids=tokens, labels=labels), plain(input_ids=tokens, labels=labels)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=0)
    out.loss.backward()
    ref.loss.backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def _model(family: str):
    common = _common()
    torch.manual_seed(0)
    if family == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2,
                                                                          **common))
    if family == "qwen2_moe":  # routed experts beside a gated shared expert
        return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
            **common))
    if family == "glm4_moe":  # group-limited routing: a top-k over groups before the top-k over experts
        return transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, n_group=1, topk_group=1,
            first_k_dense_replace=0, **common))
    if family == "deepseek_v3":  # MLA attention (qk head dim 32, v head dim 16), a shared expert, group routing
        return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=1, n_group=1,
            topk_group=1, first_k_dense_replace=0, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
            qk_nope_head_dim=16, v_head_dim=16, **{**common, "num_key_value_heads": 4}))  # HF's MLA: kv heads = heads
    if family == "gpt_oss":
        return transformers.GptOssForCausalLM(transformers.GptOssConfig(num_local_experts=4, num_experts_per_tok=2,
                                                                        **common))
    if family == "qwen3_moe":
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1, **common))
    return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(num_experts=4, num_experts_per_tok=2, **common))


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (2, 128), generator=g)
    labels[:, :5] = -100  # ignored tokens
    return torch.randint(0, V, (2, 128), generator=g), labels


FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "deepseek_v3"]

def _same_step(step, model, plain, batch):
    """One step of the compiled model against the model itself (plain, its copy): the loss and every gradient."""
    tokens, labels = batch
    out = step(input_ids=tokens, labels=labels)
    ref = plain(input_ids=tokens, labels=labels)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=0)
    out.loss.backward()
    ref.loss.backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
    return out, ref


def _exact_against_eager(model, batch=None, **knobs):
    """boundpass.compile(model) against the model itself on one batch: the loss and every gradient; the report."""
    plain = copy.deepcopy(model)
    step = boundpass.compile(model, budget="1GiB", **knobs)
    out, ref = _same_step(step, model, plain, batch if batch is not None else _batch())
    return out, ref, boundpass.explain(step)



def _issue_shape_mixtral(**config):
    """Mixtral at issue 35's shape, V = 4,096 (H = 128, 2 layers, 8 experts, top-2), every token routed to experts
    0 and 1 (router weights zero: equal logits, top-k takes the first): the routing PipelinedLLEP's bound is set
    for (it holds for any routing; a random one measures below it)."""
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, eos_token_id=None, pad_token_id=None,
        bos_token_id=None, **config))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.zero_()
    return model


def _issue_batches(n=3):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 4096, (2, 512), generator=g), torch.randint(0, 4096, (2, 512), generator=g))
            for _ in range(n)]


@pytest.mark.parametrize("family", FAMILIES)
def test_training_drops_the_logits_rewrites_the_head_and_is_exact(family):
    out, ref, report = _exact_against_eager(_model(family))
    assert out.logits is None and ref.logits is not None
    (region,) = report.rewritten_of("vocab")
    assert region.module_path == "model.lm_head" and region.dropped_logits
    assert "are None in training" in str(report)
    # HF's grouped_mm experts (the default implementation) -> PipelinedLLEP, one op per layer
    dispatch = report.rewritten_of("dispatch")
    assert [r.module_path for r in dispatch] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert all("grouped_mm" in r.form for r in dispatch) and not report.skipped_of("dispatch")


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_the_sdpa_attention_is_rewritten_and_exact(family):
    """HF's sdpa attention under torch.compile (torch 2.13) passes the causal mask as a tensor built from aranges:
    the pass proves it the causal one by evaluating it at the traced length, drops it and rewrites the call. qwen3's
    (q_norm, k_norm, RoPE, repeat_kv) and mixtral's sublayers are walked in query blocks with k and v per key tile;
    deepseek_v3's MLA shares its RoPE tables between the query and the key paths, so the call alone is rewritten,
    with that reason. Loss and gradients within the fused-kernel class of the unrewritten model's."""
    model = _model(family)
    plain = copy.deepcopy(model)
    step = boundpass.compile(model, budget="1GiB", attention_enable=True)
    _matches_eager(step, model, plain)
    regions = boundpass.explain(step).rewritten_of("attention")
    assert len(regions) == 2 and all(r.causal for r in regions), [r.describe() for r in regions]
    if family == "deepseek_v3":
        assert all(not r.blocks and "outside the query path" in r.blocks_reason for r in regions)
    else:
        assert all(r.blocks and r.kv_blocks and r.host for r in regions), [r.describe() for r in regions]


def test_gpt_oss_experts_are_skipped_with_the_reason_and_the_step_exact():
    """gpt-oss's experts (biases, a clamped SwiGLU, its own combine) are not what PipelinedLLEP computes."""
    _, _, report = _exact_against_eager(_model("gpt_oss"))
    assert report.rewritten_of("vocab") and not report.rewritten_of("dispatch")
    assert all("PipelinedLLEP does not compute" in r.reason for r in report.skipped_of("dispatch"))


def test_experts_the_op_does_not_compute_are_skipped_with_the_reason_and_exact():
    """GeGLU experts (hidden_act="gelu"): the probes find no SwiGLU layout, the region stays as HF wrote it."""
    common = _common(num_hidden_layers=1)
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        num_local_experts=4, num_experts_per_tok=2, hidden_act="gelu", **common))
    _, _, report = _exact_against_eager(model)  # loss and gradients too (before: the loss only)
    (skipped,) = report.skipped_of("dispatch")
    assert "do not compute sum_s S[t, s] * SwiGLU_e(x[t])" in skipped.reason


def test_training_step_certified_both_ways_at_the_issues_shape():
    """Mixtral at H = 128, 8 experts, top-2, 2 x 512 tokens (V = 4,096): both regions rewritten, the whole step
    measured against the certificate under the routing the bound is set for."""
    model = _issue_shape_mixtral(use_cache=False)
    step = boundpass.compile(model, budget="1GiB")

    def train(tokens, labels):  # the caller holds the output (logits None) through backward
        out = step(input_ids=tokens, labels=labels)
        return out.loss, out
    measured = measured_step_peak(train, model, None, _issue_batches())
    # exact under that skewed routing too (a fresh compile of the same model: the measured steps left no gradients)
    _exact_against_eager(copy.deepcopy(model), _issue_batches(1)[0])
    report = boundpass.explain(step)
    assert len(report.rewritten_of("dispatch")) == 2 and report.rewritten_of("vocab")
    certified = step.certificates[-1].table.total
    assert measured <= certified <= 1.10 * measured, (certified, measured)


def test_eval_keeps_the_logits():
    model = _model("mixtral").eval()
    plain = copy.deepcopy(model)
    step = boundpass.compile(model, budget="1GiB")
    tokens, labels = _batch()
    with torch.no_grad():
        out = step(input_ids=tokens, labels=labels)
        ref = plain(input_ids=tokens, labels=labels)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-6, atol=0)


def test_keep_logits_returns_them_and_skips_the_region():
    model = _model("qwen3_moe")
    plain = copy.deepcopy(model)
    step = boundpass.compile(model, budget="1GiB", vocab_keep_logits=True)
    tokens, labels = _batch()
    out = step(input_ids=tokens, labels=labels)
    ref = plain(input_ids=tokens, labels=labels)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-6, atol=1e-6)
    (skipped,) = boundpass.explain(step).skipped_of("vocab")
    assert "are also returned by the compiled graph" in skipped.reason


def test_gradient_checkpointing_with_hf_defaults_offloads_boundaries_exactly():
    """HF's own checkpointing (activation_checkpointing_enable) with the config's default use_cache=True: the model's
    warning_once inside forward no longer stops the capture; SCO offloads every block boundary, exact and certified."""
    model = _issue_shape_mixtral()  # HF's default use_cache=True
    model.activation_checkpointing_enable()
    plain = copy.deepcopy(model)
    step = boundpass.compile(model, budget="1GiB", sco_enable=True, host_budget="1GiB")

    def train(tokens, labels):
        out = step(input_ids=tokens, labels=labels)
        return out.loss, out
    batches = _issue_batches()
    measured = measured_step_peak(train, model, None, batches)
    assert step.sco_plans[-1].offloaded == 2
    assert len(boundpass.explain(step).rewritten_of("dispatch")) == 2  # the experts inside the checkpoints too
    certified = step.certificates[-1].table.total
    assert measured <= certified <= 1.10 * measured, (certified, measured)
    tokens, labels = batches[0]
    train(tokens, labels)[0].backward()
    plain(input_ids=tokens, labels=labels).loss.backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def _skewed(model):
    """Every router's weight zeroed: equal scores, so top-k sends every token to the same k experts (the routing
    PipelinedLLEP's bound is set for; group-limited routers pick the first group the same way)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.zero_()
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_certified_both_ways_exact_and_refused_just_below_under_skewed_routing(family):
    """The family matrix under skewed routing: the whole step at torch's allocator within [measured, 1.10x measured]
    of the certificate, loss and every gradient equal eager's, and a budget 1 B under the least certificate (every
    knob at its narrowest) refused before any compute."""
    model = _skewed(_model(family))
    plain = copy.deepcopy(model)
    step = boundpass.compile(model, budget="1GiB")

    def train(tokens, labels):  # the caller holds the output (logits None) through backward
        out = step(input_ids=tokens, labels=labels)
        return out.loss, out
    measured = allocator_step_peak(train, model, None, [_batch(seed) for seed in range(3)])
    cert = step.certificates[-1]
    assert measured <= cert.table.total <= 1.10 * measured, (cert.table.total, measured)
    report = boundpass.explain(step)
    assert report.rewritten_of("vocab") and len(report.rewritten_of("dispatch")) == 2

    tokens, labels = _batch(7)
    _same_step(step, model, plain, (tokens, labels))

    least = cert.total_at(**{k.name: k.lo for k in cert.planner.knobs})
    tight = boundpass.compile(copy.deepcopy(plain), budget=least - 1)
    with pytest.raises(boundpass.InfeasibleBudgetError, match="cannot be met"):
        tight(input_ids=tokens, labels=labels)
    assert all(p.grad is None for p in tight.model.parameters())


def _mixtral_with(implementation: str):
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, use_cache=False,
                                        num_local_experts=4, num_experts_per_tok=2, eos_token_id=None,
                                        pad_token_id=None, bos_token_id=None)
    config._experts_implementation = implementation
    return transformers.MixtralForCausalLM(config)


def test_batched_mm_experts_are_rewritten_and_exact():
    _, _, report = _exact_against_eager(_mixtral_with("batched_mm"))
    dispatch = report.rewritten_of("dispatch")
    assert len(dispatch) == 2 and all("HF batched_mm" in r.form for r in dispatch)


def test_eager_experts_loop_is_refused_with_the_way_forward():
    """HF's eager experts loop over the experts a batch hit (data-dependent): one graph cannot hold it."""
    tokens, labels = _batch()
    step = boundpass.compile(_mixtral_with("eager"), budget="1GiB")
    with pytest.raises(boundpass.BoundpassInputError, match="_experts_implementation = 'grouped_mm'"):
        step(input_ids=tokens, labels=labels)
    torch._dynamo.reset()
    step = boundpass.compile(_mixtral_with("eager"), budget="1GiB", fullgraph=False)
    with pytest.raises(boundpass.NotCertifiedError, match="NOT CERTIFIED"):
        step(input_ids=tokens, labels=labels)


def test_hf_trainer_drives_the_compiled_model_exactly():
    """HF's Trainer (its AdamW, gradient clipping, scheduler) given boundpass.compile(model) instead of the model:
    the compiled module answers the attributes the Trainer reads (model.config, ...) with the model's, the head and
    experts are rewritten, and the losses it logs equal a Trainer run on the model itself; its evaluate (eval mode,
    logits kept) too."""
    import tempfile

    class Batches(torch.utils.data.Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            tokens, labels = _batch(i)
            return {"input_ids": tokens[0], "labels": labels[0]}

    def run(model):
        args = transformers.TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=3, per_device_train_batch_size=2,
                                              report_to=[], use_cpu=True, logging_steps=1, save_strategy="no",
                                              remove_unused_columns=False, label_names=["labels"], seed=0,
                                              disable_tqdm=True)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Batches(), eval_dataset=Batches())
        trainer.train()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        return losses, trainer.evaluate()["eval_loss"]

    model = _model("mixtral")
    plain = copy.deepcopy(model)
    step = boundpass.compile(model, budget="1GiB")
    assert step.config is model.config
    losses, eval_loss = run(step)
    ref_losses, ref_eval_loss = run(plain)
    assert len(losses) == 3
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    torch.testing.assert_close(eval_loss, ref_eval_loss, rtol=1e-5, atol=0)
    training, evaluation = step.reports  # two graphs: the training step, the eval (no-grad) call
    assert training.rewritten_of("vocab") and len(training.rewritten_of("dispatch")) == 2
    assert "are also returned" in evaluation.skipped_of("vocab")[0].reason  # eval keeps the logits


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_the_feed_forwards_are_walked_in_row_blocks_and_exact(family):
    """HF's MLPs (gate_proj / up_proj -> act -> down_proj): qwen2_moe's shared expert (on the flattened tokens),
    deepseek_v3's dense first layer (with its RMSNorm, which only it reads) and shared experts, each walked in row
    blocks beside the attention, and the hand-written RMSNorms other parts read in row blocks alone; loss and
    gradients as eager HF's. An MLP no wider than its input is left, with that reason."""
    common = _common()
    torch.manual_seed(0)
    if family == "qwen2_moe":
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=128,
            **common))
        expected = [(f"model.model.layers.{i}.mlp.shared_expert.down_proj", False) for i in (0, 1)]
        # the MoE layers' norm (read by the router, the experts, the shared expert and its gate), the final one; the
        # input norm joins the attention sublayer (only its q / k / v projections read it)
        expected_alone = [f"model.model.layers.{i}.post_attention_layernorm" for i in (0, 1)] + ["model.model.norm"]
    else:
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=2, n_group=1,
            topk_group=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16,
            qk_nope_head_dim=16, v_head_dim=16, **{**common, "num_key_value_heads": 4}))
        expected = [("model.model.layers.0.mlp.down_proj", True),
                    ("model.model.layers.1.mlp.shared_experts.down_proj", False)]
        # the attention is the call alone here (above): its input norm and the kv latent's norm stay outside it
        expected_alone = sorted([f"model.model.layers.{i}.{n}" for i in (0, 1)
                                 for n in ("input_layernorm", "self_attn.kv_a_layernorm")]
                                + ["model.model.layers.1.post_attention_layernorm", "model.model.norm"])
    plain = copy.deepcopy(model)
    step = boundpass.compile(model, budget="1GiB", attention_enable=True, feed_forward_enable=True)
    _matches_eager(step, model, plain)
    report = boundpass.explain(step)
    assert sorted((r.module_path, r.norm) for r in report.rewritten_of("feed_forward") if not r.readers) == expected
    # HF's hand-written RMSNorms (casts, square, mean, rsqrt, products) that several parts read, in row blocks alone
    alone = sorted(r.module_path for r in report.rewritten_of("feed_forward") if r.readers)
    assert alone == expected_alone, alone
    narrow = boundpass.compile(_model("qwen2_moe"), budget="1GiB", feed_forward_enable=True)   # 64 <= H = 64
    tokens, labels = _batch()
    narrow(input_ids=tokens, labels=labels).loss.backward()
    skipped = boundpass.explain(narrow).skipped_of("feed_forward")
    assert skipped and all("no intermediate wider than its input" in r.reason for r in skipped)
