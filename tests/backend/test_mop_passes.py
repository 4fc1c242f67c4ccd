"""The MoP layout's passes on 2 gloo ranks, apart from tests/recipes/test_mop.py's 4-rank launches (a module of its own so
the suite's two workers can run it beside that one): the head step through the vocab pass against Ring-DTP called
directly, and the passes on the graphs Dynamo recompiles for a new sequence length."""
import pytest
import torch

pytest.importorskip("torchtitan")
from boundpass.testing.distributed import run_on_ranks  # noqa: E402

# test_mop.py's model, vocabulary, chunk cap and bf16 expert tolerance
NAME, VOCAB, CAP, BF16_EXPERT_RTOL = "deepseek_v3", 256, 4, 5e-3
pytestmark = [pytest.mark.torchtitan, pytest.mark.distributed]


def _head_step_vs_direct(rank, world):
    """mop_loss's head step (the gathered vocab-sharded weight, projection, cross-entropy) compiled through the vocab
    pass, against Ring-DTP called directly on the shard: loss and both gradients, fp32 and bf16, labels with
    ignore_index. Then a head step the pass cannot rewrite to Ring-DTP on the shard (the weight gathered along the
    hidden dim) is refused."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from boundpass.core.errors import BoundpassInputError
    from boundpass.backend.layout_compile import RingDTPHeadBackend
    from boundpass.recipes.mop import RingDTPHead, mop_loss
    from boundpass.runtime.ring_dtp import ring_dtp_loss
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(rank)
    N, H, V = 24, 16, 40
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        shard = torch.randn(V // world, H, generator=gen)
        model = torch.nn.Module()
        model.lm_head = RingDTPHead(torch.nn.Parameter(DTensor.from_local(shard, mesh, [Shard(0)], run_check=False)),
                                    mesh)
        pred = torch.randn(2, N // 2, H, generator=gen).to(dtype)
        labels = torch.randint(0, V, (2, N // 2), generator=gen)
        labels[0, :3] = -100
        results = []
        for way in ("pass", "direct"):
            h = pred.clone().requires_grad_()
            model.lm_head.weight.grad = None
            if way == "pass":
                loss, _ = mop_loss(model)(h, labels, torch.tensor(N * world))
            else:
                w = model.lm_head.weight.to_local().to(dtype)
                loss = ring_dtp_loss(h.reshape(-1, H), w, labels.reshape(-1), vocab_size=V,
                                     group=mesh.get_group()) / (N * world)
            loss.backward()
            results.append((loss.detach(), h.grad, model.lm_head.weight.grad.to_local()))
        (a, ha, wa), (b, hb, wb) = results
        out[str(dtype)] = (torch.equal(a, b), torch.equal(ha, hb), torch.equal(wa, wb))
    group = mesh.get_group()

    def wrong_dim(h, w_shard, labels):  # [V/W, H] gathered along H: not the vocab rows
        w = funcol.all_gather_tensor_autograd(w_shard.t().contiguous(), 0, group).t()
        return F.cross_entropy(F.linear(h, w[:, :H]), labels, reduction="sum")
    try:
        torch.compile(wrong_dim, backend=RingDTPHeadBackend(group), fullgraph=True)(
            torch.randn(N, H), torch.randn(V // world, H), torch.randint(0, V // world, (N,)))
        out["refused"] = None
    except Exception as err:  # Dynamo wraps the backend's error
        inner = getattr(err, "inner_exception", err)
        out["refused"] = (type(inner).__name__, str(inner)) if isinstance(inner, BoundpassInputError) else repr(err)
    dist.barrier()
    return out


def test_head_step_through_the_vocab_pass_is_ring_dtp_on_the_shard():
    for rank, out in enumerate(run_on_ranks(_head_step_vs_direct, 2, timeout_s=300)):
        for dtype in ("torch.float32", "torch.bfloat16"):
            assert out[dtype] == (True, True, True), (rank, dtype, out[dtype])  # bitwise: the same op, same inputs
        kind, message = out["refused"]
        assert kind == "BoundpassInputError" and "Ring-DTP was asked for" in message, out["refused"]


def _two_lengths(rank, world):
    """The layout trained at two sequence lengths in one process, operators on and off: Dynamo recompiles the block
    graphs and the head step with symbolic sizes at the second length (bench/mop.py sweeps lengths this way), and
    the passes must rewrite those graphs too."""
    import torch.distributed as dist
    from boundpass.recipes.mop import build_model, mop_config, mop_loss, parallelize_mop, shard_batch
    out = {}
    for ops in (False, True):
        cfg = mop_config(NAME, world=world, ep=2, seq_len=64, vocab_size=VOCAB)
        model = build_model(cfg, layers=2)
        parallelize_mop(model, cfg, world=world, pipelined_llep=ops, ring_dtp=True, dispatch_cap=CAP)
        loss_fn = mop_loss(model)
        steps = []
        for length in (32, 64):
            g = torch.Generator().manual_seed(length)
            tokens, labels = (torch.randint(0, VOCAB, (1, length), generator=g) for _ in range(2))
            tokens, labels, positions = shard_batch(tokens, labels, rank, world)
            loss, _ = loss_fn(model(tokens, positions=positions), labels, torch.tensor(length))
            loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total)
            grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                     for n, p in model.named_parameters() if p.grad is not None}
            model.zero_grad(set_to_none=True)
            steps.append((total.item(), grads))
        backend = model._mop.dispatch_backend
        out[ops] = (steps, [str(r.tokens) for r in backend.regions] if backend else [], list(model._mop.dispatch))
    return out


def test_passes_rewrite_the_graphs_dynamo_recompiles_for_a_new_length():
    out = run_on_ranks(_two_lengths, 2, timeout_s=400)[0]
    (plain, _, _), (ops, tokens, dispatch) = out[False], out[True]
    assert dispatch == ["layers.1.moe.routed_experts"]
    assert len(tokens) == 2 and tokens[0].isdigit() and not tokens[1].isdigit(), tokens  # static, then symbolic T
    for (loss_p, grads_p), (loss_o, grads_o) in zip(plain, ops):
        assert loss_o == loss_p  # the first block's output is the same; the MoE block's experts run in bf16 either way
        for n, g in grads_p.items():
            rel = ((grads_o[n] - g).norm() / g.norm().clamp_min(1e-30)).item()
            assert rel <= BF16_EXPERT_RTOL, f"{n}: {rel:.2e}"
