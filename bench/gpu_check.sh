#!/usr/bin/env bash
# Every GPU measurement of the project, in one run of under 8 minutes on one GPU:
#   - Ring-DTP at P = 1 vs the standard schedule, the token-chunked (Liger-style) schedule and Inductor
#     (+ auto-chunker): torch.cuda.max_memory_allocated and CUDA-event times (bench/gpu_vocab.py);
#   - OffloadStreamAdamW (bench/gpu_optimizer.py), and its β curve and measured link rate (cost model constants);
#   - SCO checkpoint-boundary offload: device peak and step time vs host budget (bench/gpu_sco.py; it uses
#     torchtitan's debug MoE when importable, else a torch-only stand-in, and says which);
#   - expert dispatch: standard EP vs LLEP vs PipelinedLLEP, peak and time, and the chunk-cap curve
#     (bench/gpu_dispatch.py).
# Runs the package from source with the machine's own python3 and torch; torchtitan is not needed.
# Results: $OUT/ if set, else bench/out/. `bash bench/gpu_check.sh --dry-run` checks it on a CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# a fresh Inductor cache, so the Inductor variants really compile (and the auto-chunker really runs)
TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)"
export TORCHINDUCTOR_CACHE_DIR
trap 'rm -rf "$TORCHINDUCTOR_CACHE_DIR"' EXIT

if [[ "${1:-}" != "--dry-run" ]] && ! python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: no CUDA device visible to torch ($(python3 -c 'import torch; print(torch.__version__)')); nothing measured" >&2
    exit 2
fi
python3 -c 'import torch; print("gpu_check: torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name() if torch.cuda.is_available() else "(no GPU)")'

start=$SECONDS
# gpu_vocab stops starting measurements after 260 s and saves after each shape; the timeout is the backstop
# (budget: 320 s here + 120 s for the optimizer + start-up stays under the 8 minutes)
vocab_rc=0
timeout 320 python3 bench/gpu_vocab.py "$@" || vocab_rc=$?  # a failure here must not skip what follows
# cost model (issue 18, docs/knobs.md): Ring-DTP's time against C, the fitted constants of boundpass/bound/cost_model.py
# written to $OUT/costs.json (BOUNDPASS_COSTS=that file makes compile use them); ~30 s, never fails the run
timeout 90 python3 bench/calibrate_costs.py "$@" || echo "gpu_check: calibrate_costs failed (rc $?)" >&2
# OffloadStreamAdamW: exactness on CUDA, link floor, (β, S) sweep vs serial CPU Adam; saves after each row. Its
# knee step (issue 18): the step time against β at S = 2 beside cost_model's, and the measured link rate merged
# into $OUT/costs.json as {"cuda": {"link_bandwidth": ...}} beside calibrate_costs' constants (BOUNDPASS_COSTS
# makes compile's β / S knee use it), the curve and knees under "optimizer"
timeout 120 python3 bench/gpu_optimizer.py "$@"
# SCO: real device peak and step time vs the host budget, eager and compiled (bench/gpu_sco.py); it stops
# starting variants after 100 s and saves after each sequence length; a failure here is reported in the exit code
sco_rc=0 sco_timeout=150
[[ "${1:-}" == "--dry-run" ]] && sco_timeout=400  # the CPU dry run compiles deepseek on a shared 2-core machine
timeout "$sco_timeout" python3 bench/gpu_sco.py "$@" || sco_rc=$?
if [[ "$vocab_rc" == 0 && "$sco_rc" != 0 ]]; then vocab_rc=$sco_rc; fi
# expert dispatch (issue 16): standard EP vs LLEP vs PipelinedLLEP on the visible GPUs (one GPU: E_p = 1; NCCL ranks
# when there are more), balanced / Zipf / adversarial: max_memory_allocated, CUDA-synchronised time, and
# PipelinedLLEP's time against the chunk cap c (with 2+ GPUs the all-to-all latency and rate fitted to it go into
# $OUT/costs.json for cost_model's dispatch knee);
# $OUT/gpu_dispatch.{json,md}; it stops starting measurements after 60 s (100 s at most here); never fails the run
timeout 100 python3 bench/gpu_dispatch.py "$@" || echo "gpu_check: gpu_dispatch failed (rc $?)" >&2

# --- torchtitan recipe (issue 7): one GPU, EP = 1, stock torchtitan vs --boundpass.budget, same seed -------------
# torchtitan's own trainer through boundpass.recipes.train (no CPU shims on a GPU: FlexAttention, CUDA). Losses at
# full precision in recipe_{stock,boundpass}.jsonl, logs beside them; 2 x 90 s at most. Needs torchtitan.
recipe_rc=0
recipe_out="${OUT:-bench/out}"
mkdir -p "$recipe_out"
if python3 -c 'import torchtitan' 2>/dev/null; then
    recipe_dir="$(mktemp -d)"
    recipe_steps=10 recipe_seq=4096 recipe_timeout=90
    # dry run on a (shared, 2-core) CPU: tiny and slower; the CPU shims of boundpass.recipes apply there
    if [[ "${1:-}" == "--dry-run" ]]; then recipe_steps=2 recipe_seq=128 recipe_timeout=300; fi
    for variant in stock boundpass; do
        extra=()
        [[ $variant == boundpass ]] && extra=(--boundpass.budget 1GiB)  # tight: OffloadStreamAdamW + narrow strips on CUDA
        rm -f "$recipe_out/recipe_$variant.jsonl"
        timeout "$recipe_timeout" python3 -m torch.distributed.run --nproc-per-node 1 -m boundpass.recipes.train \
            --module boundpass.recipes --config deepseek_v3_debug --training.steps "$recipe_steps" \
            --training.seq_len "$recipe_seq" --dump_folder "$recipe_dir/$variant" \
            --boundpass.record_losses "$recipe_out/recipe_$variant.jsonl" "${extra[@]}" \
            > "$recipe_out/recipe_$variant.log" 2>&1 || recipe_rc=$?
    done
    rm -rf "$recipe_dir"
    python3 - "$recipe_out" <<'PY' || recipe_rc=$?
import json, sys
out = sys.argv[1]
runs = {v: [json.loads(l) for l in open(f"{out}/recipe_{v}.jsonl")] for v in ("stock", "boundpass")}
for s, b in zip(runs["stock"], runs["boundpass"]):
    print(f"gpu_check recipe: step {s['step']:3d} stock {s['loss']:.6f} boundpass {b['loss']:.6f} "
          f"rel {abs(b['loss'] - s['loss']) / abs(s['loss']):.1e}")
if len(runs["stock"]) != len(runs["boundpass"]) or not runs["stock"]:
    sys.exit("gpu_check recipe: the two runs logged different step counts")
PY
    grep -h "\[boundpass\]" "$recipe_out/recipe_boundpass.log" | head -20 || true
else
    echo "gpu_check: torchtitan not importable: recipe run skipped" >&2
fi

echo "gpu_check: all GPU measurements done in $((SECONDS - start)) s; results in ${OUT:-bench/out}/"
[[ "$vocab_rc" != 0 ]] && exit "$vocab_rc"
exit "$recipe_rc"
