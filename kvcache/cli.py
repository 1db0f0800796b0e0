"""``kvcache`` command line: info, conformance, bench, demo."""

from __future__ import annotations

import argparse
import sys


def _info(args) -> int:
    from .plugins import list_backends
    rows = list_backends(args.device)
    print(f"{'backend':<12} {'prio':>4}  {'status':<11}  reason")
    for row in rows:
        status = "available" if row["available"] else "unavailable"
        prio = "" if row["priority"] is None else row["priority"]
        print(f"{row['name']:<12} {prio:>4}  {status:<11}  {row['reason']}")
    for row in rows:
        cls = row["class"]
        if cls is None:
            continue
        print(f"\n[{cls.name}] {cls.description}")
        try:
            _details(cls, row["available"])
        except Exception as exc:   # one plugin's bug must not hide the other backends
            print(f"  error:        {type(exc).__name__}: {exc}")
    return 0


def _details(cls, available: bool) -> None:
    platform = cls.platform()
    if platform:
        print("  platform:     " + ", ".join(f"{k}={v}" for k, v in platform.items()))
    if available:
        print("  devices:      " + ", ".join(cls.devices()))
    for key, value in cls.capabilities.describe().items():
        if key == "head_dims" and len(value) > 8:
            value = f"{value[0]}..{value[-1]}"
        print(f"  {key + ':':<18}{value}")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="kvcache", description="paged KV cache for LLM inference")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="backends, availability and reason, capabilities, devices")
    info.add_argument("--device", default=None)
    for name, text in (("conformance", "run the conformance suite against a backend"),
                       ("bench", "benchmarks (host overhead, kernels against the bandwidth floor)"),
                       ("demo", "a continuous-batching serving workload on the best backend")):
        sub.add_parser(name, help=text, add_help=False)
    if argv and argv[0] in ("conformance", "bench", "demo"):
        command, rest = argv[0], argv[1:]
        if command == "conformance":
            from .conformance.cli import main as run
        elif command == "bench":
            from .bench import main as run
        else:
            from .demo import main as run
        return int(run(rest) or 0)
    args = parser.parse_args(argv)
    return _info(args)


if __name__ == "__main__":
    sys.exit(main())
