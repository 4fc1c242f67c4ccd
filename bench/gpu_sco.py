"""SCO on one GPU: real device peak (torch.cuda.max_memory_allocated) and step time vs the host budget.

Model: torchtitan's deepseek_v3 debug MoE (FullAC on model.layers, SDPA attention, fp32, batch 1) at a long
sequence when torchtitan is importable; otherwise a torch-only stand-in with the same checkpoint structure
(L checkpoint_wrapper'd pre-norm residual MLP blocks, bf16) — the JSON names which one ran.
Variants, each a fresh copy of the same weights, on the same tokens:
  - no SCO;
  - eager SCO runtime (boundpass.runtime.apply_sco) with the host budget at 0 / half / all boundaries;
  - boundpass.compile(..., sco_enable=True) (aot_eager inner compiler) at half / all boundaries;
per variant: peak allocated bytes of one forward+backward above what was allocated before it (parameters and
gradients stay allocated between steps), the median step time of REPEATS steps (CUDA-synchronised wall
clock), the SCO ledger's device-boundary peak against the sympy bound, bytes offloaded, and the max abs
gradient difference vs no SCO (bit-equal expected: the recomputation reads a bitwise copy; the noise floor of
two no-SCO runs is reported next to it, as MoE scatter kernels may be nondeterministic on CUDA).

    PYTHONPATH=. python3 bench/gpu_sco.py            # needs CUDA; exits 2 with a message if there is none
    PYTHONPATH=. python3 bench/gpu_sco.py --dry-run  # tiny shapes on the CPU: checks the script, writes nothing

Writes gpu_sco.json (+ .md) into $OUT if set, else bench/out/, after every measurement (a run cut short keeps
what it measured). Stops starting new measurements after DEADLINE_S (gpu_check.sh shares its minutes).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable for `bench.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from bench.common import (REPO_ROOT, fmt_bytes, fmt_seconds, markdown_table, median_step_seconds, run_metadata,
                          synchronize)
from boundpass.core import symbols as sym
from boundpass.runtime.sco import (apply_sco, bound_values, sco_compiled_device_bound, sco_device_bound,
                                   sco_host_bound)

GPU = dict(seqs=(16_384, 65_536), vocab=2048, stand_in=dict(L=8, H=2048, dtype=torch.bfloat16))
DRY = dict(seqs=(64,), vocab=256, stand_in=dict(L=4, H=32, dtype=torch.float32))
REPEATS = 5
DEADLINE_S = 100


# ------------------------------------------------------------------------------------------ models
class _Block(torch.nn.Module):
    """Pre-norm residual MLP: its input is the checkpoint boundary, as in a transformer block."""

    def __init__(self, H, dtype):
        super().__init__()
        self.norm = torch.nn.RMSNorm(H, dtype=dtype)
        self.up = torch.nn.Linear(H, 4 * H, bias=False, dtype=dtype)
        self.down = torch.nn.Linear(4 * H, H, bias=False, dtype=dtype)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class StandIn(torch.nn.Module):
    def __init__(self, L, H, dtype, vocab):
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(vocab, H, dtype=dtype)
        self.layers = torch.nn.ModuleList(checkpoint_wrapper(_Block(H, dtype)) for _ in range(L))

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return h


def build_model(seq: int, vocab: int, stand_in: dict, device: torch.device):
    """(model, description, bytes per boundary element). torchtitan when importable, else the stand-in."""
    try:
        from torchtitan.distributed.activation_checkpoint import FullAC

        from boundpass.recipes.models import build_debug_moe
        model = build_debug_moe("deepseek_v3", vocab_size=vocab, seq_len=seq)
        FullAC(FullAC.Config()).apply(model)
        name = "torchtitan deepseek_v3 debug MoE, fp32, FullAC on model.layers, SDPA"
    except ImportError as exc:
        torch.manual_seed(0)
        model = StandIn(stand_in["L"], stand_in["H"], stand_in["dtype"], vocab)
        name = (f"stand-in (torchtitan not importable: {exc.name}): {stand_in['L']} checkpointed pre-norm MLP "
                f"blocks, H={stand_in['H']}, {stand_in['dtype']}")
    return model.to(device), name, next(model.parameters()).element_size()


def loss_of(out, labels=None):
    return out.float().pow(2).mean()


# ---------------------------------------------------------------------------------------- measuring
def measure(step, model, device, repeats) -> dict:
    """Peak bytes above the resident state for one step, median step seconds, and the final grads."""
    step()  # warm-up (compiles, allocates gradients and the host pool)
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    step()
    synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else None
    return dict(step_peak_bytes=peak, median_s=median_step_seconds(step, device, repeats),
                grads=[p.grad.detach().clone() for p in model.parameters() if p.grad is not None])


def _max_diff(a, b) -> float:
    return max(((x.double() - y.double()).abs().max().item() for x, y in zip(a, b)), default=0.0)


def run_seq(seq, vocab, stand_in, device, repeats, deadline) -> dict:
    import boundpass
    base, name, elem = build_model(seq, vocab, stand_in, device)
    L, H = len(base.layers), base.tok_embeddings.embedding_dim
    boundary = seq * H * elem
    tokens = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(0)).to(device)
    out = dict(model=name, seq=seq, layers=L, hidden=H, boundary_bytes=boundary, rows=[])

    def plain(model):
        def step():
            model.zero_grad(set_to_none=False)
            loss_of(model(tokens)).backward()
        return step

    reference = measure(plain(base), base, device, repeats)
    noise = measure(plain(base), base, device, 1)
    ref_grads = reference.pop("grads")
    out["noise_floor_max_abs"] = _max_diff(noise.pop("grads"), ref_grads)
    out["rows"].append(dict(variant="no SCO", offloaded=0, **reference, ratio=1.0))
    variants = [("eager SCO", k) for k in (0, L // 2, L)] + [("compiled SCO", k) for k in (L // 2, L)]
    for kind, k in variants:
        if time.monotonic() > deadline:
            out["rows"].append(dict(variant=f"{kind}, {k} offloaded", skipped="deadline"))
            continue
        model = copy.deepcopy(base)
        host = max(k * boundary, 1)
        try:
            if kind == "eager SCO":
                handle = apply_sco(model.layers, host)
                step, runtime_of = plain(model), (lambda h=handle: h)
                formula = sco_device_bound()
            else:
                torch._dynamo.reset()
                compiled = boundpass.compile(model, budget="1000GiB", loss_fn=loss_of, host_budget=host,
                                             sco_enable=True)

                def step(compiled=compiled, model=model):
                    model.zero_grad(set_to_none=False)
                    compiled(tokens).backward()
                runtime_of = (lambda c=compiled: c.sco_plans[-1].runtime if c.sco_plans else None)
                formula = sco_compiled_device_bound()

            def logged(step=step, runtime_of=runtime_of):
                runtime = runtime_of()
                if runtime is not None:
                    runtime.events.clear()
                step()
            result = measure(logged, model, device, repeats)
            runtime = runtime_of()
            values = bound_values(N=seq, H=H, b=elem, L=L, host_budget=host)
            row = dict(variant=f"{kind}, {k} offloaded", offloaded=k, host_budget=host,
                       step_peak_bytes=result["step_peak_bytes"], median_s=result["median_s"],
                       ratio=result["median_s"] / reference["median_s"],
                       grad_max_abs_diff=_max_diff(result["grads"], ref_grads),
                       ledger_boundary_peak=runtime.peak_device_boundary_bytes() if runtime else None,
                       device_bound=sym.evaluate(formula, values),
                       offloaded_bytes=runtime.offloaded_bytes() if runtime else 0,
                       host_bound=sym.evaluate(sco_host_bound(), values),
                       restored_live_peak=runtime.peak_restored_live() if runtime else 0)
            if kind == "eager SCO":
                handle.remove()
        except Exception as exc:  # one failing variant must not lose the others
            row = dict(variant=f"{kind}, {k} offloaded", failed=f"{type(exc).__name__}: {exc}"[:500])
        out["rows"].append(row)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def render(data: dict) -> str:
    md = ["# SCO on a GPU (`bench/gpu_sco.py`)", "",
          f"{data['meta'].get('gpu', 'CPU (dry run)')}, torch {data['meta']['torch']}, {data['meta']['date_utc']}. "
          "Peak = torch.cuda.max_memory_allocated during one forward+backward minus what was allocated before "
          "it; time = median CUDA-synchronised wall clock of "
          f"{data['repeats']} steps.", ""]
    for case in data["cases"]:
        md += [f"## {case['model']}, sequence {case['seq']:,} (L={case['layers']}, H={case['hidden']}, "
               f"boundary {fmt_bytes(case['boundary_bytes'])}; grad noise floor {case['noise_floor_max_abs']:.3g})",
               ""]
        rows = []
        for r in case["rows"]:
            if "failed" in r or "skipped" in r:
                rows.append([r["variant"], r.get("failed") or r["skipped"]] + [""] * 6)
                continue
            rows.append([r["variant"], fmt_bytes(r.get("host_budget")) if r.get("host_budget") else "-",
                         fmt_bytes(r["step_peak_bytes"]), fmt_seconds(r["median_s"]), f"{r['ratio']:.3f}×",
                         "-" if "device_bound" not in r else
                         f"{fmt_bytes(r['ledger_boundary_peak'])} / {fmt_bytes(r['device_bound'])}",
                         fmt_bytes(r.get("offloaded_bytes", 0)), f"{r.get('grad_max_abs_diff', 0.0):.3g}"])
        md += [markdown_table(["variant", "host budget", "step peak", "step time", "vs no SCO",
                               "boundary ledger / bound", "offloaded", "grad max |diff|"], rows), ""]
    return "\n".join(md)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, to check the script")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_sco: no CUDA device visible to torch; nothing measured (use --dry-run to check on a CPU)",
              file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    shapes = DRY if args.dry_run else GPU
    meta = run_metadata()
    if device.type == "cuda":
        meta["gpu"], meta["cuda"] = torch.cuda.get_device_name(), torch.version.cuda
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO_ROOT / "bench" / "out"
    data = {"meta": meta, "dry_run": args.dry_run, "repeats": REPEATS if not args.dry_run else 1, "cases": []}
    deadline = time.monotonic() + DEADLINE_S
    for seq in shapes["seqs"]:
        if time.monotonic() > deadline:
            break
        print(f"gpu_sco: sequence {seq}", flush=True)
        data["cases"].append(run_seq(seq, shapes["vocab"], shapes["stand_in"], device, data["repeats"], deadline))
        if not args.dry_run:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "gpu_sco.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    markdown = render(data)
    print(markdown)
    if not args.dry_run:
        (out_dir / "gpu_sco.md").write_text(markdown + "\n")
        print(f"wrote {out_dir / 'gpu_sco.json'}")
    failed = [f"{c['seq']} {r['variant']}" for c in data["cases"] for r in c["rows"] if "failed" in r]
    if failed:
        print("gpu_sco: FAILED: " + ", ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
