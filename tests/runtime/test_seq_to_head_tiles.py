"""Sequence-to-head attention in tiles with the whole-sequence tensors on the host (runtime/seq_to_head_tiles.py):
exact against unsharded attention on 1 and 2 gloo ranks (forward and backward, causal and not, GQA, MLA's narrower v,
a chunk that leaves ragged pieces, bf16), the refusals, and its device and host bounds measured both ways."""
import pytest
import torch

from boundpass.core import symbols as sym
from boundpass.core.errors import BoundpassInputError
from boundpass.runtime.seq_to_head import shard_sequence
from boundpass.testing.distributed import run_on_ranks

# (B, L, A_q, A_kv, (D, D_v), causal, chunk, dtype)
CASES = [
    (1, 48, 4, 4, (16, 16), True, 8, "float64"),
    (2, 40, 4, 2, (16, 16), True, 7, "float64"),     # GQA; pieces and tiles ragged (20 tokens per rank, 7)
    (1, 48, 4, 4, (24, 16), True, 16, "float64"),    # MLA: v narrower than q / k
    (1, 32, 4, 2, (16, 8), False, 8, "float64"),     # not causal
    (1, 64, 4, 4, (24, 16), True, 16, "float32"),
]
TOL = {"float64": dict(rtol=1e-10, atol=1e-10), "float32": dict(rtol=1e-4, atol=1e-5)}
# the bound at (B, L, A_q, A_kv, (D, D_v), chunk, dtype)
BOUND_CASES = [(1, 512, 4, 4, (32, 32), 64, "float32"), (2, 512, 4, 2, (48, 32), 64, "float32"),
               (1, 2048, 4, 4, (48, 32), 128, "bfloat16"), (1, 1536, 8, 4, (32, 32), 96, "bfloat16")]


def _problem(B, L, A_q, A_kv, D, dtype, seed=0):
    D_qk, D_v = D
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, L, A_q, D_qk), (B, L, A_kv, D_qk), (B, L, A_kv, D_v), (B, L, A_q, D_v)]
    return [torch.randn(*s, generator=g, dtype=torch.float64).to(getattr(torch, dtype)) for s in shapes]


def _group(world):
    import torch.distributed as dist
    return dist.group.WORLD if world > 1 else None


def _vs_reference(rank, world, B, L, A_q, A_kv, D, causal, chunk, dtype):
    """Max |tiles - reference| over the output and dq / dk / dv of this rank's tokens; the reference is torch's math
    attention on the whole sequence in fp64."""
    from boundpass.runtime.seq_to_head_tiles import seq_to_head_tiles
    qf, kf, vf, gf = _problem(B, L, A_q, A_kv, D, dtype)
    s = shard_sequence(L, rank, world)
    q, k, v = (t[:, s].clone().requires_grad_() for t in (qf, kf, vf))
    out = seq_to_head_tiles(q, k, v, _group(world), causal=causal, chunk=chunk)
    out.backward(gf[:, s])
    ref_in = [t.to(torch.float64).requires_grad_() for t in (qf, kf, vf)]
    ref = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in ref_in), is_causal=causal,
                                                           enable_gqa=A_q != A_kv).transpose(1, 2)
    ref.backward(gf.to(torch.float64))
    pairs = [(out, ref[:, s]), (q.grad, ref_in[0].grad[:, s]), (k.grad, ref_in[1].grad[:, s]),
             (v.grad, ref_in[2].grad[:, s])]
    ok = all(torch.allclose(a.to(torch.float64), b, **TOL[dtype]) for a, b in pairs)
    return ok, max((a.to(torch.float64) - b).abs().max().item() for a, b in pairs)


def _bf16_against_sdpa(rank, world):
    """bf16: the tiles' distance from fp64 is no more than 2x torch's own bf16 SDPA's (its fused kernel's)."""
    from boundpass.runtime.seq_to_head_tiles import seq_to_head_tiles
    B, L, A, D = 1, 128, 4, (32, 32)
    qf, kf, vf, gf = _problem(B, L, A, A, D, "float64", seed=3)
    s = shard_sequence(L, rank, world)
    q, k, v = (t[:, s].to(torch.bfloat16).requires_grad_() for t in (qf, kf, vf))
    out = seq_to_head_tiles(q, k, v, _group(world), chunk=32)
    out.backward(gf[:, s].to(torch.bfloat16))
    sdpa = lambda *t: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        *(x.transpose(1, 2) for x in t), is_causal=True).transpose(1, 2)
    ref_in = [t.clone().requires_grad_() for t in (qf, kf, vf)]
    ref = sdpa(*ref_in)
    ref.backward(gf)
    low_in = [t.to(torch.bfloat16).requires_grad_() for t in (qf, kf, vf)]
    low = sdpa(*low_in)
    low.backward(gf.to(torch.bfloat16))
    ours = [out, q.grad, k.grad, v.grad]
    theirs = [low[:, s], *(t.grad[:, s] for t in low_in)]
    exact = [ref[:, s], *(t.grad[:, s] for t in ref_in)]
    return [((a.double() - e).abs().max().item(), (b.double() - e).abs().max().item())
            for a, b, e in zip(ours, theirs, exact)]


def _measured(rank, world, B, L, A_q, A_kv, D, chunk, dtype):
    """{op: (peak, its registered bound)} of each of the four ops' calls on this rank at torch's allocator, and (host
    pool bytes, host bound); the pool made by a first forward + backward (host memory, kept across calls)."""
    from boundpass.runtime import host_tiles
    from boundpass.runtime import seq_to_head_tiles as st
    from boundpass.testing.whole_step import allocator_peak_of
    qf, kf, vf, gf = _problem(B, L, A_q, A_kv, D, dtype, seed=1)
    s = shard_sequence(L, rank, world)
    q, k, v, go = (t[:, s].clone() for t in (qf, kf, vf, gf))   # own storages (a slice keeps the whole)
    del qf, kf, vf, gf
    group = _group(world)
    name = group.group_name if group is not None else ""
    host_tiles.clear_pool()
    out, lse, ticket = st.tiles_forward(q, k, v, name, True, None, chunk)
    st.tiles_backward(go, out, lse, ticket, name, True, None, chunk, A_kv, D[0])
    pool = host_tiles.pool_bytes()
    q_shape = list(q.shape)
    common = dict(group=name, chunk=chunk)
    (handle, ticket), put = allocator_peak_of(lambda: st.tiles_put(q, k, v, name, chunk), [q, k, v])
    (out, lse), attend = allocator_peak_of(
        lambda: st.tiles_attend(handle, ticket, name, True, None, chunk, q_shape, A_kv, D[1]), [handle, ticket])
    grad_handle, attend_bwd = allocator_peak_of(
        lambda: st.tiles_attend_backward(go, out, lse, ticket, name, True, None, chunk, A_kv, D[0]),
        [go, out, lse, ticket])
    _, take = allocator_peak_of(lambda: st.tiles_take(grad_handle, ticket, name, chunk, q_shape, A_kv, D[1]),
                                [grad_handle, ticket])
    args = {"seq_to_head_tiles_put": (put, dict(q=q, k=k, v=v, **common)),
            "seq_to_head_tiles_attend": (attend, dict(handle=handle, ticket=ticket, causal=True, scale=0.0,
                                                      q_shape=q_shape, kv_heads=A_kv, d_v=D[1], **common)),
            "seq_to_head_tiles_attend_bwd": (attend_bwd, dict(grad_out=go, out=out, lse=lse, ticket=ticket,
                                                              causal=True, scale=0.0, kv_heads=A_kv, d_qk=D[0],
                                                              **common)),
            "seq_to_head_tiles_take": (take, dict(grad_handle=grad_handle, ticket=ticket, q_shape=q_shape,
                                                  kv_heads=A_kv, d_v=D[1], **common))}
    peaks = {op: (peak, int(st._bounds(op)[0](a, {}))) for op, (peak, a) in args.items()}
    host = int(st._bounds("seq_to_head_tiles_attend_bwd")[1](args["seq_to_head_tiles_attend_bwd"][1], {}))
    return peaks, (pool, host)


def _stale_rows(rank, world):
    """Two attentions' forwards, then the first's backward: refused (its host rows were overwritten)."""
    from boundpass.runtime.seq_to_head_tiles import seq_to_head_tiles
    q, k, v, g = _problem(1, 16, 2, 2, (8, 8), "float64")
    first = seq_to_head_tiles(*(t.clone().requires_grad_() for t in (q, k, v)), _group(world), chunk=4)
    seq_to_head_tiles(q, k, v, _group(world), chunk=4)
    try:
        first.backward(g)
    except BoundpassInputError as e:
        return str(e)
    return None


def _all_on_ranks(rank, world):
    torch.set_num_threads(1)
    return dict(exact=[_vs_reference(rank, world, *c) for c in CASES], bf16=_bf16_against_sdpa(rank, world),
                bound=[_measured(rank, world, *c) for c in BOUND_CASES], stale=_stale_rows(rank, world))


@pytest.fixture(scope="module", params=[1, 2], ids=lambda w: f"W{w}")
def ranks(request):
    world = request.param
    if world == 1:
        return world, [_all_on_ranks(0, 1)]
    return world, run_on_ranks(_all_on_ranks, world, timeout_s=300)


def test_exact_vs_unsharded_attention(ranks):
    world, results = ranks
    for rank, res in enumerate(results):
        for case, (ok, err) in zip(CASES, res["exact"]):
            assert ok, f"W={world} rank {rank} {case}: max |tiles - reference| = {err:.3e}"


def test_bf16_no_further_from_fp64_than_torch_sdpa(ranks):
    world, results = ranks
    for res in results:
        for ours, theirs in res["bf16"]:
            assert ours <= 2 * theirs + 1e-3, (ours, theirs)


def test_bound_sound_and_tight(ranks):
    """Each op's call measured at torch's allocator <= its registered bound <= 1.25x measured; the pool holds what the
    host bound says."""
    world, results = ranks
    for rank, res in enumerate(results):
        for case, (peaks, (pool, host)) in zip(BOUND_CASES, res["bound"]):
            for op, (peak, bound) in peaks.items():
                assert peak <= bound <= 1.25 * peak, (world, rank, case, op, peak, bound, bound / peak)
            assert pool == host, (world, rank, case, pool, host)


def test_backward_on_overwritten_rows_is_refused(ranks):
    world, results = ranks
    for res in results:
        assert res["stale"] is not None and "full activation checkpointing" in res["stale"]


def test_device_bytes_do_not_grow_with_the_whole_sequence():
    """Beyond the rank's own tokens' tensors (inputs, outputs, gradients, lse), the bound is O(C_s): the same at 4K
    and 64K tokens per rank."""
    from boundpass.runtime import chunked_attention as ca
    from boundpass.runtime import seq_to_head_tiles as st
    values = {sym.W: 4, sym.A_q: 16, sym.A_kv: 16, sym.D_h: 192, ca.D_v_sym: 128, sym.b: 2, sym.b_acc: 4,
              ca.C_s_sym: 256}
    for part in ("forward", "backward"):
        bound = st.seq_to_head_tiles_bound(part, mixed_precision=True, gqa=False, fused=True, padded=True)
        extra = []
        for n in (4096, 65536):
            if part == "forward":    # q, k, v (put) or the output and lse (attend), the ticket
                whole = n * 16 * (192 + 192 + 128) * 2 + 8
            else:                    # dq, dk, dv (take), the ticket
                whole = n * 16 * (192 + 192 + 128) * 2 + 8
            extra.append(int(bound.xreplace({**values, sym.N: n, ca.L_seq_sym: 4 * n})) - whole)
        assert extra[0] == extra[1] > 0, (part, extra)


def test_refusals():
    from boundpass.runtime.seq_to_head_tiles import check_tiles_heads, seq_to_head_tiles
    with pytest.raises(BoundpassInputError, match="multiples of W"):
        check_tiles_heads(8, 2, 4)
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(BoundpassInputError, match="share a dtype"):
        seq_to_head_tiles(q, q.double(), q)
    with pytest.raises(BoundpassInputError, match="chunk"):
        seq_to_head_tiles(q, q, q, chunk=0)
