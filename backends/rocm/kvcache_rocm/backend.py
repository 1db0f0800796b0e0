"""``RocmBackend``: the CUDA backend's torch + Triton code on HIP, with ROCm's own tuning table
and availability. Everything that differs from CUDA is data in this package."""

from __future__ import annotations

from dataclasses import replace

from kvcache_cuda.backend import CudaBackend, torch

from .tuning import ROCM_TUNING


class RocmBackend(CudaBackend):
    name = "rocm"
    priority = 100
    description = "torch on HIP + Triton on AMD GPUs (copy stream, merged aux; shares the CUDA kernels)"
    TUNING = ROCM_TUNING
    # CUDA-graph capture is HIP-graph capture here; declared only where CUDA declares it, and
    # never verified on AMD hardware.
    # fp8 pages are not declared: MI300 (gfx942) computes fp8 as e4m3fnuz (max 240, another
    # exponent bias), not the e4m3fn format kvcache.kv_quant defines, and no AMD GPU was
    # available to verify either; a quantized kv_dtype is refused here
    capabilities = replace(CudaBackend.capabilities,
                           kv_dtypes=tuple(CudaBackend.capabilities.dtypes))

    @classmethod
    def _runtime_problem(cls):
        if torch.version.hip is None:
            if torch.version.cuda is None:
                return "torch is a CPU-only build, not ROCm (torch.version.hip is None)"
            return "torch built for CUDA, not ROCm (torch.version.hip is None)"
        if not torch.cuda.is_available():
            return "no ROCm GPU visible (torch.cuda.is_available() is False under HIP)"
        return None

    @classmethod
    def _runtime_label(cls) -> str:
        return f"HIP {torch.version.hip}"

    @classmethod
    def platform(cls):
        info = super().platform()
        info.pop("cuda", None)
        info.update(vendor="amd", runtime="hip")
        if torch is not None and torch.version.hip:
            info["hip"] = torch.version.hip
        return info
