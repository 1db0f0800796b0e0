"""The pytest plugin of the conformance suite: fixtures, parametrization, expected failures,
summary.

Opt-in, never autoloaded (kvcache registers nothing with pytest on install). A run opts in with:

* ``kvcache conformance --backend NAME`` (the CLI loads it for you);
* ``pytest -p kvcache.conformance.plugin --pyargs kvcache.conformance --kvcache-backend NAME``
  (this module defines the ``--kvcache-*`` options, from ``kvcache.conformance.options``);
* ``KVCACHE_CONFORMANCE_BACKEND=NAME pytest --pyargs kvcache.conformance`` (the package's
  ``conftest.py`` registers this module);
* ``pytest_plugins = ["kvcache.conformance.plugin"]`` in a plugin author's root ``conftest.py``
  or test module (see ``docs/plugin-guide.md``).

Fixtures a plugin author may override (all session-scoped):

``kvcache_backend``            backend name (option ``--kvcache-backend``, env
                               ``KVCACHE_CONFORMANCE_BACKEND``, default ``reference``)
``kvcache_device``             device or None (``--kvcache-device``, ``KVCACHE_CONFORMANCE_DEVICE``)
``kvcache_expected_failures``  {pattern: reason}: the backend class's ``conformance_xfail`` plus
                               ``--kvcache-xfail FILE`` entries; strict (an unexpected pass fails)
``kvcache_poison``             "nan" (default), "large" (a huge finite value) or "none"
``kvcache_model_check``        also check the reference against the dense model (default on)
"""

from __future__ import annotations

import fnmatch
import itertools
import json
import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Optional

import pytest

PLUGIN_NAME = "kvcache.conformance.plugin"

DTYPES = ("float32", "float16", "bfloat16")
GQA = (1, 4, 8)
HEAD_DIMS = (64, 80, 96, 128, 256)
PAGE_SIZES = (1, 16, 32)

# Operation tests run on these (dtype, page_size) variants; the shape matrix below covers the
# other axis values. Quick: every axis value at least once over the whole suite.
QUICK_VARIANTS = [("float32", 16), ("float16", 1)]
FULL_VARIANTS = list(itertools.product(DTYPES, PAGE_SIZES))
# (dtype, gqa, head_dim, page_size); the quick rows form a Latin square over the four axes.
QUICK_SHAPES = [("float32", 1, 64, 1), ("float16", 4, 128, 16), ("bfloat16", 8, 256, 32),
                ("bfloat16", 4, 64, 16), ("float32", 4, 80, 16), ("float16", 8, 96, 1)]
FULL_SHAPES = list(itertools.product(DTYPES, GQA, HEAD_DIMS, PAGE_SIZES))

_ENV = {"kvcache_backend": "KVCACHE_CONFORMANCE_BACKEND",
        "kvcache_device": "KVCACHE_CONFORMANCE_DEVICE",
        "kvcache_full": "KVCACHE_CONFORMANCE_FULL",
        "kvcache_xfail": "KVCACHE_CONFORMANCE_XFAIL",
        "kvcache_poison": "KVCACHE_CONFORMANCE_POISON",
        "kvcache_report": "KVCACHE_CONFORMANCE_REPORT",
        "kvcache_ballast": "KVCACHE_CONFORMANCE_BALLAST"}


def register(pluginmanager) -> None:
    """Register this plugin once (used by conftest files that want the suite's fixtures)."""
    if not pluginmanager.has_plugin(PLUGIN_NAME):
        import sys
        pluginmanager.register(sys.modules[__name__], PLUGIN_NAME)


def pytest_addoption(parser):
    # defined once, in kvcache.conformance.options; adding them again is a no-op
    from .options import add_options
    add_options(parser)


def _opt(config, name: str, default=None):
    value = config.getoption(name, default=None)
    if value is None and name in _ENV:
        value = os.environ.get(_ENV[name]) or None
    return default if value is None else value


def _full(config) -> bool:
    value = _opt(config, "kvcache_full", False)
    if isinstance(value, str):
        value = value.lower() not in ("", "0", "false", "no")
    return bool(value)


def is_suite_class(cls) -> bool:
    from .base import Conformance
    return isinstance(cls, type) and issubclass(cls, Conformance)


def pytest_configure(config):
    config._kvcache_results = []   # (backend, device, area, name, outcome, detail)
    config._kvcache_xfail_used = set()


# ---------------------------------------------------------------------------- parametrization
def _variant_id(v):
    return f"{v[0]}-ps{v[1]}"


def _shape_id(s):
    return f"{s[0]}-gqa{s[1]}-d{s[2]}-ps{s[3]}"


def pytest_generate_tests(metafunc):
    if not is_suite_class(metafunc.cls):
        return
    full = _full(metafunc.config)
    if "shape" in metafunc.fixturenames:
        shapes = FULL_SHAPES if full else QUICK_SHAPES
        metafunc.parametrize("shape", shapes, ids=[_shape_id(s) for s in shapes])
    elif "variant" in metafunc.fixturenames:
        variants = FULL_VARIANTS if full else QUICK_VARIANTS
        metafunc.parametrize("variant", variants, ids=[_variant_id(v) for v in variants])


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def kvcache_backend(request) -> str:
    return _opt(request.config, "kvcache_backend", "reference")


@pytest.fixture(scope="session")
def kvcache_device(request) -> Optional[str]:
    return _opt(request.config, "kvcache_device", None)


@pytest.fixture(scope="session")
def kvcache_backend_class(kvcache_backend, kvcache_device):
    """The class of the backend under test (an error if it is not available here)."""
    from kvcache.plugins import resolve_backend
    return resolve_backend(kvcache_backend, kvcache_device)


def parse_expected_failures(text: str, source: str = "") -> dict:
    """``pattern  # reason`` lines (blank lines and ``#`` lines ignored) -> {pattern: reason}."""
    out = {}
    for line in text.splitlines():
        body, _, reason = line.partition("#")
        body = body.strip()
        if body:
            out[body] = reason.strip() or f"listed in {source or 'the expected-failure list'}"
    return out


def backend_expected_failures(cls) -> dict:
    """A backend's shipped list: class attribute ``conformance_xfail`` (a dict pattern -> reason,
    an iterable of lines, or a text / path of a file of lines)."""
    spec = getattr(cls, "conformance_xfail", None)
    if not spec:
        return {}
    if isinstance(spec, dict):
        return dict(spec)
    if isinstance(spec, (str, os.PathLike)):
        path = Path(spec)
        if "\n" not in str(spec) and path.is_file():
            return parse_expected_failures(path.read_text(), str(path))
        return parse_expected_failures(str(spec), f"{cls.name}.conformance_xfail")
    return parse_expected_failures("\n".join(spec), f"{cls.name}.conformance_xfail")


@pytest.fixture(scope="session")
def kvcache_expected_failures(request, kvcache_backend_class) -> dict:
    out = backend_expected_failures(kvcache_backend_class)
    files = _opt(request.config, "kvcache_xfail", None) or []
    if isinstance(files, str):
        files = [f for f in files.split(os.pathsep) if f]
    for f in files:
        out.update(parse_expected_failures(Path(f).read_text(), f))
    return out


@pytest.fixture(scope="session")
def kvcache_poison(request) -> str:
    return _opt(request.config, "kvcache_poison", "nan")


@pytest.fixture(scope="session")
def kvcache_model_check(request) -> bool:
    return not _opt(request.config, "kvcache_no_model", False)


@pytest.fixture
def variant():
    """(dtype, page_size) of an operation test (parametrized by the plugin)."""
    return QUICK_VARIANTS[0]


def suite_name(item) -> str:
    cls = getattr(item, "cls", None)
    return f"{cls.__name__}::{item.name}" if cls is not None else item.name


def _base_name(item) -> str:
    cls = getattr(item, "cls", None)
    name = getattr(item, "originalname", item.name)
    return f"{cls.__name__}::{name}" if cls is not None else name


@pytest.fixture(autouse=True)
def _kvcache_expected_failure(request):
    item = request.node
    if not is_suite_class(getattr(item, "cls", None)):
        return
    failures = request.getfixturevalue("kvcache_expected_failures")
    full, base = suite_name(item), _base_name(item)
    for pattern, reason in failures.items():
        if fnmatch.fnmatchcase(full, pattern) or fnmatch.fnmatchcase(base, pattern):
            request.config._kvcache_xfail_used.add(pattern)
            item.add_marker(pytest.mark.xfail(strict=True, reason=f"expected failure: {reason}"))
            break


def skip_unless(capabilities, name: str, detail: str = "") -> None:
    """Skip the running test, naming the capability, unless the backend declares it."""
    from kvcache import Capabilities
    value = getattr(capabilities, name)
    if not value:
        pytest.skip(Capabilities.reason(name) + (f" [{detail}]" if detail else ""))


@pytest.fixture
def make_pair(request, variant, kvcache_backend, kvcache_device, kvcache_backend_class,
              kvcache_poison, kvcache_model_check):
    """Factory: ``make_pair(needs=(capability, ...), **config)`` -> ``CachePair``. Skips, naming
    the capability, when the backend does not declare what the config needs."""
    from .harness import CachePair
    return _pair_factory(request, variant, kvcache_backend_class, lambda config, seed: CachePair(
        config, kvcache_backend, kvcache_device, seed=seed, poison=kvcache_poison,
        model=kvcache_model_check))


@pytest.fixture
def run_ahead(request, variant, kvcache_backend, kvcache_device, kvcache_backend_class,
              kvcache_poison):
    """Factory: ``run_ahead(needs=(...), **config)`` -> ``RunAhead``. The ballast prefill is
    ``--kvcache-ballast`` tokens (default: 4096 on an accelerator, 64 on a CPU device, where
    nothing runs ahead and a long prefill would only cost time)."""
    from .harness import RunAhead
    tokens = _opt(request.config, "kvcache_ballast", None)
    return _pair_factory(request, variant, kvcache_backend_class, lambda config, seed: RunAhead(
        config, kvcache_backend, kvcache_device, seed=seed, poison=kvcache_poison,
        ballast_tokens=None if tokens is None else int(tokens)))


def _pair_factory(request, variant, backend_class, build):
    """``factory(needs=(), **config)``: the config of the running test's variant with
    ``config`` applied, skipped by capability where the backend lacks what it needs, then
    ``build(config, seed)``."""
    from kvcache import Capabilities
    from kvcache.reference import BFLOAT16_MISSING, ReferenceBackend

    from .harness import make_config, seed_for

    caps = backend_class.capabilities
    base_seed = _opt(request.config, "kvcache_seed", 0)

    def factory(needs=(), **overrides):
        kw = {"dtype": variant[0], "page_size": variant[1]}
        kw.update(overrides)
        if kw["dtype"] not in caps.dtypes:
            pytest.skip(Capabilities.reason("dtypes") + f" [{kw['dtype']} not in {caps.dtypes}]")
        if kw["dtype"] not in ReferenceBackend.capabilities.dtypes:
            # No oracle for this dtype here (bfloat16 without ml_dtypes): not proven, so this is
            # deliberately not a capability skip and the verdict says DOES NOT CONFORM.
            pytest.skip(f"the reference backend cannot store {kw['dtype']} here: "
                        f"{BFLOAT16_MISSING or 'not in its capabilities'}")
        head_dim = kw.get("head_dim", 64)
        if head_dim not in caps.head_dims:
            pytest.skip(Capabilities.reason("head_dims") + f" [{head_dim}]")
        config = make_config(**kw)
        if config.head_dim_v != config.head_dim and config.head_dim_v not in caps.head_dims_v:
            pytest.skip(Capabilities.reason("head_dims_v") + f" [{config.head_dim_v}]")
        if config.kv_dtype not in caps.kv_dtypes:
            pytest.skip(Capabilities.reason("kv_dtypes") + f" [{config.kv_dtype}]")
        if config.support_sliding_window:
            skip_unless(caps, "sliding_window")
        if config.effective_rope_mode == "inline":
            skip_unless(caps, "inline_rope", "rope_mode inline" if config.rope_mode == "inline"
                        else "sliding window with RoPE")
        if config.effective_rope_mode != "none" and not config.rope_spec().default_frequencies:
            skip_unless(caps, "rope_frequencies")
        for name in needs:
            skip_unless(caps, name)
        return build(config, seed_for(suite_name(request.node), int(base_seed)))

    return factory


@pytest.fixture
def busy(make_pair):
    """A pair holding three sequences: 0 (two pages and a bit), 1 (forked from 0), 2 (short)."""
    p = make_pair()
    ps = p.config.page_size
    p.add(0, 2)
    p.forward([0, 2], [2 * ps + 3, 4])
    p.fork(0, 1, ps + 1)
    return p


# ---------------------------------------------------------------------------- reporting
_CAP = re.compile(r"capability '(\w+)'")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if not is_suite_class(getattr(item, "cls", None)):
        return report
    outcome = None
    detail = ""
    if report.when == "call" or (report.when == "setup" and not report.passed):
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
            detail = report.wasxfail
        elif report.skipped:
            outcome = "skipped"
            longrepr = report.longrepr
            detail = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        elif report.failed:
            outcome = "failed" if report.when == "call" else "error"
            if "XPASS(strict)" in str(report.longrepr):
                outcome = "xpassed(strict)"
            crash = getattr(report.longrepr, "reprcrash", None)
            detail = (crash.message if crash is not None else str(report.longrepr)).splitlines()
            detail = detail[0][:300] if detail else ""
        else:
            outcome = "passed"
    if outcome is not None:
        backend = item.funcargs.get("kvcache_backend") if hasattr(item, "funcargs") else None
        device = item.funcargs.get("kvcache_device") if hasattr(item, "funcargs") else None
        if backend is None:
            backend = _opt(item.config, "kvcache_backend", "reference")
        area = item.cls.__name__ if getattr(item, "cls", None) else "-"
        item.config._kvcache_results.append(
            (backend, device, area, suite_name(item), outcome, detail))
    return report


def summarize(results) -> dict:
    """{backend: {"device", "areas": {area: counts}, "total": counts, "capabilities": {...},
    "other_skips": [...], "failures": [...]}}."""
    out: dict[str, dict] = {}
    for backend, device, area, name, outcome, detail in results:
        b = out.setdefault(backend, {"device": device, "areas": {}, "capabilities": defaultdict(int),
                                     "other_skips": [], "failures": [], "xfailed": []})
        counts = b["areas"].setdefault(area, dict.fromkeys(
            ("passed", "failed", "xfailed", "skipped"), 0))
        if outcome == "passed":
            counts["passed"] += 1
        elif outcome in ("failed", "error", "xpassed(strict)"):
            counts["failed"] += 1
            b["failures"].append((name, "unexpected pass (listed as an expected failure)"
                                  if outcome == "xpassed(strict)" else detail))
        elif outcome in ("xfailed", "xpassed"):
            counts["xfailed" if outcome == "xfailed" else "passed"] += 1
            if outcome == "xfailed":
                b["xfailed"].append((name, detail))
        elif outcome == "skipped":
            counts["skipped"] += 1
            m = _CAP.search(detail)
            if m:
                b["capabilities"][m.group(1)] += 1
            else:
                b["other_skips"].append((name, detail))
    for b in out.values():
        total = dict.fromkeys(("passed", "failed", "xfailed", "skipped"), 0)
        for counts in b["areas"].values():
            for k, v in counts.items():
                total[k] += v
        b["total"] = total
        b["capabilities"] = dict(b["capabilities"])
    return out


def format_summary(summary: dict, full: bool) -> list[str]:
    from kvcache import Capabilities
    lines = []
    for backend, b in summary.items():
        dev = b["device"] or "default device"
        lines.append(f"backend {backend!r} on {dev} ({'full' if full else 'quick'} matrix)")
        lines.append(f"  {'area':<22}{'passed':>8}{'failed':>8}{'xfail':>8}{'skipped':>9}")
        for area, c in sorted(b["areas"].items()):
            lines.append(f"  {area:<22}{c['passed']:>8}{c['failed']:>8}{c['xfailed']:>8}{c['skipped']:>9}")
        t = b["total"]
        lines.append(f"  {'total':<22}{t['passed']:>8}{t['failed']:>8}{t['xfailed']:>8}{t['skipped']:>9}")
        if b["capabilities"]:
            lines.append("  skipped by capability:")
            for cap, n in sorted(b["capabilities"].items()):
                lines.append(f"    {n:>4}  {Capabilities.reason(cap)}")
        if b["other_skips"]:
            lines.append(f"  skipped for a reason other than a capability ({len(b['other_skips'])}):")
            for name, why in b["other_skips"][:10]:
                lines.append(f"    {name}: {why}")
        if b["failures"]:
            lines.append(f"  failed ({len(b['failures'])}):")
            for name, why in b["failures"][:20]:
                lines.append(f"    {name}: {why}")
            if len(b["failures"]) > 20:
                lines.append(f"    ... and {len(b['failures']) - 20} more")
        verdict = "CONFORMS" if not t["failed"] and not b["other_skips"] else "DOES NOT CONFORM"
        if verdict == "CONFORMS" and (t["xfailed"] or b["capabilities"]):
            verdict += " (partially: see expected failures and capability skips)"
        lines.append(f"  verdict: {verdict}")
    return lines


def write_report(path: str, summary: dict, full: bool) -> None:
    p = Path(path)
    if p.suffix == ".json":
        p.write_text(json.dumps({"matrix": "full" if full else "quick", "backends": summary},
                                indent=2, default=str) + "\n")
    else:
        lines = ["# kvcache conformance results", ""]
        for backend, b in summary.items():
            lines += [f"## `{backend}` ({b['device'] or 'default device'}, "
                      f"{'full' if full else 'quick'} matrix)", "",
                      "| area | passed | failed | expected failures | skipped |",
                      "|---|---:|---:|---:|---:|"]
            for area, c in sorted(b["areas"].items()):
                lines.append(f"| {area} | {c['passed']} | {c['failed']} | {c['xfailed']} | {c['skipped']} |")
            t = b["total"]
            lines.append(f"| **total** | {t['passed']} | {t['failed']} | {t['xfailed']} | {t['skipped']} |")
            if b["capabilities"]:
                lines += ["", "Skipped by capability: " + ", ".join(
                    f"`{k}` ({v})" for k, v in sorted(b["capabilities"].items()))]
            if b["xfailed"]:
                lines += ["", "Expected failures:"] + [f"- `{n}`: {r}" for n, r in b["xfailed"]]
            lines.append("")
        p.write_text("\n".join(lines))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    results = getattr(config, "_kvcache_results", None)
    if not results:
        return
    full = _full(config)
    summary = summarize(results)
    terminalreporter.section("kvcache conformance summary")
    for line in format_summary(summary, full):
        terminalreporter.write_line(line)
    report = _opt(config, "kvcache_report", None)
    if report:
        write_report(report, summary, full)
        terminalreporter.write_line(f"report written to {report}")
