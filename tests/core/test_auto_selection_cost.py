"""``backend='auto'`` imports no framework that cannot change its choice (issue 53 item 6): torch
only where a GPU device file exists (or a device other than the CPU is named, or torch is imported
already), MLX only on macOS on Apple silicon; it spent about 2-3 s importing both to pick the
reference backend on a CPU machine."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest

from kvcache.plugins import _GPU_DEVICE_NODES

ON_A_PLAIN_LINUX_HOST = sys.platform.startswith("linux") \
    and not any(os.path.exists(node) for node in _GPU_DEVICE_NODES)
APPLE_SILICON = sys.platform == "darwin" and platform.machine() == "arm64"


def _python(code: str, **env: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=300, env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    return out.stdout


CACHE = """
    import sys, time
    import kvcache
    from kvcache.plugins import _auto_rows
    config = kvcache.CacheConfig(2, 4, 2, 64, rope_mode="normal")
    t0 = time.perf_counter()
    cache = kvcache.PagedKVCache(config, backend="auto"{device})
    print(cache.backend.name, round(time.perf_counter() - t0, 3))
    print(sorted(m for m in ("torch", "mlx", "triton") if m in sys.modules))
    for row in _auto_rows({device_arg}):
        print(row["name"], row["available"], row["reason"])
"""


@pytest.mark.skipif(not ON_A_PLAIN_LINUX_HOST, reason="a Linux host without GPU device files")
@pytest.mark.parametrize("device", [None, "cpu"])
def test_auto_on_a_cpu_host_imports_neither_torch_nor_mlx(device):
    out = _python(CACHE.format(device="" if device is None else f", device={device!r}",
                               device_arg=repr(device)))
    first, imported, *rows = out.splitlines()
    assert first.split()[0] == "reference" and imported == "[]", out
    reasons = dict(row.split(" ", 1) for row in rows)
    for name in ("cuda", "rocm"):
        if name in reasons:    # unchecked, saying why; or refused for the CPU without torch
            assert reasons[name].startswith("False "), out
            assert "not checked by backend='auto'" in reasons[name] or "is the CPU" in reasons[name]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux device files")
def test_a_gpu_device_file_makes_auto_check_the_torch_backends(tmp_path):
    """With a GPU's device file present, auto imports torch and asks it, as before."""
    pytest.importorskip("torch")
    node = tmp_path / "nvidia0"
    node.write_text("")
    out = _python(f"""
        import sys
        import kvcache.plugins as plugins
        plugins._GPU_DEVICE_NODES = ({str(node)!r},)
        rows = {{r["name"]: r for r in plugins._auto_rows(None)}}
        print("torch" in sys.modules)
        print(rows["cuda"]["reason"] if "cuda" in rows else "no cuda plugin")
    """)
    imported, cuda = out.splitlines()
    assert imported == "True", out
    assert "not checked by backend='auto'" not in cuda, out


def test_torch_imported_already_is_asked_as_before():
    """A torch model's Engine passes the model's device: torch is imported, its backends are
    checked for real (the cuda backend's CPU test mode is picked where it is turned on)."""
    pytest.importorskip("torch")
    out = _python("""
        import torch, kvcache
        from kvcache.plugins import _auto_rows, resolve_backend
        print(resolve_backend("auto", "cpu").name)
        print({r["name"]: r["available"] for r in _auto_rows("cpu")}.get("cuda"))
    """, KVCACHE_CUDA_CPU="1")
    name, cuda = out.splitlines()
    if cuda != "None":
        assert cuda == "True" and name in ("cuda", "rocm"), out


@pytest.mark.skipif(APPLE_SILICON, reason="MLX may give the Metal GPU here")
def test_mlx_is_not_imported_to_rank_the_metal_backend():
    pytest.importorskip("mlx.core")
    out = _python("""
        import sys, kvcache
        from kvcache.plugins import resolve_backend
        resolve_backend("auto", "cpu"); resolve_backend("auto")
        print("mlx" in sys.modules)
    """)
    assert out.strip() == "False", out
