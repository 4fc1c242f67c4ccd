"""Time models of the rewritten ops against their knobs, and the knee the planner stops at.

The planner (``boundpass/planning/planner.py``) gives a knob the *knee* of its time curve, the smallest value whose
modelled time is within ``KNEE_TOLERANCE`` of the best, and goes narrower only when the budget requires it;
it never grows a knob past the knee because the budget happens to allow it (issue 18, docs/knobs.md).

Ring-DTP strip width C. One forward + backward of the op folds ``P * ceil(V_max / C)`` strips of ``n`` tokens
(``n = N`` in the weights branch, ``N_max`` in the activations branch; ``V_max = ceil(V / P)``). Per strip of
width ``w = min(C, V_max)``:

  time = 8 n w H / flops                         four matmuls: forward fold, backward recompute, dh, dW
       + STRIP_PASSES n w b_acc / bw(n w b_acc)   elementwise passes over the [n, w] strip (max, exp, sum, ...)
       + TOKEN_BYTES(n, H) / bw(n H b_acc)       h re-read by the three h-matmuls, dh read + written, per-token
                                                  vectors (max, sum, target, index, mask)
       + LAUNCHES_PER_STRIP * launch_s            ops issued per strip (forward ~14, backward ~14)

with ``bw(s) = cache_bandwidth`` while a strip of ``s`` bytes fits ``cache_bytes``, else ``bandwidth``. The
FLOPs and the strip's passes do not depend on C (they add up to the same [N, V] work); what does is the
per-strip cost (launches, the token-side bytes), which favours wide strips, and the cache, which favours
strips that fit it. The ring transfers do not depend on C and are left out.

Constants: ``DEVICE_COSTS`` holds one ``DeviceCosts`` per device type, in one place. The CPU figures were
fitted to ``bench/vocab.py``'s measured curve on the 2-core development machine (docs/results/vocab.md,
"strip width C"); the CUDA figures are an H200's datasheet figures with an eager-PyTorch launch cost, not yet
measured. A GPU run recalibrates them: ``bench/calibrate_costs.py`` (run by ``bench/gpu_check.sh``) times the
op at several C on the device, fits ``launch_s`` and the streaming rates with ``calibrate(points, ...)`` and
writes ``{"cuda": {"launch_s": ..., ...}}`` to ``$OUT/costs.json``; ``BOUNDPASS_COSTS=<that file>`` makes
``costs_for`` read it over the defaults.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, replace

KNEE_TOLERANCE = 0.05      # the knee: the smallest value whose modelled time is within 5% of the best
STRIP_PASSES = 16          # elementwise passes over a strip in forward + backward (reads and writes)
LAUNCHES_PER_STRIP = 28    # ops issued per strip, forward + backward (runtime/ring_dtp.py's _fold/_grad_strip)
TOKEN_VECTORS = 20         # per-token accumulator-dtype words touched per strip (max, sum, target, idx, mask...)


@dataclass(frozen=True)
class DeviceCosts:
    """What one device does per second, and what one op launch costs."""
    name: str
    flops: float             # sustained matmul FLOP/s in the accumulation dtype
    bandwidth: float         # bytes/s from main memory (DRAM, HBM)
    cache_bandwidth: float   # bytes/s for a working set that fits ``cache_bytes``
    cache_bytes: int         # the cache a strip should fit (L2 per core on CPU, L2 on a GPU)
    launch_s: float          # seconds per op issued (Python dispatch + kernel launch)
    # host <-> device bytes/s each way (pinned copies over PCIe / NVLink-C2C; on a CPU "device" a memcpy of the
    # host state from memory: the two are one memory), and whether the copies run beside the compute (CUDA
    # streams; False: program order, nothing overlaps)
    link_bandwidth: float = 0.0
    overlap: bool = False
    # expert-parallel all-to-alls (PipelinedLLEP's dispatch cap c): seconds per all-to-all beyond its bytes
    # (latency, the collective's set-up), and bytes/s one rank sends (and receives) in one; 0: not modelled
    collective_s: float = 0.0
    alltoall_bandwidth: float = 0.0


DEVICE_COSTS = {
    # fitted to the measured curve of bench/vocab.py on this 2-core Xeon (1 thread; docs/results/vocab.md)
    # (one thread, N = 4,096, H = 128, V = 65,536 fp32: 2.7 s at C <= 1,024, 4.4-5.3 s at C >= 2,048). The
    # "cache" here is where strips stop being recycled: a strip of 32 MiB or more is a fresh mmap each time
    # (glibc's mmap threshold tops out at 32 MiB) and page-faults through every pass, so cache_bytes = 16 MiB.
    "cpu": DeviceCosts("cpu", flops=120e9, bandwidth=6.5e9, cache_bandwidth=43e9, cache_bytes=16 * 2 ** 20,
                       launch_s=15e-6, link_bandwidth=6.5e9, overlap=False,
                       # all-to-all latency per peer and rate: gloo over loopback, 2 and 4 ranks on the 2 cores,
                       # fitted by calibrate_dispatch to the c curves of `bench/dispatch.py --knee-only`
                       # (docs/results/dispatch_knee.md, docs/knobs.md)
                       collective_s=2.37e-4, alltoall_bandwidth=7.5e8),
    # H200 datasheet (fp32 without TF32, HBM3e, 50 MiB L2), eager launch ~8 us: not measured (no GPU run yet)
    # link: PCIe Gen5 x16 pinned copies, ~50 GB/s each way concurrently (datasheet 64 GB/s): not measured;
    # bench/gpu_optimizer.py (run by bench/gpu_check.sh) measures it and writes it to costs.json
    "cuda": DeviceCosts("cuda", flops=60e12, bandwidth=4.0e12, cache_bandwidth=10e12, cache_bytes=50 * 2 ** 20,
                        launch_s=8e-6, link_bandwidth=50e9, overlap=True,
                        # NCCL inside an NVLink node: ~30 us per all-to-all, ~150 GB/s per rank: not measured
                        # (bench/gpu_dispatch.py measures the curve; calibrate_dispatch fits these two to it)
                        collective_s=3e-5, alltoall_bandwidth=150e9),
}


def costs_for(device_type: str = "cpu") -> DeviceCosts:
    """The constants for a device type, with any recalibrated figures from ``$BOUNDPASS_COSTS`` (JSON) applied."""
    base = DEVICE_COSTS.get(device_type, DEVICE_COSTS["cpu"])
    path = os.environ.get("BOUNDPASS_COSTS")
    if path and os.path.exists(path):
        with open(path) as f:
            override = json.load(f).get(device_type, {})
        base = replace(base, **{k: v for k, v in override.items() if k in asdict(base) and k != "name"})
    return base


# ------------------------------------------------------------------------------------------- Ring-DTP
def ring_dtp_strips(C: int, *, V: int, P: int = 1) -> int:
    """Strips folded in one forward (and again in one backward) of the op at strip width C."""
    v_max = -(-V // P)
    return P * -(-v_max // max(1, min(C, v_max)))


def ring_dtp_seconds(C: int, *, N: int, H: int, V: int, P: int = 1, b: int = 4, b_acc: int = 4,
                     costs: DeviceCosts | None = None) -> float:
    """Modelled seconds of one Ring-DTP forward + backward at strip width C (see the module docstring)."""
    costs = costs or DEVICE_COSTS["cpu"]
    v_max = -(-V // P)
    w = max(1, min(C, v_max))
    strips = ring_dtp_strips(C, V=V, P=P)
    strip_bytes = N * w * b_acc
    bw = costs.cache_bandwidth if strip_bytes <= costs.cache_bytes else costs.bandwidth
    # the last strip of a shard may be narrower; the work is the shard's, the per-strip costs the strips'
    work = P * v_max * N
    seconds = 8 * work * H / costs.flops + STRIP_PASSES * work * b_acc / bw
    token_bytes = 3 * N * H * b + 2 * N * H * b_acc + TOKEN_VECTORS * N * b_acc
    token_bw = costs.cache_bandwidth if N * H * b_acc <= costs.cache_bytes else costs.bandwidth   # h, dh resident
    return seconds + strips * (token_bytes / token_bw + LAUNCHES_PER_STRIP * costs.launch_s)


def candidates(lo: int, hi: int) -> list[int]:
    """Values the knee is looked for among: powers of two from lo to hi, and hi itself (the whole shard)."""
    out, v = [], 1 << max(0, (lo - 1).bit_length())
    out.append(lo)
    while v < hi:
        if v > lo:
            out.append(v)
        v *= 2
    out.append(hi)
    return sorted(set(out))


def knee(times: dict[int, float], tolerance: float = KNEE_TOLERANCE) -> int:
    """The smallest value whose time is within ``tolerance`` of the best time in ``times`` {value: seconds}."""
    best = min(times.values())
    return min(v for v, t in times.items() if t <= (1 + tolerance) * best)


def ring_dtp_knee(*, lo: int, hi: int, N: int, H: int, V: int, P: int = 1, b: int = 4, b_acc: int = 4,
                  costs: DeviceCosts | None = None, tolerance: float = KNEE_TOLERANCE) -> int:
    """The knee of the modelled Ring-DTP time over strip widths lo..hi."""
    times = {C: ring_dtp_seconds(C, N=N, H=H, V=V, P=P, b=b, b_acc=b_acc, costs=costs) for C in candidates(lo, hi)}
    return knee(times, tolerance)


def calibrate(points: dict[int, float], *, N: int, H: int, V: int, P: int = 1, b: int = 4, b_acc: int = 4,
              base: DeviceCosts | None = None) -> DeviceCosts:
    """Fit ``launch_s`` and the streaming rate to measured {C: seconds} of one forward + backward.

    The measured time is read as ``t(C) = t0 + strips(C) * k``, a least-squares line: k, the per-strip cost
    less its token-side bytes, sets ``launch_s``; t0, the strip-independent time less the FLOPs (the matmul
    work does not depend on C, so the curve cannot separate it from streaming: ``flops`` is kept), sets the
    streaming rate of the regime the points' strips are in (``bandwidth`` when they miss ``cache_bytes``,
    ``cache_bandwidth`` when they fit). Give points of one regime; fit each regime separately.
    """
    base = base or DEVICE_COSTS["cpu"]
    xs = [ring_dtp_strips(C, V=V, P=P) for C in points]
    ys = list(points.values())
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    k = max(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0, 0.0)
    t0 = my - k * mx
    token_bytes = 3 * N * H * b + 2 * N * H * b_acc + TOKEN_VECTORS * N * b_acc
    token_bw = base.cache_bandwidth if N * H * b_acc <= base.cache_bytes else base.bandwidth
    launch_s = max(k - token_bytes / token_bw, 0.0) / LAUNCHES_PER_STRIP
    work = P * -(-V // P) * N
    stream = t0 - 8 * work * H / base.flops
    v_max = -(-V // P)
    in_cache = all(N * min(C, v_max) * b_acc <= base.cache_bytes for C in points)
    out = replace(base, launch_s=launch_s)
    if stream > 0:
        rate = STRIP_PASSES * work * b_acc / stream
        out = replace(out, **({"cache_bandwidth": rate} if in_cache else {"bandwidth": rate}))
    return out


def describe(costs: DeviceCosts) -> str:
    """One line of the constants (for explain and the bench)."""
    return (f"{costs.name}: {costs.flops / 1e9:.0f} GFLOP/s, {costs.bandwidth / 1e9:.0f} GB/s memory, "
            f"{costs.cache_bandwidth / 1e9:.0f} GB/s under {costs.cache_bytes / 2 ** 20:.0f} MiB cache, "
            f"{costs.launch_s * 1e6:.1f} us per launch; knee tolerance {KNEE_TOLERANCE:.0%}")



# ------------------------------------------------------------------------------------- PipelinedLLEP
# The dispatch cap c (tokens per source per chunk). One forward + backward of the op on a rank moves its N k
# routes in K = ceil(N_max / c) chunks; per chunk: two all-to-alls in forward (dispatch, combine) and two in
# backward, a fixed set of ops (gathers, splits, the block permutation, index_add / index_copy), and one matmul
# chain per expert block (a chunk's rows of one expert, across sources, at most c rows: about e ceil(k / e)
# blocks per chunk when routing is balanced, e = E / E_p local experts). The matmul FLOPs do not depend on c; the
# per-chunk and per-block costs favour wide chunks, chunk buffers that outgrow the cache pay memory rate on every
# pass over the rows, and the transfer time the pipeline cannot hide (1/K of it) favours several chunks over one.
# The device's all-to-all latency and rate (DeviceCosts.collective_s, .alltoall_bandwidth) are fitted to measured
# curves by calibrate_dispatch (CPU: `bench/dispatch.py --knee-only`; CUDA: bench/gpu_dispatch.py).
DISPATCH_MATMULS = 11             # per route: 3 forward + 8 backward [., H] x [H, I] products (y not recomputed)
DISPATCH_COLLECTIVES = 4          # all-to-alls per chunk, forward + backward
DISPATCH_CHUNK_LAUNCHES = 30      # ops per chunk outside the blocks
DISPATCH_BLOCK_LAUNCHES = 40      # ops per expert block, forward (~8) + backward (~32)
DISPATCH_STREAM_PASSES = 24       # gathers, copies and adds that touch a route's [H] row, forward + backward
DISPATCH_BUFFER_ROWS = 2          # the largest buffer a chunk allocates, in [c k, H] rows: the backward's packed
                                  # receive (x and grad rows, ~ c k each under balanced routing). Past cache_bytes
                                  # it streams at memory rate (on the CPU: a fresh mmap that page-faults, as
                                  # Ring-DTP's strips); the buffers together stay in the cache's regime at the
                                  # bench shape (measured: no step in the curve up to c = 1,024, 8 MiB buffers)
DISPATCH_FIT_WINDOW = 1.5         # calibrate_dispatch fits the points within 1.5x of their curve's best
DISPATCH_TRANSFER_ROWS = 5        # route rows a rank sends per forward + backward: x out, y back; x and grad out
                                  # (packed), dx back


def pipelined_llep_chunks(c: int, *, N: int) -> int:
    return max(1, -(-N // max(1, c)))


def pipelined_llep_seconds(c: int, *, N: int, H: int, I: int, E: int, E_p: int, k: int, b: int = 4,
                           costs: DeviceCosts | None = None) -> float:
    """Modelled seconds of one PipelinedLLEP forward + backward on a rank at chunk cap c (balanced routing).

    The all-to-all bytes do not depend on c, but what the pipeline cannot hide does: chunk j+1's dispatch and
    chunk j-1's combine run beside chunk j's experts, so only the first chunk's dispatch and the last chunk's
    combine (per pass) wait in the open, 1/K of the transfer time. One chunk (c = N) hides nothing; many chunks
    pay their per-chunk latency and ops. That is why the curve has its best at a few chunks, not at one."""
    costs = costs or DEVICE_COSTS["cpu"]
    c = max(1, min(c, N))
    K = pipelined_llep_chunks(c, N=N)
    e = max(1, E // max(1, E_p))
    routes = N * k
    seconds = DISPATCH_MATMULS * 2 * routes * H * I / costs.flops
    buffer = DISPATCH_BUFFER_ROWS * c * k * H * b
    bw = costs.cache_bandwidth if buffer <= costs.cache_bytes else costs.bandwidth
    seconds += DISPATCH_STREAM_PASSES * routes * H * b / bw
    if E_p > 1 and costs.alltoall_bandwidth > 0:
        seconds += DISPATCH_TRANSFER_ROWS * routes * H * b / costs.alltoall_bandwidth / K
    blocks = K * e * -(-k // e)
    # an all-to-all's fixed cost grows with its peers (gloo sends to each; NCCL's set-up per peer)
    peers = max(0, E_p - 1)
    return (seconds + K * (DISPATCH_COLLECTIVES * peers * costs.collective_s + DISPATCH_CHUNK_LAUNCHES * costs.launch_s)
            + blocks * DISPATCH_BLOCK_LAUNCHES * costs.launch_s)


def pipelined_llep_knee(*, lo: int, hi: int, N: int, H: int, I: int, E: int, E_p: int, k: int, b: int = 4,
                        costs: DeviceCosts | None = None, tolerance: float = KNEE_TOLERANCE) -> int:
    """The knee of the modelled PipelinedLLEP time over chunk caps lo..hi."""
    times = {c: pipelined_llep_seconds(c, N=N, H=H, I=I, E=E, E_p=E_p, k=k, b=b, costs=costs)
             for c in candidates(lo, hi)}
    return knee(times, tolerance)


def calibrate_dispatch(curves: list[tuple[int, dict[int, float]]], *, N: int, H: int, I: int, E: int, k: int,
                       b: int = 4, base: DeviceCosts | None = None, window: float = DISPATCH_FIT_WINDOW) -> DeviceCosts:
    """Fit ``collective_s`` and ``alltoall_bandwidth`` to measured PipelinedLLEP curves [(E_p, {c: seconds})].

    Least squares on log time over the points within ``window`` x their curve's best (the part the knee is read
    from: the steep narrow end, where per-chunk costs dominate, says nothing about where the curve flattens and
    would outweigh it in a log fit), each curve with a free scale of its own (the run's load, and 4 ranks sharing
    2 cores, change every point of a curve alike: the fit reads the curve's shape, which is what sets the knee),
    over a log grid of both figures (latency 1 us .. 10 ms per peer, rate 10 MB/s .. 1 TB/s); the FLOP and memory
    rates are the Ring-DTP fit's and stay.
    """
    base = base or DEVICE_COSTS["cpu"]
    grid_s = [10 ** (x / 8) for x in range(-48, -15)]          # 1e-6 .. 1e-2 s
    grid_bw = [10 ** (x / 8) for x in range(56, 97)]           # 1e7 .. 1e12 B/s
    near = [(E_p, {c: t for c, t in points.items() if t <= window * min(points.values())}) for E_p, points in curves]

    def loss(costs):
        total = 0.0
        for E_p, points in near:
            res = [math.log(t) - math.log(pipelined_llep_seconds(c, N=N, H=H, I=I, E=E, E_p=E_p, k=k, b=b,
                                                                 costs=costs)) for c, t in points.items()]
            mean = sum(res) / len(res)
            total += sum((r - mean) ** 2 for r in res)
        return total

    fits = ((loss(replace(base, collective_s=s, alltoall_bandwidth=bw)), s, bw) for s in grid_s for bw in grid_bw)
    _, s, bw = min(fits)
    return replace(base, collective_s=s, alltoall_bandwidth=bw)


# --------------------------------------------------------------------------------- OffloadStreamAdamW
# The bucket β (elements per bucket) and the staging slots S of runtime/offload_adamw.py. One step walks Θ
# elements in nb = ceil(Θ / β) buckets; per bucket (docs/offload_adamw.md, "Schedule"):
#   H2D     fp32 master, exp_avg, exp_avg_sq host -> slot              OPT_LINK_BYTES per element over the link
#   update  grads into the slot (upcast), eight AdamW ops on the slot, params refreshed from the master:
#           OPT_SLOT_BYTES per element in the slot (at cache rate while a slot's 16 β bytes fit cache_bytes),
#           OPT_WORKING_BYTES · b per element of working grads / weights in device memory
#   D2H     master and moments slot -> host                              OPT_LINK_BYTES per element
# and a fixed cost per bucket, OPT_BUCKET_LAUNCHES ops (3 + 3 copies, one segment's 8 update ops, events), plus
# OPT_TENSOR_LAUNCHES per parameter tensor (its grad copy and weight refresh; a tensor split across buckets
# adds one piece per cut, counted in the bucket's ops). The bytes do not depend on β; the per-bucket ops favour
# wide buckets, the cache favours slots that fit it, and on a device that overlaps (CUDA streams) the pipeline's
# fill and drain — the first bucket's H2D and update and the last one's update and D2H are not hidden — favour
# narrow ones. With S slots the steady state moves one bucket per max((h + u + d) / S, h, u, d): S = 1 cannot
# overlap (each slot's three stages run back to back), S = 2 hides the copies behind the update, S = 3 lets the
# three stages of three buckets run at once. On a device without overlap (the CPU: program order) S only costs
# memory, and the step is nb (h + u + d).
OPT_LINK_BYTES = 12          # bytes per element each way: fp32 master, exp_avg, exp_avg_sq (3 x 4)
OPT_SLOT_BYTES = 112         # slot bytes per element: H2D writes 12, grad upcast writes 4, the eight update ops
                             # read + write 80 (mul_ 8, lerp_ 12, mul_ 8, addcmul_ 12, sqrt 8, div_ 8, add_ 8,
                             # addcdiv_ 16), the weight refresh reads 4, D2H reads 12
OPT_WORKING_BYTES = 2        # x b per element: the working grad read, the working weight written
OPT_BUCKET_LAUNCHES = 16     # ops per bucket: 3 H2D + 3 D2H copies, 8 update ops (one segment), 2 event waits
OPT_TENSOR_LAUNCHES = 2      # ops per parameter tensor: its grad copy into the slot, its weight refresh
OPT_MIN_BUCKET = 1 << 10     # the narrowest bucket the knee is looked for at (below it: ops, not bytes)
OPT_MAX_SLOTS = 4            # slots the knee is looked for among (1..4)


def offload_adamw_seconds(beta: int, S: int = 2, *, Theta: int, tensors: int = 1, b: int = 4,
                          costs: DeviceCosts | None = None) -> float:
    """Modelled seconds of one OffloadStreamAdamW step at bucket β and S slots (see the comment above)."""
    costs = costs or DEVICE_COSTS["cpu"]
    Theta = max(1, Theta)
    beta = max(1, min(beta, Theta))
    nb = -(-Theta // beta)
    per = Theta / nb                                     # elements of an average bucket
    link = costs.link_bandwidth or costs.bandwidth
    slot_bw = costs.cache_bandwidth if 16 * beta <= costs.cache_bytes else costs.bandwidth
    h = OPT_LINK_BYTES * per / link
    u = OPT_SLOT_BYTES * per / slot_bw + OPT_WORKING_BYTES * b * per / costs.bandwidth
    d = OPT_LINK_BYTES * per / link
    issue = (nb * OPT_BUCKET_LAUNCHES + tensors * OPT_TENSOR_LAUNCHES) * costs.launch_s
    if not costs.overlap:
        return nb * (h + u + d) + issue
    S = max(1, min(S, nb))
    device = (h + u + d) + (nb - 1) * max((h + u + d) / S, h, u, d)
    return max(device, issue)                            # the host issues ahead of the device (asynchronous)


def offload_adamw_knee(*, Theta: int, tensors: int = 1, b: int = 4, costs: DeviceCosts | None = None,
                       lo: int | None = None, hi: int | None = None, beta: int | None = None,
                       S: int | None = None, tolerance: float = KNEE_TOLERANCE) -> tuple[int, int]:
    """(β, S) at the knee: the least staging S·β whose modelled step is within ``tolerance`` of the best.

    β over powers of two from ``lo`` (OPT_MIN_BUCKET) to ``hi`` (default Θ) and hi; S over 1..OPT_MAX_SLOTS.
    A given ``beta`` or ``S`` (the user's) is held fixed and only the other is searched. Ties in staging go
    to fewer slots.
    """
    hi = max(1, min(hi or Theta, Theta))
    lo = max(1, min(lo or OPT_MIN_BUCKET, hi))
    betas = [beta] if beta is not None else candidates(lo, hi)
    slots = [S] if S is not None else list(range(1, OPT_MAX_SLOTS + 1))
    times = {(bb, s): offload_adamw_seconds(bb, s, Theta=Theta, tensors=tensors, b=b, costs=costs)
             for bb in betas for s in slots}
    best = min(times.values())
    near = [key for key, t in times.items() if t <= (1 + tolerance) * best]
    return min(near, key=lambda key: (min(key[0], Theta) * key[1], key[1], key[0]))


def calibrate_optimizer(points: dict[int, float], *, Theta: int, tensors: int = 1, b: int = 4, S: int = 1,
                        base: DeviceCosts | None = None, link_bandwidth: float | None = None) -> DeviceCosts:
    """Fit the optimizer's constants to measured {β: seconds} of OffloadStreamAdamW steps at S slots.

    ``link_bandwidth`` (a measured copy rate, bytes/s each way) is taken as given. The curve is read as
    ``t(β) = t0 + nb(β) * k`` (least squares over the points): on a device without overlap k, the per-bucket
    cost, sets ``launch_s`` (k / OPT_BUCKET_LAUNCHES) and t0, less the link and working-memory bytes, the slot
    rate of the regime the points' slots are in (``cache_bandwidth`` while 16 β fits ``cache_bytes``, else
    ``bandwidth``: give points of one regime). On an overlapping device only ``link_bandwidth`` is set: the
    pipelined curve's shape is left to the model.
    """
    base = base or DEVICE_COSTS["cpu"]
    out = replace(base, link_bandwidth=link_bandwidth) if link_bandwidth else base
    if out.overlap or len(points) < 2:
        return out
    xs = [-(-Theta // max(1, min(beta, Theta))) for beta in points]
    ys = list(points.values())
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    k = max(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0, 0.0)
    t0 = my - k * mx - tensors * OPT_TENSOR_LAUNCHES * out.launch_s
    out = replace(out, launch_s=k / OPT_BUCKET_LAUNCHES)
    link = out.link_bandwidth or out.bandwidth
    stream = t0 - 2 * OPT_LINK_BYTES * Theta / link - OPT_WORKING_BYTES * b * Theta / out.bandwidth
    if stream > 0:
        rate = OPT_SLOT_BYTES * Theta / stream
        in_cache = all(16 * min(beta, Theta) <= out.cache_bytes for beta in points)
        out = replace(out, **({"cache_bandwidth": rate} if in_cache else {"bandwidth": rate}))
    return out


# ------------------------------------------------------------------------------------------------ SCO
# How many checkpoint boundaries SCO offloads (L_off, a forward prefix; boundpass/passes/sco_pass.py,
# runtime/sco.py). An offloaded boundary of B bytes is copied to the host in forward, beside the next block's
# forward (a window of ``forward_s``), and prefetched back in backward beside the later block's recompute +
# backward (``backward_s``); the deepest offloaded boundary has no prefetch ahead of it, so its reload is not
# hidden at all. Per boundary SCO_LAUNCHES ops are issued (offload, reload, done; the copies' events). So
#   t(L_off) = t(0) + [L_off > 0] B / link
#                   + L_off (SCO_LAUNCHES launch_s + max(0, B / link - forward_s) + max(0, B / link - backward_s))
# on a device that overlaps copies with compute (CUDA streams; the CPU runtime's one-thread worker shares the
# cores with the compute, so there ``overlap`` is False and every transfer costs its time). Offloading never
# makes the step faster: t is increasing in L_off, the knee is 0 (the fewest), and the planner offloads more only
# when the budget requires it (docs/knobs.md).
SCO_LAUNCHES = 6


def sco_seconds(offloaded: int, *, boundary_bytes: int, forward_s: float = 0.0, backward_s: float = 0.0,
                costs: DeviceCosts | None = None) -> float:
    """Modelled seconds SCO adds to a step when ``offloaded`` boundaries of ``boundary_bytes`` are offloaded."""
    costs = costs or DEVICE_COSTS["cpu"]
    if offloaded <= 0:
        return 0.0
    move = boundary_bytes / (costs.link_bandwidth or costs.bandwidth)
    hidden_f = forward_s if costs.overlap else 0.0
    hidden_b = backward_s if costs.overlap else 0.0
    per = SCO_LAUNCHES * costs.launch_s + max(0.0, move - hidden_f) + max(0.0, move - hidden_b)
    return move + offloaded * per


def sco_knee(most: int, *, boundary_bytes: int, forward_s: float = 0.0, backward_s: float = 0.0,
             costs: DeviceCosts | None = None, tolerance: float = KNEE_TOLERANCE) -> int:
    """The fewest boundaries whose modelled cost is within ``tolerance`` of the best count's over 0..most: 0."""
    times = {n: sco_seconds(n, boundary_bytes=boundary_bytes, forward_s=forward_s, backward_s=backward_s,
                            costs=costs) for n in range(0, max(0, most) + 1)}
    best = min(times.values())
    return min(n for n, t in times.items() if t <= best + tolerance * best)


# ------------------------------------------------------------------------------------ chunked attention
# The tile C_s (query rows x key rows) of boundpass::chunked_attention. One forward + backward visits, per batch row
# and query head, T (T + 1) / 2 tiles when causal (T^2 otherwise), T = ceil(L / C_s). Per tile of width w = min(C_s, L):
# the matmuls 2 w^2 (4 D + 3 D_v) FLOPs (forward QK^T, PV; backward QK^T again, dV, dP, dQ, dK), about
# ATTENTION_PASSES elementwise passes over the [w, w] scores (mask, max, exp, sums; dS), and ATTENTION_LAUNCHES ops
# issued (both loops of runtime/chunked_attention.py). Narrow tiles pay launches; wide causal tiles compute the
# masked half of the diagonal tiles for nothing (the tiles' area is L^2 / 2 + L C_s / 2).
ATTENTION_PASSES = 12
ATTENTION_LAUNCHES = 34
# The sublayer in query blocks with a kv program (boundpass::attention_blocks: the forward, then the backward's
# query-outer pass with o recomputed and its key-outer pass): the same tiles, visited more often, each visit issuing
# more small ops (host tiles fetched, tiles padded for the fused kernel, the tile math). Fitted by least squares on
# relative error to the op's measured forward + backward at torchtitan's MLA shape (16 heads, D 192, D_v 128, bf16,
# k and v on the host) over L = 2,048-8,192 and C_s = 64-1,024 (``bench/attention_knee.py``,
# docs/results/attention_knee.md; within 16% of every point): 1.25x the op's FLOPs, 7 passes over a tile's scores,
# ~240 ops per tile, the scores out of cache once two tiles outgrow it. Its knee is the measured one at every length
# there (256).
BLOCKS_FLOPS = 1.25
BLOCKS_PASSES = 7
BLOCKS_LAUNCHES = 240
BLOCKS_WORKING_TILES = 2


def chunked_attention_seconds(C: int, *, B: int, L: int, A_q: int, D: int, D_v: int, causal: bool = True,
                              b_acc: int = 4, costs: DeviceCosts | None = None, blocks: bool = False) -> float:
    """Modelled seconds of one chunked-attention forward + backward at tile C_s = C (``blocks``: the sublayer in
    query blocks with a kv program, boundpass::attention_blocks)."""
    costs = costs or DEVICE_COSTS["cpu"]
    w = max(1, min(C, L))
    t = -(-L // w)
    tiles = t * (t + 1) // 2 if causal else t * t
    tile_bytes = B * A_q * w * w * b_acc
    flops_x, passes, launches, working = (BLOCKS_FLOPS, BLOCKS_PASSES, BLOCKS_LAUNCHES, BLOCKS_WORKING_TILES) \
        if blocks else (1.0, ATTENTION_PASSES, ATTENTION_LAUNCHES, 1)
    bw = costs.cache_bandwidth if working * tile_bytes <= costs.cache_bytes else costs.bandwidth
    flops = 2 * B * A_q * w * w * (4 * D + 3 * D_v) * flops_x
    return tiles * (flops / costs.flops + passes * tile_bytes / bw + launches * costs.launch_s)


def chunked_attention_knee(*, lo: int, hi: int, B: int, L: int, A_q: int, D: int, D_v: int, causal: bool = True,
                           b_acc: int = 4, costs: DeviceCosts | None = None,
                           tolerance: float = KNEE_TOLERANCE, blocks: bool = False) -> int:
    """The knee of the modelled chunked-attention time over tiles lo..hi."""
    times = {C: chunked_attention_seconds(C, B=B, L=L, A_q=A_q, D=D, D_v=D_v, causal=causal, b_acc=b_acc,
                                          costs=costs, blocks=blocks) for C in candidates(lo, hi)}
    return knee(times, tolerance)


# ------------------------------------------------------------------------------------------- row blocks
# The rows per block C_r of boundpass::row_blocks (a feed-forward walked along the sequence). One forward + backward
# runs the program three times on every row (forward, the backward's recompute, its vjp at twice the forward's
# FLOPs: 4 f FLOPs per row for f the forward's) whatever C_r is, and issues its ops once per block in each pass
# (ROW_BLOCK_PASSES x the program's nodes: forward, recompute, and about two ops per node in the vjp). Narrow blocks
# pay launches; beyond the knee a wider block only holds more rows.
ROW_BLOCK_PASSES = 4


def row_blocks_seconds(C: int, *, L: int, flops_per_row: float, ops: int,
                       costs: DeviceCosts | None = None, bytes_per_row: float = 0.0) -> float:
    """Modelled seconds of one row-blocks forward + backward at C_r = C rows per block: the matmuls' flops, the
    elementwise ops' memory traffic (``bytes_per_row``: a norm alone, which has no matmul), the launches."""
    costs = costs or DEVICE_COSTS["cpu"]
    blocks = -(-L // max(1, min(C, L)))
    work = 4 * L * (flops_per_row / costs.flops + bytes_per_row / costs.bandwidth)
    return work + blocks * ROW_BLOCK_PASSES * ops * costs.launch_s


def row_blocks_knee(*, lo: int, hi: int, L: int, flops_per_row: float, ops: int, costs: DeviceCosts | None = None,
                    tolerance: float = KNEE_TOLERANCE, bytes_per_row: float = 0.0) -> int:
    """The knee of the modelled row-blocks time over lo..hi rows per block."""
    times = {C: row_blocks_seconds(C, L=L, flops_per_row=flops_per_row, ops=ops, costs=costs,
                                   bytes_per_row=bytes_per_row)
             for C in candidates(lo, hi)}
    return knee(times, tolerance)
