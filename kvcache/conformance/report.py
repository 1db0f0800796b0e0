"""The conformance summary, read from pytest's own outcomes.

One source: the reports pytest itself counts for its final line (``terminalreporter.stats``: every
test report of every category, module-level tests, setup and teardown errors and collection errors
included). Each report is filed under the backend and the area of the suite's test it belongs to,
or under "outside the suite"; so the counts of the summary table, of ``--report`` (Markdown and
JSON) and of pytest's ``N passed, M failed`` line are the same numbers, and the verdict takes
pytest's exit status into account: a failed run never reads CONFORMS.

Skips fall into three kinds, told apart by their reason:

* ``capability 'X' not declared (...)``: a feature the backend does not claim (``skip_unless``,
  the config factory); the verdict can still be CONFORMS (partially);
* ``capability 'X' declared (...)``: a check that an undeclared feature is refused, on a backend
  that declares it (``skip_declared``): not applicable, the feature's own tests run instead;
* anything else (no oracle for a dtype here, a skip in a fixture of the plugin author's): the
  suite could not prove what it skipped, so the verdict is DOES NOT CONFORM.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

CAPABILITY = re.compile(r"capability '(\w+)' not declared")
DECLARED = re.compile(r"capability '(\w+)' declared")
COLUMNS = ("passed", "failed", "error", "xfailed", "skipped")
# pytest's order of the categories in its final line
PYTEST_ORDER = ("failed", "passed", "skipped", "deselected", "xfailed", "xpassed", "warnings",
                "error")
NOT_OUTCOMES = ("", "warnings", "deselected")   # setup/teardown passes, warnings, -k/-m drops
EXIT_MEANING = {0: "all tests passed", 1: "tests failed", 2: "interrupted",
                3: "internal error", 4: "usage error", 5: "no tests collected"}
OUTSIDE = "(not the suite)"
DECLARED_TITLE = "not applicable (the backend declares the capability whose refusal they check)"
OTHER_TITLE = "skipped for a reason other than a capability"


@dataclass(frozen=True)
class Outcome:
    """One report pytest counts: a test's category in pytest's words (``passed``, ``failed``,
    ``error``, ``skipped``, ``xfailed``, ``xpassed``, ...) and where it belongs."""

    backend: Optional[str]     # None: not one of the suite's tests (or a collection report)
    device: Optional[str]
    area: str                  # test class, or the module of a module-level test
    name: str                  # Class::test[params], test[params], or the node id outside
    category: str
    detail: str = ""


def _first_line(text) -> str:
    lines = [line for line in str(text).splitlines() if line.strip()]
    return lines[0].strip()[:300] if lines else ""


def detail_of(category: str, report) -> str:
    """What the summary says about one report: the skip reason, the failure's message."""
    longrepr = getattr(report, "longrepr", None)
    if category == "skipped":
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        return reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason
    if category in ("xfailed", "xpassed"):
        return getattr(report, "wasxfail", "")
    if category in ("failed", "error"):
        if "XPASS(strict)" in str(longrepr):
            return "unexpected pass (listed as an expected failure)"
        crash = getattr(longrepr, "reprcrash", None)
        text = _first_line(crash.message if crash is not None else longrepr)
        when = getattr(report, "when", None)
        return f"error in {when}: {text}" if category == "error" and when in ("setup", "teardown") else text
    return ""


def outcomes_from_stats(stats: dict, owners: dict) -> list[Outcome]:
    """Every report pytest counts in its final line (``terminalreporter.stats``), filed by
    ``owners``: {node id: (backend, device, area, name)} of the suite's tests."""
    out = []
    for category, reports in stats.items():
        if category in NOT_OUTCOMES:
            continue
        for report in reports:
            if not getattr(report, "count_towards_summary", True):
                continue
            nodeid = getattr(report, "nodeid", "") or ""
            owner = owners.get(nodeid)
            if owner is None:
                out.append(Outcome(None, None, OUTSIDE, nodeid or "<collection>", category,
                                   detail_of(category, report)))
            else:
                backend, device, area, name = owner
                out.append(Outcome(backend, device, area, name, category,
                                   detail_of(category, report)))
    return out


def _counts() -> dict:
    return dict.fromkeys(COLUMNS, 0)


def pytest_line(counts: dict) -> str:
    """``counts`` as pytest words its final line: ``2 failed, 68 passed, 1 error``."""
    keys = [k for k in PYTEST_ORDER if counts.get(k)] + sorted(
        k for k in counts if k not in PYTEST_ORDER and counts[k])
    return ", ".join(f"{counts[k]} {'errors' if k == 'error' and counts[k] != 1 else k}"
                     for k in keys) or "no tests ran"


def summarize(outcomes: Iterable[Outcome], exitstatus: int = 0, *,
              problems: Iterable[str] = ()) -> dict:
    """{"exitstatus", "pytest": {category: n} (pytest's own counts), "backends": {name: {"device",
    "areas": {area: counts}, "total", "capabilities": {capability: n}, "not_applicable",
    "other_skips", "failures", "xfailed", "verdict"}}, "outside": {"counts", "failures"},
    "problems"}. ``problems``: run-level faults (stale expected-failure patterns) named in every
    verdict that is not CONFORMS."""
    exitstatus = int(exitstatus)
    problems = list(problems)
    pytest_counts: Counter = Counter()
    backends: dict[str, dict] = {}
    outside_counts: dict = _counts()
    outside_failures: list = []
    outside = {"counts": outside_counts, "failures": outside_failures}
    for o in outcomes:
        pytest_counts[o.category] += 1
        if o.backend is None:
            outside_counts[o.category] = outside_counts.get(o.category, 0) + 1
            if o.category in ("failed", "error"):
                outside_failures.append((o.name, o.detail))
            continue
        b = backends.setdefault(o.backend, {
            "device": o.device, "areas": {}, "capabilities": Counter(), "not_applicable": [],
            "other_skips": [], "failures": [], "xfailed": []})
        counts = b["areas"].setdefault(o.area, _counts())
        counts[o.category] = counts.get(o.category, 0) + 1
        if o.category in ("failed", "error"):
            b["failures"].append((o.name, o.detail))
        elif o.category == "xfailed":
            b["xfailed"].append((o.name, o.detail))
        elif o.category == "skipped":
            cap = CAPABILITY.search(o.detail)
            if cap:
                b["capabilities"][cap.group(1)] += 1
            elif DECLARED.search(o.detail):
                b["not_applicable"].append((o.name, o.detail))
            else:
                b["other_skips"].append((o.name, o.detail))
    for b in backends.values():
        total = _counts()
        for counts in b["areas"].values():
            for k, v in counts.items():
                total[k] = total.get(k, 0) + v
        b["total"] = total
        b["capabilities"] = dict(b["capabilities"])
        b["verdict"] = verdict(b, exitstatus, outside, problems)
    return {"exitstatus": exitstatus, "pytest": dict(pytest_counts), "backends": backends,
            "outside": outside, "problems": problems}


def verdict(b: dict, exitstatus: int, outside: Optional[dict] = None, problems=()) -> str:
    """CONFORMS only when pytest's exit status is 0 and none of the backend's tests failed,
    errored or was skipped for a reason other than a capability."""
    t = b["total"]
    why = []
    bad = t.get("failed", 0) + t.get("error", 0)
    if bad:
        why.append(f"{bad} failed")
    if b["other_skips"]:
        why.append(f"{len(b['other_skips'])} {OTHER_TITLE}")
    if exitstatus != 0:
        elsewhere = ""
        if outside and any(outside["counts"].get(k) for k in ("failed", "error")):
            n = sum(outside["counts"].get(k, 0) for k in ("failed", "error"))
            elsewhere = f", {n} failed outside the suite"
        why.append(f"pytest exit status {exitstatus}: "
                   f"{EXIT_MEANING.get(exitstatus, 'failed')}{elsewhere}")
    why += list(problems)
    if why:
        return "DOES NOT CONFORM (" + "; ".join(why) + ")"
    if t.get("xfailed") or b["capabilities"]:
        return "CONFORMS (partially: see expected failures and capability skips)"
    return "CONFORMS"


SHOWN = ("passed", "failed", "xfailed", "skipped")    # always; other categories when they occur
WIDTH = {"passed": 8, "failed": 8, "xfailed": 8}       # the rest: 9


def _columns(summary: dict) -> list[str]:
    extra = set()
    for b in summary["backends"].values():
        extra |= {k for k, v in b["total"].items() if k not in SHOWN and v}
    return list(SHOWN) + sorted(extra)


def format_summary(summary: dict, full: bool) -> list[str]:
    """The summary table pytest prints at the end of the run."""
    from kvcache import Capabilities
    cols = _columns(summary)
    heads = {"xfailed": "xfail"}
    lines = []
    for backend, b in summary["backends"].items():
        dev = b["device"] or "default device"
        lines.append(f"backend {backend!r} on {dev} ({'full' if full else 'quick'} matrix)")
        w = max([22] + [len(area) + 1 for area in b["areas"]])

        def row(name, cells):
            return f"  {name:<{w}}" + "".join(f"{cell:>{WIDTH.get(k, 9)}}" for k, cell in zip(cols, cells))

        lines.append(row("area", [heads.get(c, c) for c in cols]))
        for area, c in sorted(b["areas"].items()):
            lines.append(row(area, [c.get(k, 0) for k in cols]))
        lines.append(row("total", [b["total"].get(k, 0) for k in cols]))
        if b["capabilities"]:
            lines.append("  skipped by capability:")
            for cap, n in sorted(b["capabilities"].items()):
                lines.append(f"    {n:>4}  {Capabilities.reason(cap)}")
        if b["not_applicable"]:
            lines.append(f"  {DECLARED_TITLE}: " + ", ".join(n for n, _ in b["not_applicable"]))
        for title, rows in ((OTHER_TITLE, b["other_skips"]), ("failed", b["failures"])):
            if rows:
                lines.append(f"  {title} ({len(rows)}):")
                for name, why in rows[:20]:
                    lines.append(f"    {name}: {why}")
                if len(rows) > 20:
                    lines.append(f"    ... and {len(rows) - 20} more")
        lines.append(f"  verdict: {b['verdict']}")
    outside = summary["outside"]
    if any(outside["counts"].values()):
        lines.append(f"tests outside the suite: {pytest_line(outside['counts'])}")
        for name, why in outside["failures"][:20]:
            lines.append(f"    {name}: {why}")
    if not summary["backends"]:
        lines.append("no test of the suite ran: verdict: DOES NOT CONFORM (nothing proven)")
    for problem in summary["problems"]:
        lines.append(f"run: {problem}")
    lines.append(f"pytest: {pytest_line(summary['pytest'])} (exit status {summary['exitstatus']})")
    return lines


def _md(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def write_report(path: str, summary: dict, full: bool) -> None:
    """The summary as JSON (``.json``) or Markdown (anything else)."""
    p = Path(path)
    matrix = "full" if full else "quick"
    if p.suffix == ".json":
        p.write_text(json.dumps({"matrix": matrix, **summary}, indent=2, default=str) + "\n")
        return
    cols = _columns(summary)
    heads = {"xfailed": "expected failures"}
    lines = ["# kvcache conformance results", "",
             f"pytest: {pytest_line(summary['pytest'])} (exit status {summary['exitstatus']})", ""]
    for problem in summary["problems"]:
        lines += [f"Run: {_md(problem)}", ""]
    if not summary["backends"]:
        lines += ["No test of the suite ran. **Verdict: DOES NOT CONFORM** (nothing proven)", ""]
    for backend, b in summary["backends"].items():
        lines += [f"## `{backend}` ({b['device'] or 'default device'}, {matrix} matrix)", "",
                  f"**Verdict: {b['verdict']}**", "",
                  "| area | " + " | ".join(heads.get(c, c) for c in cols) + " |",
                  "|---|" + "---:|" * len(cols)]
        for area, c in sorted(b["areas"].items()):
            lines.append(f"| {area} | " + " | ".join(str(c.get(k, 0)) for k in cols) + " |")
        t = b["total"]
        lines.append("| **total** | " + " | ".join(str(t.get(k, 0)) for k in cols) + " |")
        if b["capabilities"]:
            lines += ["", "Skipped by capability: " + ", ".join(
                f"`{k}` ({v})" for k, v in sorted(b["capabilities"].items()))]
        for title, rows in (("Failed", b["failures"]), (OTHER_TITLE.capitalize(), b["other_skips"]),
                            (DECLARED_TITLE.capitalize(), b["not_applicable"]),
                            ("Expected failures", b["xfailed"])):
            if rows:
                lines += ["", f"{title}:"] + [f"- `{n}`: {_md(r)}" for n, r in rows]
        lines.append("")
    outside = summary["outside"]
    if any(outside["counts"].values()):
        lines += [f"Tests outside the suite: {pytest_line(outside['counts'])}", ""]
        lines += [f"- `{n}`: {_md(r)}" for n, r in outside["failures"]]
    p.write_text("\n".join(lines).rstrip("\n") + "\n")


def finish(records: list, full: bool, reports, section, write_line) -> dict:
    """The end of a run: the summary table, the time table and the ``reports`` (paths) of one
    run's record or the merged records of a parallel run's workers (``plugin.run_record``);
    ``section(title)`` and ``write_line(text)`` print. Returns the summary."""
    outcomes = [Outcome(**o) for r in records for o in r["outcomes"]]
    stale: list = []
    for r in records:
        stale += [p for p in r["stale"] if p not in stale]
    problems = [f"stale expected-failure patterns (they match no test of the suite): "
                f"{', '.join(map(repr, stale))}"] if stale else []
    summary = summarize(outcomes, merged_exitstatus([r["exitstatus"] for r in records]),
                        problems=problems)
    section("kvcache conformance summary")
    for line in format_summary(summary, full):
        write_line(line)
    seconds: dict = {}
    for r in records:
        for backend, area, spent, ids in r["seconds"]:
            row = seconds.setdefault((backend, area), [0.0, set()])
            row[0] += spent
            row[1] |= set(ids)
    for backend, b in summary["backends"].items():
        b["seconds"] = {area: round(spent, 3) for (name, area), (spent, _) in seconds.items()
                        if name == backend}
    section("kvcache conformance time")
    selected = sum(r["matrix"][0] for r in records)
    whole = max((r["matrix"][1] for r in records), default=0)
    for line in format_times(seconds, full, selected, whole, max(r["wall"] for r in records),
                             workers=len(records)):
        write_line(line)
    for path in reports:
        write_report(path, summary, full)
        write_line(f"report written to {path}")
    return summary


def merged_exitstatus(statuses: list) -> int:
    """One exit status for a run of several pytest processes: an interruption, internal or
    usage error first, then a failure; "no tests" (5) only when no process ran a test."""
    statuses = [int(s) for s in statuses]
    for s in statuses:
        if s in (2, 3, 4):
            return s
    if 1 in statuses:
        return 1
    if statuses and all(s == 5 for s in statuses):
        return 5
    return next((s for s in statuses if s not in (0, 5)), 0)


def format_times(seconds: dict, full: bool, selected: int, whole: int, wall: float,
                 workers: int = 1) -> list[str]:
    """The time table: per backend, each area's tests and seconds (setup, call and teardown of
    its tests, slowest first; summed over the workers of a parallel run), the total, and the
    run's wall time (collection included; a parallel run's slowest worker)."""
    matrix = "full matrix" if full else f"quick matrix, {selected} of the full matrix's {whole} " \
        "tests (--full runs all)" if whole else "quick matrix"
    where = f" ({workers} workers at once)" if workers > 1 else ""
    lines = [f"{matrix}; wall time {wall:.1f} s{where}"]
    for backend in sorted({name for name, _ in seconds}, key=str):
        rows = sorted(((area, spent, len(ids)) for (name, area), (spent, ids) in seconds.items()
                       if name == backend), key=lambda r: (-r[1], r[0]))
        total = sum(r[1] for r in rows) or 1e-9
        w = max([22] + [len(r[0]) + 1 for r in rows])
        lines.append(f"backend {backend!r}")
        lines.append(f"  {'area':<{w}}{'tests':>7}{'seconds':>10}{'share':>8}")
        for area, spent, n in rows:
            lines.append(f"  {area:<{w}}{n:>7}{spent:>10.1f}{100 * spent / total:>7.1f}%")
        lines.append(f"  {'total':<{w}}{sum(r[2] for r in rows):>7}{sum(r[1] for r in rows):>10.1f}"
                     f"{100.0:>7.1f}%")
    return lines
