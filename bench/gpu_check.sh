#!/usr/bin/env bash
# Every GPU measurement of the project, in one run of under 8 minutes on one GPU:
#   - Ring-DTP at P = 1 vs the standard schedule, the token-chunked (Liger-style) schedule and Inductor
#     (+ auto-chunker): torch.cuda.max_memory_allocated and CUDA-event times (bench/gpu_vocab.py);
#   - OffloadStreamAdamW (bench/gpu_optimizer.py);
#   - SCO checkpoint-boundary offload: device peak and step time vs host budget (bench/gpu_sco.py; it uses
#     torchtitan's debug MoE when importable, else a torch-only stand-in, and says which).
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
# OffloadStreamAdamW: exactness on CUDA, link floor, (β, S) sweep vs serial CPU Adam; saves after each row
timeout 120 python3 bench/gpu_optimizer.py "$@"
# SCO: real device peak and step time vs the host budget, eager and compiled (bench/gpu_sco.py); it stops
# starting variants after 100 s and saves after each sequence length; a failure here is reported in the exit code
sco_rc=0
timeout 150 python3 bench/gpu_sco.py "$@" || sco_rc=$?
if [[ "$vocab_rc" == 0 && "$sco_rc" != 0 ]]; then vocab_rc=$sco_rc; fi
echo "gpu_check: all GPU measurements done in $((SECONDS - start)) s; results in ${OUT:-bench/out}/"
exit "$vocab_rc"
