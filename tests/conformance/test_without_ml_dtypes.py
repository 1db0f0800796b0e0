"""Without ml_dtypes the reference backend has no bfloat16; the suite then skips the bfloat16 cases
of a backend that declares bfloat16, naming the reason, and does not call that conformance."""

import os
import sys
import textwrap
from pathlib import Path

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


# Each run (a child of 5-9 s) starts when collection ends and runs on CI's second core beside the
# session (tests/cuda/background_runs.py; at once, in its test's wait, where that queue does not
# run), in an empty folder of its own.
sys.path.append(str(Path(__file__).resolve().parents[1] / "cuda"))   # tests/ has no packages
import background_runs  # noqa: E402

RUNS = {"reference": "test_reference_skips_bfloat16_by_capability",
        "declares-bf16": "test_bfloat16_backend_is_not_proven_without_the_oracle"}
for _backend, _test in RUNS.items():
    background_runs.register(_test, [sys.executable, "-c", CODE, _backend],
                             dict(os.environ, KVCACHE_PLUGINS="reference"),
                             cwd=background_runs.folder("without-ml-dtypes-"), timeout=600)


def run(backend):
    proc = background_runs.result(RUNS[backend])
    return proc.returncode, proc.stdout + proc.stderr


def test_reference_skips_bfloat16_by_capability():
    rc, out = run("reference")
    assert rc == 0, out[-4000:]
    assert BF16 and EXPECT in out
    assert "capability 'dtypes' not declared" in out and "verdict: CONFORMS (partially" in out


def test_bfloat16_backend_is_not_proven_without_the_oracle():
    rc, out = run("declares-bf16")
    assert rc == 0, out[-4000:]
    assert BF16 and EXPECT in out
    assert "the reference backend cannot store bfloat16 here: no bfloat16 storage: ml_dtypes" in out
    assert "verdict: DOES NOT CONFORM" in out
