"""Naming a backend loads that plugin alone: ``backend="reference"`` imports neither torch nor MLX
(nor any other backend's plugin); ``"auto"`` and ``kvcache info`` still ask every plugin."""

import json
import os
import subprocess
import sys
import textwrap

HEAVY = ("torch", "mlx", "triton", "kvcache_cuda", "kvcache_rocm", "kvcache_metal")


def _run(body: str) -> dict:
    code = textwrap.dedent("""
        import json, sys
        import kvcache
        cfg = kvcache.CacheConfig(num_layers=1, num_qo_heads=2, num_kv_heads=1, head_dim=8,
                                  page_size=4, max_total_tokens=64, max_batch_size=2,
                                  dtype="float32", rope_mode="none")
    """) + textwrap.dedent(body) + textwrap.dedent("""
        print(json.dumps({m: m in sys.modules for m in %r}))
    """ % (HEAVY,))
    env = {k: v for k, v in os.environ.items() if k != "KVCACHE_PLUGINS"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_named_reference_backend_imports_no_framework():
    loaded = _run("""
        cache = kvcache.PagedKVCache(cfg, backend="reference")
        assert cache.backend.name == "reference"
    """)
    assert not any(loaded.values()), loaded


def test_a_command_naming_the_reference_backend_imports_no_framework():
    # `kvcache conformance --backend reference` / `kvcache demo --backend reference` resolve the
    # name through the named plugin alone (each spawned command paid seconds of torch imports)
    loaded = _run("""
        from kvcache.cli_kit import backend_for
        assert backend_for("reference").name == "reference"
    """)
    assert not any(loaded.values()), loaded


def test_auto_and_listing_still_ask_every_plugin():
    loaded = _run("""
        names = [row["name"] for row in kvcache.list_backends()]
        assert "reference" in names and "cuda" in names, names
    """)
    assert loaded["kvcache_cuda"], loaded     # the cuda plugin was loaded to be asked
