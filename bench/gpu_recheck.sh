#!/usr/bin/env bash
# A short GPU recheck (under 5 minutes) of what the full bench/gpu_check.sh run of 2026-12-04 found:
#   1. the cuBLAS / cuBLASLt workspaces torch keeps after the first matmul of each dtype (the one term the Ring-DTP
#      op exceeded its bound by: 67,077,112 B), read from torch.cuda.memory_allocated and torch's own size getters;
#   2. Ring-DTP's fp32 shape (N=16384, H=1024, V=128000) against its bound with the workspaces counted, no Inductor;
#   3. compiled SCO (bench/gpu_sco.py), which failed on torch 2.11 (an import of 2.13's is_opaque_node) before.
# Results: $OUT/ if set, else bench/out/.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${OUT:-bench/out}"; mkdir -p "$out"
python3 - <<'PY' | tee "$out/blas_workspace.txt"
import torch
from boundpass.bound.bounds import blas_workspace_bytes
print("torch", torch.__version__, torch.cuda.get_device_name())
for name in ("_cuda_getCublasWorkspaceSize", "_cuda_getCublasLtWorkspaceSize"):
    f = getattr(torch._C, name, None)
    print(name, f() if f else "not exposed")
print("blas_workspace_bytes", blas_workspace_bytes("cuda"))
for dtype in (torch.float32, torch.bfloat16):
    a = torch.randn(1024, 1024, device="cuda", dtype=dtype)
    torch.cuda.synchronize(); before = torch.cuda.memory_allocated()
    (a @ a).sum().item(); torch.cuda.synchronize()
    print(dtype, "first matmul leaves", torch.cuda.memory_allocated() - before - 1024 * 1024 * a.element_size() * 0, "B allocated beyond the inputs (result freed)")
PY
timeout 150 python3 bench/gpu_vocab.py --case 0 --no-inductor; vocab=$?
timeout 150 python3 bench/gpu_sco.py; sco=$?
echo "gpu_recheck: gpu_vocab rc=$vocab gpu_sco rc=$sco"
