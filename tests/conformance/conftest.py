"""Runs the conformance suite (kvcache.conformance) inside ``make test`` on every backend that is
registered and available here, each on the device CI uses for it.

``KVCACHE_TEST_BACKENDS`` limits or extends the list: comma-separated ``name`` or ``name:device``
(e.g. ``reference,example,metal:cpu``). Without it: every available backend except the planted
``example-broken-*`` ones and those of ``ELSEWHERE``, on the device from ``DEVICES`` (default
device otherwise).
"""

import os

import pytest

# Where a backend runs in CI when no device is named. Add entries here, e.g. "cuda": "cuda:0".
DEVICES = {"metal": "cpu"}

# Backends whose whole quick matrix another test of the suite runs already, by name: the
# reference's runs through `kvcache conformance` as a plugin author starts it
# (tests/cli/test_adopter_conformance.py: exit status 0, verdict, every skip's kind, no warning),
# so a failing reference test fails there; running it here too cost CI about 30 s of CPU.
# KVCACHE_TEST_BACKENDS=reference runs it here.
ELSEWHERE = {"reference": "tests/cli/test_adopter_conformance.py"}


def _targets():
    import kvcache
    spec = os.environ.get("KVCACHE_TEST_BACKENDS")
    if spec:
        out = []
        for item in spec.split(","):
            name, _, device = item.strip().partition(":")
            if name:
                out.append((name, device or None))
        return out
    out = []
    for row in kvcache.list_backends():
        name = row["name"]
        if row["class"] is None or name.startswith("example-broken") or name in ELSEWHERE:
            continue
        device = DEVICES.get(name)
        available = row["available"] if device is None else bool(row["class"].availability(device)[0])
        if available:
            out.append((name, device))
    return out


TARGETS = _targets()


def pytest_addoption(parser, pluginmanager):
    from kvcache.conformance.plugin import register
    register(pluginmanager)


@pytest.fixture(scope="session", params=TARGETS,
                ids=[n if d is None else f"{n}@{d}" for n, d in TARGETS])
def kvcache_target(request):
    return request.param


@pytest.fixture(scope="session")
def kvcache_backend(kvcache_target):
    return kvcache_target[0]


@pytest.fixture(scope="session")
def kvcache_device(kvcache_target):
    return kvcache_target[1]
