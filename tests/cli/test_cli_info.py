"""`kvcache --version`, and `kvcache info` without importing torch, Triton or MLX: the same backends
and capabilities as `kvcache info --check`, which imports them to check availability; and the
stand-ins a listing leaves in a plugin become the real modules at their first use."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

import kvcache
from kvcache.cli import main

FRAMEWORKS = ("torch", "triton", "mlx")
IMPORTED = ("print('IMPORTED', json.dumps(sorted({m.partition('.')[0] for m in sys.modules}"
            f" & {set(FRAMEWORKS)!r})))")


def _python(code: str, **env) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _imported(out: str) -> list[str]:
    return json.loads(next(ln for ln in out.splitlines() if ln.startswith("IMPORTED "))[9:])


def _installed(*names: str) -> bool:
    return all(importlib.util.find_spec(n) is not None for n in names)


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"kvcache {kvcache.__version__}\n"
    assert kvcache.__version__ == importlib.metadata.version("kvcache")
    assert "--version" in subprocess.run([sys.executable, "-m", "kvcache.cli", "--help"],
                                         capture_output=True, text=True, timeout=60).stdout


def test_info_imports_no_framework_and_lists_what_check_lists():
    lazy = _python(f"""
        import json, sys
        from kvcache.cli import main
        assert main(["info"]) == 0
        print("JSON", flush=True)
        assert main(["info", "--json"]) == 0
        {IMPORTED}
    """)
    text, _, rest = lazy.partition("JSON\n")
    rows = json.loads(rest[:rest.index("IMPORTED ")])
    assert _imported(lazy) == [], lazy
    full = _python(f"""
        import json, sys
        from kvcache.cli import main
        assert main(["info", "--json", "--check"]) == 0
        print("DEVICE", flush=True)
        assert main(["info", "--json", "--device", "cpu"]) == 0       # --device implies --check
        {IMPORTED}
    """)
    full, _, device = full.partition("DEVICE\n")
    on_cpu = json.loads(device[:device.index("IMPORTED ")])
    assert all(isinstance(r["available"], bool) for r in on_cpu), on_cpu
    checked = json.loads(full)

    def described(listing):
        return {r["name"]: (r.get("description"), r.get("capabilities")) for r in listing}
    assert described(rows) == described(checked)              # same backends, same capabilities
    assert {"reference", "example"} <= set(described(rows))
    assert all(isinstance(r["available"], bool) for r in checked)
    by_name = {r["name"]: r for r in rows}
    assert by_name["reference"]["available"] is True            # checked: it needs no framework
    for name, framework in (("cuda", "torch"), ("rocm", "torch"), ("metal", "mlx")):
        if name in by_name and _installed(framework):
            row = by_name[name]
            if name == "metal" and sys.platform != "darwin":   # no Metal off macOS: known without MLX
                assert row["available"] is False and "no Metal device" in row["reason"], row
                continue
            assert row["available"] is None and row["reason"] == \
                f"not checked: needs {framework}, not imported", row
            assert f"\n{name:<12}" in text and "unchecked" in text
    if _installed("torch") and "cuda" in by_name:
        assert "torch" in _imported(device)                     # checking does import it
    for line in text.splitlines():                              # the capability lines as before
        if line.startswith("  tree_attention:"):
            assert line.split() in (["tree_attention:", "yes"], ["tree_attention:", "no"])


@pytest.mark.skipif(not _installed("kvcache_cuda", "torch", "kvcache_metal", "mlx"),
                    reason="needs the cuda and metal plugins with torch and MLX")
def test_the_stand_ins_become_the_real_modules():
    out = _python("""
        import sys
        from kvcache.cli import main
        from kvcache import plugins
        assert main(["info"]) == 0
        import kvcache_cuda.backend as cuda, kvcache_metal.backend as metal
        assert type(cuda.torch).__name__ == "_DeferredModule" and "torch" not in sys.modules
        import mlx.core as mx                         # imported elsewhere first: the same module
        rows = {r["name"]: r for r in plugins.list_backends("cpu")}    # outside: checked
        assert rows["cuda"]["available"] is True, rows["cuda"]         # KVCACHE_CUDA_CPU=1
        assert rows["metal"]["available"] is True and "MLX CPU device" in rows["metal"]["reason"]
        import torch
        assert cuda.torch is torch and metal.mx is mx, (cuda.torch, metal.mx)
        import kvcache, numpy as np
        cfg = kvcache.CacheConfig(num_layers=1, num_qo_heads=2, num_kv_heads=1, head_dim=16,
                                  page_size=4, max_total_tokens=64, dtype="float32")
        cache = kvcache.PagedKVCache(cfg, backend="cuda", device="cpu")
        assert isinstance(cache.from_numpy(np.zeros((2, 2, 16))), torch.Tensor)
        print("OK")
    """, KVCACHE_CUDA_CPU="1")
    assert "OK" in out
