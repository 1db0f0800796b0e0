"""Without ml_dtypes the reference backend has no bfloat16; the suite then skips the bfloat16 cases
of a backend that declares bfloat16, naming the reason, and does not call that conformance."""

import os
import subprocess
import sys
import textwrap

from kvcache.conformance.plugin import QUICK_SHAPES

BF16 = sum(1 for shape in QUICK_SHAPES if shape[0] == "bfloat16")
EXPECT = f"{len(QUICK_SHAPES) - BF16} passed, {BF16} skipped"

CODE = textwrap.dedent("""
    import dataclasses
    import sys

    sys.modules["ml_dtypes"] = None          # as if ml_dtypes were not installed

    import pytest

    import kvcache
    from kvcache.plugins import register_plugin
    from kvcache.reference import ReferenceBackend

    class DeclaresBf16(ReferenceBackend):
        name = "declares-bf16"
        capabilities = dataclasses.replace(ReferenceBackend.capabilities,
                                           dtypes=("float16", "bfloat16", "float32"))

    class Plugin:
        @kvcache.hookimpl
        def kvcache_register_backends(self):
            return [DeclaresBf16]

    register_plugin(Plugin(), name="declares-bf16")
    sys.exit(pytest.main(["-p", "no:cacheprovider", "--pyargs", "kvcache.conformance",
                          "--kvcache-backend", sys.argv[1], "-k", "TestMatrix", "-q",
                          "-p", "kvcache.conformance.plugin"]))
""")


def run(backend, tmp_path):
    proc = subprocess.run([sys.executable, "-c", CODE, backend], capture_output=True, text=True,
                          cwd=str(tmp_path), timeout=600,
                          env=dict(os.environ, KVCACHE_PLUGINS="reference"))
    return proc.returncode, proc.stdout + proc.stderr


def test_reference_skips_bfloat16_by_capability(tmp_path):
    rc, out = run("reference", tmp_path)
    assert rc == 0, out[-4000:]
    assert BF16 and EXPECT in out
    assert "capability 'dtypes' not declared" in out and "verdict: CONFORMS (partially" in out


def test_bfloat16_backend_is_not_proven_without_the_oracle(tmp_path):
    rc, out = run("declares-bf16", tmp_path)
    assert rc == 0, out[-4000:]
    assert BF16 and EXPECT in out
    assert "the reference backend cannot store bfloat16 here: no bfloat16 storage: ml_dtypes" in out
    assert "verdict: DOES NOT CONFORM" in out
