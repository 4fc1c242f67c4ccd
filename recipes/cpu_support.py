"""torchtitan 0.3.0 on a machine without a GPU: the few shims it needs, applied ONLY when no CUDA device exists.

Each shim names the upstream reason (torchtitan assumes CUDA, or a torch/torchtitan version skew); all were
verified on torch 2.13.0+cpu with torchtitan 0.3.0 (shared notes, torchtitan_cpu.md section 6). On a GPU
machine `apply_runtime_shims()` and `adapt_config()` do nothing, so the recipe runs torchtitan unchanged.

Runtime shims (process-wide, idempotent; call before torchtitan is imported):
- device type: `torchtitan.tools.utils.device_type` is `_get_available_device_type() or "cuda"`, so with no
  accelerator torchtitan picks "cuda" and dies in `torch._C._cuda_setDevice`. We make it read "cpu".
- memory monitor: `components/metrics.py:DeviceMemoryMonitor` calls `torch.cpu.get_device_name`,
  `get_device_properties` and `memory_stats`, which torch.cpu does not have. We swap in a monitor that reports
  the process's peak RSS against the machine's RAM (what "device memory" means on CPU).
- process-group timeout: `distributed/utils.py:set_pg_timeouts` calls `barrier(device_ids=["cpu"])` (a
  TypeError: gloo takes no device ids) and `torch.distributed.set_timeout`, which torch 2.13 does not have
  (only `distributed_c10d._set_pg_timeout`). We run the same barrier-then-set without device ids.
- gloo reduce ops: FSDP2 reduce-scatters gradients with `ReduceOp.AVG` or `ReduceOp.PREMUL_SUM(1/f)` when the
  divide factor differs from the group size (torchtitan sets one for expert-parallel modules); gloo supports
  neither. We ask FSDP2 for its own `force_sum_reduction_for_comms` path: SUM on the wire, divide locally.
  Same gradients up to the rounding of where the division happens.

Config adaptations (per config, before the Trainer is built):
- attention: FlexAttention has no CPU backward, varlen attention no CPU kernel. We swap each layer's inner
  attention to causal SDPA, the swap torchtitan's own graph_trainer tests use
  (`build_decoder_config_for_backend`). SDPA is causal-only: it drops gpt_oss's sinks and sliding window.
  MLA (deepseek_v3) has a value head dim (128) below its query/key head dim (192); torch's CPU flash kernel
  needs them equal, so SDPA would fall back to the math kernel and hold [heads, L, L] scores: memory
  quadratic in L, which no GPU run has (FlexAttention is memory-efficient). `ValuePaddedSDPA` pads V with
  zero columns to the q/k head dim and drops them from the output: softmax(QK^T)[V, 0] = [softmax(QK^T)V, 0],
  exact, and the CPU flash kernel (memory linear in L) runs.
- CUDA graphs: `training.disable_cuda_graphs` (the default wraps the step in `wrap_with_cuda_graph`).
- SPMD backend: the default `spmd_types` cannot run multi-rank on gloo (uneven all-to-all, and torch 2.13's
  `fully_shard` error with dp > 1); `partial_dtensor` works.
"""
from __future__ import annotations

import inspect
import os
import resource
from datetime import timedelta

import torch

_APPLIED: list[str] = []


def gpu_present() -> bool:
    """True when torch sees a CUDA device: then no shim is applied and torchtitan runs as shipped."""
    return torch.cuda.is_available()


def apply_runtime_shims() -> list[str]:
    """Apply the process-wide CPU shims when no GPU is present; returns the names applied (empty on a GPU)."""
    if gpu_present() or _APPLIED:
        return list(_APPLIED)
    import torch._utils as torch_utils
    torch_utils._get_available_device_type = lambda: "cpu"
    _APPLIED.append("device_type=cpu")

    from torchtitan.tools import utils as tt_utils
    if tt_utils.device_type != "cpu":  # torchtitan was imported before us: fix its module constants too
        tt_utils.device_type, tt_utils.device_module = "cpu", torch.cpu

    from torchtitan.components import metrics
    metrics.device_type, metrics.device_module = "cpu", torch.cpu
    metrics.DeviceMemoryMonitor = CPUMemoryMonitor
    _APPLIED.append("memory_monitor=rss")

    from torchtitan.distributed import utils as dist_utils
    dist_utils.set_pg_timeouts = _set_pg_timeouts_cpu
    _APPLIED.append("set_pg_timeouts=gloo")

    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as fsdp_collectives
    original = fsdp_collectives._get_gradient_divide_factors
    signature = inspect.signature(original)

    def sum_reduction_divide_factors(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.arguments["force_sum_reduction_for_comms"] = True  # gloo: no AVG / PREMUL_SUM reduce-scatter
        return original(*bound.args, **bound.kwargs)
    fsdp_collectives._get_gradient_divide_factors = sum_reduction_divide_factors
    _APPLIED.append("fsdp_reduce=sum")
    return list(_APPLIED)


def adapt_config(config) -> list[str]:
    """Per-config CPU adaptations (attention swap, CUDA graphs off, partial_dtensor); none on a GPU."""
    if gpu_present():
        return []
    done = []
    ScaledDotProductAttention = _value_padded_sdpa()
    model_cfg = config.model_spec.model
    swapped = 0
    for layer in getattr(model_cfg, "layers", []):
        attention = getattr(layer, "attention", None)
        if attention is not None and not isinstance(attention.inner_attention, ScaledDotProductAttention.Config):
            attention.inner_attention = ScaledDotProductAttention.Config()
            swapped += 1
    if swapped:
        done.append(f"attention->sdpa (value-padded) x{swapped}")
    if not config.training.disable_cuda_graphs:
        config.training.disable_cuda_graphs = True
        done.append("disable_cuda_graphs")
    if config.parallelism.spmd_backend == "spmd_types" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        config.parallelism.spmd_backend = "partial_dtensor"
        done.append("spmd_backend=partial_dtensor")
    return done


_VALUE_PADDED_SDPA = None


def _value_padded_sdpa():
    """torchtitan's SDPA inner attention, with V zero-padded to the q/k head dim (see the module docstring)."""
    global _VALUE_PADDED_SDPA
    if _VALUE_PADDED_SDPA is not None:
        return _VALUE_PADDED_SDPA
    from dataclasses import dataclass

    import torch.nn.functional as F
    from torchtitan.models.common.attention import ScaledDotProductAttention

    class ValuePaddedSDPA(ScaledDotProductAttention):
        @dataclass(kw_only=True, slots=True)
        class Config(ScaledDotProductAttention.Config):
            pass

        def forward(self, q_BLNH, k_BLNH, v_BLNH, **kwargs):
            value_dim, qk_dim = v_BLNH.shape[-1], q_BLNH.shape[-1]
            if value_dim >= qk_dim:
                return super().forward(q_BLNH, k_BLNH, v_BLNH, **kwargs)
            out = super().forward(q_BLNH, k_BLNH, F.pad(v_BLNH, (0, qk_dim - value_dim)), **kwargs)
            return out[..., :value_dim].contiguous()

    _VALUE_PADDED_SDPA = ValuePaddedSDPA
    return ValuePaddedSDPA


class CPUMemoryMonitor:
    """torchtitan's DeviceMemoryMonitor interface over process RSS (the CPU's 'device memory')."""

    def __init__(self, device: str = "cpu"):
        self.device = torch.device("cpu")
        self.device_name = "cpu"
        self.device_index = 0
        self.device_capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        self.device_capacity_gib = self.device_capacity / 2 ** 30

    def _to_gib(self, n):
        return n / 2 ** 30

    def _to_pct(self, n):
        return 100 * n / self.device_capacity

    def get_peak_stats(self):
        from torchtitan.components.metrics import DeviceMemStats
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        return DeviceMemStats(self._to_gib(peak), self._to_pct(peak), self._to_gib(peak), self._to_pct(peak), 0, 0)

    def reset_peak_stats(self):
        pass  # ru_maxrss cannot be reset: the reported peak is the process's


def _set_pg_timeouts_cpu(timeout: timedelta, parallel_dims) -> None:
    """torchtitan's set_pg_timeouts without CUDA device ids, with torch 2.13's private setter."""
    from torch.distributed import distributed_c10d
    torch.distributed.barrier()
    groups = [mesh.get_group() for mesh in parallel_dims.get_all_one_dimensional_meshes().values()] + [None]
    for group in groups:
        distributed_c10d._set_pg_timeout(timeout, group)


def apply_cpu_device_fix() -> None:
    """Make torchtitan see "cpu" as its device type when no CUDA device exists (call before importing it)."""
    if not torch.cuda.is_available():
        import torch._utils as torch_utils
        torch_utils._get_available_device_type = lambda: "cpu"
