"""``kvcache`` command line: info, conformance, bench, demo.

A user mistake (an unknown backend, a missing prerequisite, a bad option) ends in one line on
stderr naming the fix and exit status 2, never a traceback; a closed pipe (``kvcache info | head``)
ends quietly.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Sequence
from typing import Any, Optional

from .cli_kit import USAGE_ERROR, UsageError, backend_for, fail, guarded  # noqa: F401  (the CLI's own)


def readable(value: Any) -> str:
    """A capability value as a person reads it: yes/no, comma lists, ranges for long lists."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value is None:
        return "-"
    if isinstance(value, (tuple, list, set, frozenset)):
        items = sorted(value) if isinstance(value, (set, frozenset)) else list(value)
        if len(items) > 8:
            return f"{items[0]}..{items[-1]} ({len(items)} values)"
        return ", ".join(str(v) for v in items) or "-"
    return str(value)


def _jsonable(value: Any) -> Any:
    if isinstance(value, (tuple, list, set, frozenset)):
        items = sorted(value) if isinstance(value, (set, frozenset)) else value
        return [_jsonable(v) for v in items]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _info_rows(device: Optional[str], check: bool = True) -> list[dict]:
    """One dict per registered backend: name, priority, available, reason, and (for a usable
    class) description, platform, devices, capabilities or the error that hid them. Without
    ``check``, listed inside ``plugins.deferred_frameworks()``: torch and MLX are not imported,
    and what needs them (availability, platform, devices) is left out ("available" None)."""
    from .plugins import FrameworkNotImported, deferred_frameworks, list_backends
    out = []
    with contextlib.nullcontext() if check else deferred_frameworks():
        for row in list_backends(device):
            item: dict[str, Any] = {k: row[k] for k in ("name", "priority", "available", "reason")}
            cls = row["class"]
            if cls is not None:
                item["description"] = cls.description
                try:   # one plugin's bug must not hide the other backends
                    item["capabilities"] = dict(cls.capabilities.describe())
                    item["devices"] = [str(d) for d in cls.devices()] if row["available"] else []
                    item["platform"] = dict(cls.platform() or {})
                except FrameworkNotImported:      # what is known without torch / MLX is shown
                    pass
                except Exception as exc:
                    item["error"] = f"{type(exc).__name__}: {exc}"
            out.append(item)
    return out


def _info(args: argparse.Namespace) -> int:
    check = bool(getattr(args, "check", True)) or args.device is not None
    rows = _info_rows(args.device, check=check)
    if getattr(args, "json", False):
        print(json.dumps(_jsonable(rows), indent=2))
        return 0
    print(f"{'backend':<12} {'prio':>4}  {'status':<11}  reason")
    for row in rows:
        status = {True: "available", False: "unavailable", None: "unchecked"}[row["available"]]
        prio = "?" if row["priority"] is None and "description" in row else row["priority"]
        print(f"{row['name']:<12} {'' if prio is None else prio:>4}  {status:<11}  {row['reason']}")
    unchecked = [row["name"] for row in rows if row["available"] is None]
    if unchecked:
        print(f"({', '.join(unchecked)}: `kvcache info --check` imports their frameworks to check "
              "availability, priority, platform and devices)")
    for row in rows:
        if "description" not in row:
            continue
        print(f"\n[{row['name']}] {row['description']}")
        if row.get("platform"):
            print("  platform:           " + ", ".join(f"{k}={v}" for k, v in row["platform"].items()))
        if row.get("devices"):
            print("  devices:            " + ", ".join(row["devices"]))
        if "error" in row:
            print(f"  error:              {row['error']}")
        for key, value in row.get("capabilities", {}).items():
            print(f"  {key + ':':<20}{readable(value)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    parser = argparse.ArgumentParser(
        prog="kvcache", description="paged KV cache for LLM inference",
        epilog="`kvcache COMMAND --help` describes each command's options.")
    parser.add_argument("--version", action="version", version=f"kvcache {__version__}",
                        help="print the version of kvcache and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    info = sub.add_parser("info", help="backends, availability and reason, capabilities, devices",
                          description="List every registered backend: priority, whether it can "
                                      "run here (and why not), platform, devices, capabilities. "
                                      "torch, Triton and MLX are not imported unless --check (or "
                                      "--device) asks: a backend whose check needs one is listed "
                                      "as unchecked, with its capabilities.")
    info.add_argument("--device", default=None, metavar="DEV",
                      help="check availability for this device (e.g. cuda:1, cpu); "
                           "default: each backend's own")
    info.add_argument("--check", action="store_true",
                      help="import each backend's framework (torch, MLX) to check its availability, "
                           "priority, platform and devices (slower); without it those of a backend "
                           "that needs one are listed as unchecked. --device implies it")
    info.add_argument("--json", action="store_true", help="print the same as JSON (for machines)")
    for name, text in (("conformance", "run the conformance suite against a backend"),
                       ("bench", "benchmarks (host overhead, kernels against the bandwidth floor)"),
                       ("demo", "a continuous-batching serving workload on the best backend")):
        sub.add_parser(name, help=text, add_help=False)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``kvcache COMMAND ...``: the exit status of the command (2 for a usage mistake)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("conformance", "bench", "demo"):
        command, rest = argv[0], argv[1:]
        if command == "conformance":
            from .conformance.cli import main as run
        elif command == "bench":
            from .bench import main as run
        else:
            from .demo import main as run
        return guarded(f"kvcache {command}", run, rest)
    parser = build_parser()
    return guarded("kvcache", lambda a: _info(parser.parse_args(a)), argv)


if __name__ == "__main__":
    # through the package, so that the UsageError the commands raise is this one
    from kvcache.cli import main as _main
    sys.exit(_main())
