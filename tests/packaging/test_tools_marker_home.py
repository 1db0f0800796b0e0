"""`make build-check` collects tests/packaging alone (collecting the whole suite to select the
few ``tools`` tests took 20-30 s of CI's 2 cores): so every test marked ``tools`` must live there.
This check runs in `make test`, where a ``tools`` test placed elsewhere would otherwise be left
out of both targets."""

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_tools_test_is_under_tests_packaging():
    found = [p for p in TESTS.rglob("*.py") if re.search(r"\bmark\.tools\b", p.read_text())]
    assert found, "no tools tests found: the pattern no longer matches how they are marked"
    outside = [str(p.relative_to(TESTS)) for p in found if p.parent.name != "packaging"]
    assert not outside, f"tests marked tools outside tests/packaging (make build-check would " \
                        f"not collect them; move them or widen its path): {outside}"
