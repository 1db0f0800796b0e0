"""Issue 30, finding 4: the error messages that tell an adopter what to install name a line that
works from a clone (kvcache is not on PyPI): each message is raised for real, in a subprocess
with the missing or outdated package faked, and its install line checked."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvcache.integrations import install_hint


def _run(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def _assert_works(message: str, extra: str):
    assert "'kvcache[" not in message and "pip install kvcache" not in message, message
    assert install_hint(extra) in message, message


def test_an_outdated_transformers_names_the_extras_requirements():
    out = _run(
        "import sys, types\n"
        "sys.modules['transformers'] = types.SimpleNamespace(__version__='4.40.0')\n"
        "try:\n"
        "    import kvcache.integrations.transformers\n"
        "except ImportError as exc:\n"
        "    print(type(exc).__name__, exc)\n")
    assert out.startswith("MissingExtraError ") and "found 4.40.0" in out, out
    _assert_works(out, "transformers")


def test_distributed_without_torch_names_the_distributed_extra():
    out = _run(
        "import sys\n"
        "sys.modules['torch'] = None; sys.modules['torch.distributed'] = None\n"
        "try:\n"
        "    import kvcache.distributed.tp\n"
        "except ImportError as exc:\n"
        "    print(type(exc).__name__, exc)\n")
    assert out.startswith("MissingExtraError ") and "torch.distributed" in out, out
    _assert_works(out, "distributed")


@pytest.mark.parametrize("name,build", [("cuda", "CUDA"), ("rocm", "ROCm")])
def test_a_gpu_backend_without_torch_names_torch(name, build):
    pytest.importorskip(f"kvcache_{name}")
    out = _run(
        "import sys; sys.modules['torch'] = None\n"
        f"import kvcache_{name}.plugin as p\n"
        "(cls,) = p.kvcache_register_backends()\n"
        "print(cls.availability()[1])\n")
    assert out.startswith("torch is not installed") and "pip install 'torch>=2.4'" in out, out
    assert f"a {build} build" in out and "'kvcache[" not in out, out
