"""``CudaBackend``: torch for memory and streams, Triton kernels (torch fallback on CPU tensors).

Importing this module needs neither torch nor a GPU: ``availability`` reports what is missing.

Device modes
------------
* ``device=None | "cuda" | "cuda:N"``: the real backend. A dedicated copy stream carries the one
  merged aux upload per forward; the compute stream waits on it with an event.
* ``device="cpu"``: a *test mode* (enabled with ``KVCACHE_CUDA_CPU=1`` so that ``backend="auto"``
  never picks it by accident): the same Python paths on CPU tensors; streams and events are
  host objects that record what happened, pinned memory is plain memory. Kernels run the torch
  implementation, or the Triton kernels through Triton's interpreter when ``TRITON_INTERPRET=1``.

Subclassing (ROCm): override ``name``, ``priority``, ``TUNING``, ``_runtime_problem`` and
``platform``; everything else is shared.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

from kvcache.backend import Backend, Capabilities
from kvcache.errors import UnsupportedFeatureError
from kvcache.plugins import FrameworkNotImported

from .launch import LaunchCache
from .tuning import CUDA_TUNING, Tuning, device_arch, for_arch

try:  # torch is optional at import time; availability() explains its absence
    import torch
except Exception:  # pragma: no cover - exercised only where torch is missing
    torch = None  # type: ignore[assignment]

CPU_TEST_ENV = "KVCACHE_CUDA_CPU"
IMPL_ENV = "KVCACHE_CUDA_IMPL"          # "auto" (default) | "torch" | "triton"


def _torch_dtypes():
    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
            "int32": torch.int32, "int64": torch.int64}


def _page_dtype(fmt):
    """The torch dtype of pages storing ``fmt`` (a ``KVFormat``: its storage dtype; fp8:
    e4m3fn, kvcache.kv_quant's format)."""
    return torch.float8_e4m3fn if fmt.storage == "float8_e4m3" else _torch_dtypes()[fmt.storage]


@dataclass
class KernelCtx:
    """What kernels need to know about the cache, fixed per backend instance."""

    page_size: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    group: int
    dtype: object
    tuning: Tuning
    num_sms: int
    launch: LaunchCache
    """Per-forward launch records and scratch of the Triton launchers (``kvcache_cuda.launch``)."""
    head_dim_v: int = 0
    """Dv, the value / output head dim (0: ``head_dim``)."""
    kv_quant: bool = False
    """The pages hold fp8 e4m3 codes (``kv_dtype="float8_e4m3"``): kernels take ``kv_scale``."""
    batch_invariant: bool = False
    """``CacheConfig(batch_invariant=True)``: paged attention computes each row in one fixed
    order of its own keys (decode entries through the prefill kernel's invariant loop)."""

    def __post_init__(self):
        if not self.head_dim_v:
            self.head_dim_v = self.head_dim


class HostStream:
    """Stand-in for a CUDA stream in CPU test mode: work runs synchronously, events are counted."""

    def __init__(self, name="copy"):
        self.name = name
        self.waited = []

    def wait_event(self, event):
        """Record that this stream waited on ``event``."""
        self.waited.append(event)


class HostEvent:
    """Stand-in for a CUDA event in CPU test mode (always complete)."""

    def __init__(self, stream):
        self.stream = stream
        self.synchronized = 0

    def synchronize(self):
        self.synchronized += 1

    def query(self):
        """Always complete."""
        return True


class CudaBackend(Backend):
    name = "cuda"
    priority = 100
    description = "torch + Triton on NVIDIA GPUs (copy stream, merged aux, split-K decode)"
    benchmarks = "kvcache_cuda.bench:run_benchmarks"
    capabilities = Capabilities(
        dtypes=("float16", "bfloat16", "float32"),
        copy_stream=True, merged_aux=True, static_decode=True,
        tree_attention=True, sliding_window=True, fused_rope_append=True, inline_rope=True,
        window_left=True, rope_frequencies=True, logit_softcap=True, attention_sinks=True,
        # batch_invariant: every entry through the paged prefill kernel's invariant loop (one
        # order of a row's own key tiles); the torch fallback computes each row alone
        batch_invariant=True,
        window_groups=True, state_slots=True,
        # the Triton kernels pad head_dim, head_dim_v (and the RoPE half) to a power of two of
        # at least 16 (tl.dot's minimum), masked
        head_dims=tuple(range(8, 257, 8)),
        # value head dims other than head_dim: powers of two only. A masked V width (Dv=24 in
        # a 32-wide tile with D=40, 16-bit) made Triton 3.6's ragged kernel read shared memory
        # out of bounds on the H100 (compute-sanitizer, 2026-11-24); 32/48, 32/64, 128/192 and
        # 128/64 ran clean and match the reference.
        head_dims_v=(16, 32, 64, 128, 256),
        # fp8 e4m3 pages: stored by the append kernels, read with the dequantization fused into
        # every attention kernel (scales folded out of the inner loop)
        kv_dtypes=("float16", "bfloat16", "float32", "float8_e4m3"),
    )
    TUNING: Tuning = CUDA_TUNING
    CPU_TEST_SMS = 4          # pretend SM count in CPU test mode: small, so split-K triggers

    # ------------------------------------------------------------------ discovery
    @classmethod
    def _runtime_problem(cls) -> Optional[str]:
        """Why the GPU runtime this class targets is unusable (None: usable)."""
        if torch.version.hip is not None:
            return "torch built for ROCm (HIP), use the rocm backend"
        if not torch.cuda.is_available():
            return "no CUDA device visible (torch.cuda.is_available() is False)"
        return None

    @classmethod
    def _runtime_label(cls) -> str:
        return f"CUDA {torch.version.cuda}"

    @classmethod
    def availability(cls, device=None):
        if torch is None:
            build = "ROCm" if cls.name == "rocm" else "CUDA"
            return False, (f"torch is not installed (pip install 'torch>=2.4', a {build} build: "
                           "https://pytorch.org/get-started/locally/)")
        if device is not None and str(device).startswith("cpu"):
            if os.environ.get(CPU_TEST_ENV) == "1":
                try:
                    version = str(torch.__version__)
                except FrameworkNotImported:    # backend='auto' asking without importing torch
                    version = "(not imported yet)"
                return True, (f"CPU test mode (torch {version} on CPU tensors; "
                              "not a production device)")
            # the model (or the cache) is on the CPU: say how to run it, not how to test us
            try:
                problem = cls._runtime_problem()
            except FrameworkNotImported:    # listed without importing torch: the rest holds
                problem = None
            here = f"; this machine has no GPU for it: {problem}" if problem else ""
            return False, (f"device {device!r} is the CPU and the {cls.name} backend runs on a "
                           f"GPU: move the model to a GPU, model.to('cuda') (a cache: "
                           f"device='cuda'), or use backend='reference' on the CPU{here}; "
                           f"{CPU_TEST_ENV}=1 turns on a CPU test mode of this backend, for "
                           f"testing it only")
        problem = cls._runtime_problem()
        if problem:
            return False, problem
        try:
            import triton  # noqa: F401
        except Exception as exc:
            return False, (f"triton is not importable ({type(exc).__name__}: {exc}); "
                           "pip install 'triton>=3.0'")
        if device is not None:
            try:
                dev = torch.device(device)
            except Exception as exc:
                return False, f"bad device {device!r}: {exc}"
            if dev.type != "cuda":
                return False, f"the {cls.name} backend runs on GPU devices, not {device!r}"
            if dev.index is not None and dev.index >= torch.cuda.device_count():
                return False, f"{device!r} does not exist ({torch.cuda.device_count()} devices visible)"
        idx = 0 if device is None else (torch.device(device).index or 0)
        return True, f"{torch.cuda.get_device_name(idx)} ({cls._runtime_label()}, torch {torch.__version__})"

    @classmethod
    def devices(cls):
        if torch is None or cls._runtime_problem():
            return []
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]

    @classmethod
    def platform(cls):
        info = {"vendor": "nvidia", "runtime": "cuda"}
        if torch is not None:
            info["torch"] = torch.__version__
            if torch.version.cuda:
                info["cuda"] = torch.version.cuda
        try:
            import triton
            info["triton"] = triton.__version__
        except Exception:
            pass
        return info

    # ------------------------------------------------------------------ construction
    def __init__(self, config, device=None):
        if torch is None:
            raise RuntimeError("the cuda backend needs torch")
        dev = torch.device("cuda" if device is None else device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        super().__init__(config, str(dev))
        self.torch_device = dev
        self.on_gpu = dev.type != "cpu"
        self.dtype = _torch_dtypes()[config.dtype]
        self.impl = os.environ.get(IMPL_ENV, "auto")
        self.interpret = os.environ.get("TRITON_INTERPRET") == "1"
        if self.interpret and not self.on_gpu and config.dtype == "bfloat16":
            # the interpreter runs the kernels on numpy, which has no bfloat16: it reads the
            # bits as another type and returns garbage without an error
            raise UnsupportedFeatureError(
                "the cuda backend's CPU test mode under TRITON_INTERPRET=1 cannot run bfloat16 "
                "(Triton's interpreter computes in numpy, which has no bfloat16): use float16 "
                "or float32 there, or a GPU")
        self._num_sms = (torch.cuda.get_device_properties(dev).multi_processor_count
                         if self.on_gpu else self.CPU_TEST_SMS)
        self.launch_cache = LaunchCache()
        self.arch = device_arch(torch, dev)
        """The GPU's architecture (``"sm_90"``, ``"gfx942"``; None in the CPU test mode)."""
        self.tuning = for_arch(self.TUNING, self.arch)      # its tuning_table.json entry
        self.host_compute_stream = None if self.on_gpu else HostStream("compute")
        self.flash_problem: Optional[str] = None
        """Why ``flash`` is None (the bench prints it)."""
        self.flash = self._flash_prefill()
        """The prefill calls' dispatch to torch's attention kernels
        (``kvcache_cuda.flash.FlashPrefill``), or None where they cannot run (no GPU, ROCm, an old GPU or torch,
        ``KVCACHE_CUDA_FLASH=off``): every call runs the Triton kernels."""

    def _flash_prefill(self):
        if not self.on_gpu or self.impl == "torch":
            self.flash_problem = "not on a GPU" if not self.on_gpu else f"{IMPL_ENV}=torch"
            return None
        from . import flash                 # imports Triton: GPU users only
        self.flash_problem = flash.flash_problem(self.torch_device)
        return None if self.flash_problem else flash.FlashPrefill()

    @property
    def scratch_allocations(self) -> int:
        """Scratch tensors the Triton launchers allocated for launch records so far (split-K
        partials, the ragged path's finite-V copy and flags): flat across the layers of a forward
        and across steady-state steps of one plan (``kvcache_cuda.launch``)."""
        return self.launch_cache.allocations

    @property
    def tuning(self) -> Tuning:
        """The kernel tile table in use: ``TUNING`` with this GPU architecture's entry of
        ``tuning_table.json`` (``kvcache_cuda.tuning.for_arch``), unless a test or sweep sets
        another."""
        return self._tuning

    @tuning.setter
    def tuning(self, value: Tuning) -> None:
        # kernels get one immutable context per tuning (no per-call construction on the hot path)
        self._tuning = value
        c = self.config
        self.launch_cache.clear()          # records hold tiles and split factors of the old table
        self.ctx = KernelCtx(c.page_size, c.num_qo_heads, c.num_kv_heads, c.head_dim,
                             c.group_size, self.dtype, value, self._num_sms, self.launch_cache,
                             c.head_dim_v, c.kv_format.scaled, c.batch_invariant)

    def kernels(self, tensor=None):
        """The kernel module for this call: Triton on GPU tensors (or under TRITON_INTERPRET=1),
        torch otherwise; ``impl`` ('torch' / 'triton') forces one (tests compare them)."""
        impl = self.impl
        if impl == "auto":
            on_gpu = self.on_gpu if tensor is None else tensor.is_cuda
            impl = "triton" if (on_gpu or self.interpret) else "torch"
        mod = _KERNEL_MODULES.get(impl)
        if mod is None:        # imported once (triton lazily: CPU-only users never import it)
            import importlib
            mod = _KERNEL_MODULES[impl] = importlib.import_module(f"{__package__}.{impl}_kernels")
        return mod

    def _guard(self):
        # Triton launches on the *current* device; only switch when this cache lives elsewhere
        if self.on_gpu and self.torch_device.index != torch.cuda.current_device():
            return torch.cuda.device(self.torch_device)
        return _NO_SWITCH

    # ------------------------------------------------------------------ memory
    def memory_capacity(self):
        if self.on_gpu:
            return torch.cuda.get_device_properties(self.torch_device).total_memory
        return super().memory_capacity()

    # Buffers that outlive a call are made outside inference mode: made inside it (a cache
    # built or first driven in a model loop under torch.inference_mode()) they would refuse the
    # in-place updates every later forward outside it does.
    def allocate_pages(self, num_pages):
        kv_dtype = _page_dtype(self.config.kv_format)
        with torch.inference_mode(False):
            return [torch.zeros(self.page_shape(num_pages), dtype=kv_dtype, device=self.torch_device)
                    for _ in range(self.config.num_layers)]

    def from_numpy(self, array, dtype=None):
        array = np.asarray(array)
        if dtype is None:
            dtype = "int32" if array.dtype.kind in "iub" else self.config.dtype
        if array.dtype.kind == "f" and dtype == "float16" and array.dtype.itemsize > 4:
            # rounded once, on the host: torch casts float64 to float16 through float32, and
            # that second rounding differs from one in rare ties (which can move an fp8 code:
            # the full conformance matrix's fp8 float16 page-32 case)
            array = array.astype(np.float16)
        if array.dtype.kind == "f" or array.dtype.name == "bfloat16":
            if array.dtype not in (np.float16, np.float32, np.float64):
                array = array.astype(np.float32)       # bfloat16 (ml_dtypes) goes via float32
        t = torch.from_numpy(np.ascontiguousarray(array))
        return t.to(device=self.torch_device, dtype=_torch_dtypes()[dtype])

    def to_numpy(self, array):
        t = array.detach()
        if t.is_floating_point() and t.element_size() < 4:
            t = t.float()
        return t.cpu().numpy().copy()

    # ------------------------------------------------------------------ host tier
    def host_copy(self, array):
        if not self.on_gpu:
            return super().host_copy(array)
        t = array.detach().contiguous()
        # pinned (page-locked) memory from torch's caching host allocator: a DMA at the link's
        # speed, and a freed block is reused without pinning anew
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return _numpy_bits(host), done

    def from_host(self, host):
        if not self.on_gpu:
            return super().from_host(host)
        name = host.dtype.name
        bits = host.view(np.int16) if name == "bfloat16" else host
        t = torch.from_numpy(np.ascontiguousarray(bits))
        if name == "bfloat16":
            t = t.view(torch.bfloat16)
        return t.to(self.torch_device, non_blocking=True)

    def checksum(self, array):
        b = array.detach().contiguous().reshape(-1).view(torch.uint8)
        if b.data_ptr() % 8:
            b = b.clone()
        n = b.numel()
        main = n - n % 512
        rows = b[:main].view(torch.int64).view(-1, 64).sum(dim=1)
        if main < n:                # the last row zero-padded
            tail = torch.zeros(512, dtype=torch.uint8, device=b.device)
            tail[:n - main] = b[main:]
            rows = torch.cat([rows, tail.view(torch.int64).sum().view(1)])
        weights = torch.arange(1, rows.numel() + 1, dtype=torch.int64, device=b.device)
        return torch.stack([rows.sum(), (rows * weights).sum()])

    def is_native(self, array):
        return (torch is not None and isinstance(array, torch.Tensor)
                and array.device.type == self.torch_device.type)

    def dtype_name(self, array):
        for name, dt in _torch_dtypes().items():
            if array.dtype == dt:
                return name
        return str(array.dtype).replace("torch.", "")

    # ------------------------------------------------------------------ streams and events
    def create_stream(self):
        return torch.cuda.Stream(device=self.torch_device) if self.on_gpu else HostStream()

    def current_stream(self):
        return torch.cuda.current_stream(self.torch_device) if self.on_gpu else self.host_compute_stream

    def synchronize(self):
        if self.on_gpu:
            torch.cuda.synchronize(self.torch_device)

    def record_event(self, stream=None):
        stream = stream or self.current_stream()
        if not self.on_gpu:
            return HostEvent(stream)
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def stream_wait_event(self, event, stream=None):
        if event is None:
            return
        (stream or self.current_stream()).wait_event(event)

    def event_synchronize(self, event):
        if event is not None:
            event.synchronize()

    # ------------------------------------------------------------------ aux transfer
    def aux_to_device(self, host_array):
        a = np.ascontiguousarray(host_array, dtype=np.int32)
        if self.on_gpu:
            # a pinned staging copy makes the upload asynchronous w.r.t. the host. Taken from
            # torch's caching host allocator and filled here: Tensor.pin_memory() first asks
            # the driver whether the source is pinned, which took 1.4-2.8 ms a call on the
            # two-GPU H200 machine (most of a small transfer's time)
            with torch.inference_mode(False):
                staging = torch.empty(a.shape, dtype=torch.int32, pin_memory=True)
            staging.numpy()[...] = a
            return staging.to(self.torch_device, non_blocking=True)
        return torch.from_numpy(a).clone()

    def aux_alloc_host(self, num_int32):
        with torch.inference_mode(False):
            t = torch.empty(num_int32, dtype=torch.int32, pin_memory=self.on_gpu)
        return t, t.numpy()        # the numpy view aliases the (pinned) tensor's memory

    def aux_alloc_device(self, num_int32):
        with torch.inference_mode(False):
            return torch.empty(num_int32, dtype=torch.int32, device=self.torch_device)

    def aux_copy_async(self, device_buffer, host_handle, num_int32, stream):
        if not self.on_gpu:
            device_buffer[:num_int32].copy_(host_handle[:num_int32])
            return HostEvent(stream)
        with torch.cuda.stream(stream):
            device_buffer[:num_int32].copy_(host_handle[:num_int32], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        return ev

    def aux_view(self, device_buffer, offset, length):
        return device_buffer[offset:offset + length]

    # ------------------------------------------------------------------ kernels
    def rope(self, x, positions, rope):
        with self._guard():
            return self.kernels(x).rope(self.ctx, x, positions, rope)

    def _no_packed_format(self):
        # the core asks for packed rows only of a packed format, which kv_dtypes does not list
        raise UnsupportedFeatureError(
            f"backend {self.name!r} stores no packed format (kv_dtypes: "
            f"{self.capabilities.kv_dtypes}); packed rows cannot move through it")

    # kv_scale (fp8 pages only, kvcache.backend): the layer's (2, Hkv) float32 scales
    def append_kv(self, pages, k, v, slots, positions=None, rope=None, kv_scale=None,
                  packed=False):
        if packed:
            self._no_packed_format()
        with self._guard():
            self.kernels(k).append_kv(self.ctx, pages, k, v, slots, positions, rope, kv_scale)

    def append_kv_layers(self, pages_per_layer, k, v, slots, packed=False):
        if packed:
            self._no_packed_format()
        # one launch for every layer on the Triton path (a transfer's import)
        if len(pages_per_layer) != k.shape[0] or len(pages_per_layer) != v.shape[0]:
            raise ValueError(f"append_kv_layers: {len(pages_per_layer)} page arrays for k of "
                             f"{k.shape[0]} layers and v of {v.shape[0]}")
        with self._guard():
            self.kernels(k).append_kv_layers(self.ctx, pages_per_layer, k, v, slots)

    def rope_append(self, pages, q, k, v, slots, positions, rope, **quant):
        with self._guard():          # quant: {"kv_scale": ...} with fp8 pages, else empty
            return self.kernels(q).rope_append(self.ctx, pages, q, k, v, slots, positions, rope,
                                               quant.get("kv_scale"))

    def ragged_attention(self, q, k, v, qo_indptr, sm_scale, *, num_seqs, max_len, tree=None,
                         rope=None, q_positions=None, k_rope_offset=None, window_left=-1,
                         logit_softcap=0.0, sinks=None, kv_scale=None):
        kernels, flash = self.kernels(q), self.flash
        extra = {}
        if flash is not None and kernels.__name__.endswith("triton_kernels") and flash.ragged_ok(
                self.ctx, q, k, v, num_seqs=num_seqs, max_len=max_len, tree=tree, rope=rope,
                softcap=logit_softcap, sinks=sinks, window_left=window_left, kv_scale=kv_scale):
            extra["attend"] = flash.ragged_attend(qo_indptr, max_len, sm_scale, int(window_left),
                                                  num_seqs, int(q.shape[0]), kv_scale, sinks)
        with self._guard():
            return kernels.ragged_attention(
                self.ctx, q, k, v, qo_indptr, sm_scale, num_seqs=num_seqs, max_len=max_len,
                tree=tree, rope=rope, q_positions=q_positions, k_rope_offset=k_rope_offset,
                window_left=window_left, logit_softcap=logit_softcap, sinks=sinks,
                kv_scale=kv_scale, **extra)

    def paged_attention(self, q, pages, depth, sm_scale, *, rope=None, q_positions=None,
                        window_left=-1, logit_softcap=0.0, sinks=None, kv_scale=None):
        kernels, flash = self.kernels(q), self.flash
        extra = {}
        if flash is not None and kernels.__name__.endswith("triton_kernels") and flash.paged_ok(
                self.ctx, q, depth, rope=rope, window_left=window_left, softcap=logit_softcap,
                sinks=sinks, kv_scale=kv_scale):
            extra["attend"] = flash.paged_attend(self.ctx, q, pages, depth, sm_scale, kv_scale,
                                                 sinks)
        with self._guard():
            return kernels.paged_attention(self.ctx, q, pages, depth, sm_scale, rope=rope,
                                           q_positions=q_positions, window_left=window_left,
                                           logit_softcap=logit_softcap, sinks=sinks,
                                           kv_scale=kv_scale, **extra)

    def merge_attention(self, o_a, lse_a, o_b, lse_b):
        with self._guard():
            return self.kernels(o_a).merge_attention(self.ctx, o_a, lse_a, o_b, lse_b)

    def copy_page_prefix(self, pages_per_layer, src_page, dst_page, length):
        with self._guard():
            self.kernels(pages_per_layer[0]).copy_page_prefix(
                self.ctx, pages_per_layer, int(src_page), int(dst_page), int(length))

    def compact_kv(self, pages_per_layer, src_slots, dst_slots):
        with self._guard():
            self.kernels(pages_per_layer[0]).compact_kv(self.ctx, pages_per_layer, src_slots, dst_slots)

    def gather_kv(self, pages_per_layer, slots, kv_scale=None, packed=False):
        if packed:
            self._no_packed_format()
        with self._guard():
            return self.kernels(pages_per_layer[0]).gather_kv(self.ctx, pages_per_layer, slots,
                                                              kv_scale)


    # ------------------------------------------------------------------ state slots
    def allocate_state(self, num_slots, shape, dtype=None):
        with torch.inference_mode(False):       # written in place by later forwards
            return torch.zeros((num_slots,) + tuple(shape),
                               dtype=self.dtype if dtype is None else _torch_dtypes()[dtype],
                               device=self.torch_device)

    def gather_state(self, states, slots):
        with self._guard():
            return states.index_select(0, slots.long())        # a new tensor

    def scatter_state(self, states, slots, values):
        with self._guard():
            states.index_copy_(0, slots.long(), values.to(states.dtype))

_NO_SWITCH = contextlib.nullcontext()     # reusable: it holds no state
_KERNEL_MODULES: dict = {}                # "torch" / "triton" -> the imported kernel module


def _numpy_bits(t):
    """A numpy view of host tensor ``t`` with its bits (bfloat16 as ml_dtypes' type)."""
    if t.dtype == torch.bfloat16:
        import ml_dtypes
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()
