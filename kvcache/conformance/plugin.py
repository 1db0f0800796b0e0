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
                               ``--kvcache-xfail FILE`` entries; strict (an unexpected pass fails),
                               and a pattern that matches no test stops the run (exit status 4)
``kvcache_poison``             "nan" (default), "large" (a huge finite value) or "none"
``kvcache_model_check``        also check the reference against the dense model (default on)

The summary table, ``--kvcache-report`` and the verdict are read from pytest's own outcomes
(``kvcache.conformance.report``): every test of the suite counted as pytest counts it, and a run
whose exit status is not 0 never reads CONFORMS.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from pathlib import Path
from typing import Optional

import pytest

from . import matrix
from .matrix import (DEFAULT_VARIANT, DTYPES, FULL_SHAPES, FULL_VARIANTS, GQA,  # noqa: F401
                     HEAD_DIMS, PAGE_SIZES, QUICK_EDGES, QUICK_SHAPES, QUICK_VALUES,
                     QUICK_VARIANTS)

PLUGIN_NAME = "kvcache.conformance.plugin"

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


SUITE_MODULES = "kvcache.conformance.test_"


def is_suite_item(item) -> bool:
    """A test of the suite: a method of a suite class, or a module-level test function of
    ``kvcache.conformance`` (also where a plugin author's test module imported them)."""
    if is_suite_class(getattr(item, "cls", None)):
        return True
    function = getattr(item, "function", None)
    return getattr(item, "cls", None) is None and \
        getattr(function, "__module__", "").startswith(SUITE_MODULES)


def pytest_configure(config):
    config._kvcache_owners = {}     # node id -> (backend, device, area, name) of a suite test
    config._kvcache_names = set()   # the suite's test names collected (the full matrix's too)
    config._kvcache_bases = set()   # their base names (Class::test, test)
    config._kvcache_checked = set()  # expected-failure lists checked for stale patterns
    config._kvcache_stale = []
    config._kvcache_seconds = {}    # (backend, area) -> [seconds, node ids]: the time table
    config._kvcache_started = time.perf_counter()
    config._kvcache_matrix = (0, 0)  # (suite tests this run selects, of the full matrix)


def pytest_itemcollected(item):
    if is_suite_item(item):
        config = item.config
        config._kvcache_names |= full_names(item)
        config._kvcache_bases.add(_base_name(item))


# ---------------------------------------------------------------------------- parametrization
def _variant_id(v):
    return f"{v[0]}-ps{v[1]}"


def _shape_id(s):
    return f"{s[0]}-gqa{s[1]}-d{s[2]}-ps{s[3]}"


def pytest_generate_tests(metafunc):
    if not is_suite_class(metafunc.cls):
        return
    # the full matrix always: the quick one deselects (pytest_collection_modifyitems), so both
    # name their tests the same and a quick run knows every name of the full one
    if "shape" in metafunc.fixturenames:
        metafunc.parametrize("shape", FULL_SHAPES, ids=[_shape_id(s) for s in FULL_SHAPES])
    elif "variant" in metafunc.fixturenames:
        metafunc.parametrize("variant", FULL_VARIANTS,
                             ids=[_variant_id(v) for v in FULL_VARIANTS])


def in_quick_matrix(item) -> bool:
    """Whether the quick matrix runs this test of the suite (``matrix.in_quick_matrix``)."""
    return matrix.in_quick_matrix(item, _base_name(item))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    """The quick matrix (default): deselect the suite's tests it does not run, before ``-k``."""
    suite = [item for item in items if is_suite_item(item)]
    config._kvcache_matrix = (len(suite), len(suite))
    drop = [] if _full(config) else [item for item in suite if not in_quick_matrix(item)]
    if drop:
        dropped = set(map(id, drop))
        items[:] = [item for item in items if id(item) not in dropped]
        config.hook.pytest_deselected(items=drop)
    config._kvcache_matrix = (len(suite) - len(drop), len(suite))


@pytest.hookimpl(trylast=True, specname="pytest_collection_modifyitems")
def pytest_collection_modifyitems_shard(session, config, items) -> None:
    """A worker of a parallel run (``--kvcache-shard I/N``) keeps every N-th of the selected
    suite tests (after the quick matrix and ``-k``), from the I-th (the tests of a class spread over the workers, so slow classes
    do not pile up on one); tests outside the suite stay with worker 0."""
    shard = _opt(config, "kvcache_shard", None)
    if not shard:
        return
    index, count = parse_shard(shard)
    keep: list = []
    drop: list = []
    n = 0
    for item in items:
        if is_suite_item(item):
            (keep if n % count == index else drop).append(item)
            n += 1
        else:
            (keep if index == 0 else drop).append(item)
    if drop:
        items[:] = keep
        config.hook.pytest_deselected(items=drop)
    selected, whole = config._kvcache_matrix
    config._kvcache_matrix = (len([item for item in keep if is_suite_item(item)]), whole)


def parse_shard(text: str) -> tuple:
    """``"I/N"`` -> (I, N), 0 <= I < N; a ``pytest.UsageError`` otherwise."""
    try:
        index, count = (int(v) for v in str(text).split("/"))
    except ValueError:
        raise pytest.UsageError(f"--kvcache-shard {text!r}: expected I/N, e.g. 0/4") from None
    if not 0 <= index < count:
        raise pytest.UsageError(f"--kvcache-shard {text!r}: I must be in 0..N-1")
    return index, count


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
    return DEFAULT_VARIANT


def suite_name(item) -> str:
    """``Class::test[params]`` (``test[params]`` for a module-level test): what expected-failure
    patterns match."""
    cls = getattr(item, "cls", None)
    return f"{cls.__name__}::{item.name}" if cls is not None else item.name


def _base_name(item) -> str:
    cls = getattr(item, "cls", None)
    name = getattr(item, "originalname", item.name)
    return f"{cls.__name__}::{name}" if cls is not None else name


def area_of(item) -> str:
    """The row of the summary table: the test class, or the module of a module-level test."""
    cls = getattr(item, "cls", None)
    if cls is not None:
        return cls.__name__
    module = getattr(getattr(item, "function", None), "__module__", "") or ""
    return module.rsplit(".", 1)[-1] or "-"


def full_names(item) -> set:
    """The names a test has in the quick and the full matrix (expected-failure patterns may name
    either), and its base name."""
    base, name = _base_name(item), suite_name(item)
    out = {base, name}
    spec = getattr(item, "callspec", None)
    params = getattr(spec, "params", {})
    bracket = name[len(base):]          # "[float32-ps16-normal]"
    for key, values, ident in (("variant", FULL_VARIANTS, _variant_id),
                               ("shape", FULL_SHAPES, _shape_id)):
        if key in params:
            own = "[" + ident(params[key])
            if bracket.startswith(own):
                rest = bracket[len(own):]
                out |= {f"{base}[{ident(v)}{rest}" for v in values}
    return out


def pattern_matches(pattern: str, name: str) -> bool:
    """An expected-failure pattern against ``Class::test[params]`` or ``Class::test``: ``*``
    matches any text and ``?`` one character; everything else, brackets included, is literal
    (``TestMatrix::test_workload[bfloat16-*]`` names the bfloat16 rows)."""
    return _pattern_regex(pattern).fullmatch(name) is not None


_REGEXES: dict = {}


def _pattern_regex(pattern: str):
    rx = _REGEXES.get(pattern)
    if rx is None:
        rx = _REGEXES[pattern] = re.compile("".join(
            ".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern), re.S)
    return rx


def _suite_base_names() -> set:
    """``Class::test`` and ``test`` of everything the suite exports."""
    import kvcache.conformance as suite
    out = set()
    for name in suite.__all__:
        obj = getattr(suite, name)
        if isinstance(obj, type):
            out |= {f"{name}::{m}" for m in dir(obj) if m.startswith("test")}
        else:
            out.add(name)
    return out


def stale_patterns(config, patterns) -> list:
    """The patterns that match no test of the suite: none of the tests collected in this run (in
    the quick or the full matrix), and no test of the suite this run did not collect (a run of
    one file, say, cannot tell those apart)."""
    names: set = getattr(config, "_kvcache_names", set())
    uncollected = _suite_base_names() - getattr(config, "_kvcache_bases", set())
    stale = []
    for pattern in patterns:
        if any(pattern_matches(pattern, n) for n in names):
            continue
        base = pattern.split("[", 1)[0]
        if any(pattern_matches(base, n) for n in uncollected):
            continue
        stale.append(pattern)
    return stale


def _check_stale(config, failures: dict) -> None:
    """Stop the run (exit status 4, a usage error) when an expected-failure pattern matches no
    test: a renamed test or a typo would otherwise hide nothing and pass silently."""
    key = tuple(sorted(failures))
    if key in config._kvcache_checked:
        return
    config._kvcache_checked.add(key)
    stale = stale_patterns(config, failures)
    if stale:
        config._kvcache_stale += [p for p in stale if p not in config._kvcache_stale]
        lines = "\n".join(f"  {p!r}  # {failures[p]}" for p in stale)
        pytest.exit(f"kvcache conformance: expected-failure patterns that match no test of the "
                    f"suite (remove or correct them; patterns match Class::test[params] or "
                    f"Class::test):\n{lines}", returncode=pytest.ExitCode.USAGE_ERROR)


@pytest.fixture(autouse=True)
def _kvcache_expected_failure(request):
    item = request.node
    if not is_suite_item(item):
        return
    failures = request.getfixturevalue("kvcache_expected_failures")
    if not failures:
        return
    _check_stale(request.config, failures)
    full, base = suite_name(item), _base_name(item)
    for pattern, reason in failures.items():
        if pattern_matches(pattern, full) or pattern_matches(pattern, base):
            item.add_marker(pytest.mark.xfail(strict=True, reason=f"expected failure: {reason}"))
            break


def skip_unless(capabilities, name: str, detail: str = "") -> None:
    """Skip the running test, naming the capability, unless the backend declares it."""
    from kvcache import Capabilities
    value = getattr(capabilities, name)
    if not value:
        pytest.skip(Capabilities.reason(name) + (f" [{detail}]" if detail else ""))


def skip_declared(capabilities, name: str, checked_by: str) -> None:
    """Skip a test that checks an undeclared feature is refused, on a backend that declares the
    feature (``checked_by`` tests it instead). Not applicable: the verdict is unaffected."""
    if getattr(capabilities, name):
        pytest.skip(f"capability {name!r} declared (not applicable: this test checks that a "
                    f"backend without it refuses it; {checked_by} tests the feature)")


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
@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Files each report of a suite test under its backend, device and area (the summary reads
    the reports themselves from pytest's own tally, ``terminalreporter.stats``)."""
    report = yield
    if is_suite_item(item):
        funcargs = getattr(item, "funcargs", {})
        backend = funcargs.get("kvcache_backend")
        if backend is None:
            backend = _opt(item.config, "kvcache_backend", "reference")
        device = funcargs.get("kvcache_device")
        if device is None and "kvcache_backend" not in funcargs:
            device = _opt(item.config, "kvcache_device", None)
        item.config._kvcache_owners[item.nodeid] = (backend, device, area_of(item),
                                                    suite_name(item))
        spent = item.config._kvcache_seconds.setdefault((backend, area_of(item)), [0.0, set()])
        spent[0] += getattr(report, "duration", 0.0) or 0.0      # setup, call and teardown
        spent[1].add(item.nodeid)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_report_header(config, start_path):
    """``kvcache conformance`` runs pytest with ``-c /dev/null`` (no configuration file of the
    directory it runs in applies); the header does not name that non-file."""
    results = yield
    if config.inipath is not None and str(config.inipath) == os.path.abspath(os.devnull):
        results = [[line for line in lines if not line.startswith("configfile: ")]
                   if isinstance(lines, list) else lines for lines in results]
    return results


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The summary table and the time table (and ``--kvcache-report``), from pytest's own
    outcomes; a worker of a parallel run (``--kvcache-dump``) writes its record for the run that
    started it instead (``kvcache.conformance.parallel``)."""
    from .report import finish
    owners = getattr(config, "_kvcache_owners", {})
    reports = _opt(config, "kvcache_report", None) or []
    if isinstance(reports, str):
        reports = [f for f in reports.split(os.pathsep) if f]
    asked = _opt(config, "kvcache_backend", None) is not None    # a run of the suite by name
    stale = getattr(config, "_kvcache_stale", [])
    if not (owners or reports or asked or stale):    # e.g. a project's tests, the suite deselected
        return
    record = run_record(terminalreporter.stats, exitstatus, config)
    dump = _opt(config, "kvcache_dump", None)
    if dump:
        Path(dump).write_text(json.dumps(record))
        return
    finish([record], _full(config), reports, terminalreporter.section,
           terminalreporter.write_line)


def run_record(stats: dict, exitstatus, config) -> dict:
    """This run's results as plain data: its outcomes (``report.Outcome`` fields), pytest's exit
    status, stale expected-failure patterns, the seconds per (backend, area) with their tests,
    (suite tests selected, of the full matrix) and the wall time."""
    from .report import outcomes_from_stats
    seconds = getattr(config, "_kvcache_seconds", {})
    return {"outcomes": [dataclasses.asdict(o) for o in
                         outcomes_from_stats(stats, getattr(config, "_kvcache_owners", {}))],
            "exitstatus": int(exitstatus), "stale": list(getattr(config, "_kvcache_stale", [])),
            "seconds": [[backend, area, spent, sorted(ids)]
                        for (backend, area), (spent, ids) in seconds.items()],
            "matrix": list(getattr(config, "_kvcache_matrix", (0, 0))),
            "wall": time.perf_counter() - config._kvcache_started}
