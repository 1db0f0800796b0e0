"""``kvcache conformance``: run the suite against one backend and print the summary table."""

from __future__ import annotations

import argparse
import os
from typing import Optional


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvcache conformance",
        description="Run the kvcache conformance suite: the backend under test and the reference "
                    "backend get the same random inputs and their outputs are compared. By "
                    "default the quick matrix: every test class and test function, on fewer "
                    "dtypes, page sizes, shapes and parameter values (about 1 test in 9 of the "
                    "full matrix; minutes on a GPU, where kernels compile per shape). The end "
                    "of the run prints the summary table and the time of each test class.",
        epilog="Arguments after '--' go to pytest unchanged (e.g. -- -x -vv --tb=short "
               "--durations=20).")
    p.add_argument("--backend", required=True, help="registered backend name (see `kvcache info`)")
    p.add_argument("--device", default=None, help="device for the backend (default: its own)")
    p.add_argument("-k", dest="keyword", default=None, metavar="EXPR",
                   help="only tests matching this pytest -k expression (chosen from the quick "
                        "matrix; with --full from the whole one)")
    p.add_argument("--full", action="store_true",
                   help="the whole matrix: every test on every dtype (float32/float16/bfloat16) "
                        "x page size (1/16/32), every value combination of its parameters, and "
                        "the shape matrix's dtype x GQA 1/4/8 x head dims 64/80/96/128/256 x "
                        "page sizes (about 9 times the quick matrix's tests)")
    p.add_argument("--xfail", action="append", default=[], metavar="FILE",
                   help="expected-failure list ('pattern  # reason' a line); strict: an unexpected "
                        "pass fails, and a pattern that matches no test stops the run (exit "
                        "status 4). Added to the backend's own conformance_xfail list.")
    p.add_argument("--report", action="append", default=[], metavar="PATH",
                   help="also write the summary as JSON (.json) or Markdown (.md); may be given "
                        "more than once")
    p.add_argument("--poison", default=None, choices=["nan", "large", "none"],
                   help="value written into page slots that hold no token (default nan)")
    p.add_argument("--seed", type=int, default=None, help="base random seed")
    p.add_argument("--no-model", action="store_true",
                   help="skip checking the reference against the dense model")
    p.add_argument("--jobs", "-j", default="auto", type=_jobs, metavar="N",
                   help="pytest processes at once, each running every N-th test (a GPU backend's "
                        "kernels compile on the CPU: N compile at once); 'auto' (default): half "
                        "the CPUs up to 8 on a machine of 8 or more, else 1")
    p.add_argument("-q", "--quiet", action="store_true", help="less pytest output")
    p.add_argument("-x", "--exitfirst", action="store_true", help="stop at the first failure")
    return p


def _jobs(text: str) -> int:
    if text == "auto":
        from .parallel import auto_jobs
        return auto_jobs()
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer or 'auto'")
    return value


def pytest_args(args, extra=()) -> list[str]:
    """The pytest command line equivalent to ``args``."""
    here = os.path.dirname(os.path.abspath(__file__))
    out = ["-p", "kvcache.conformance.plugin", "-p", "no:cacheprovider",
           "--rootdir", here, "-c", os.devnull, here,
           "--kvcache-backend", args.backend, "-q" if args.quiet else "-ra"]
    if args.device:
        out += ["--kvcache-device", args.device]
    if args.keyword:
        out += ["-k", args.keyword]
    if args.full:
        out.append("--kvcache-full")
    for f in args.xfail:
        out += ["--kvcache-xfail", os.path.abspath(f)]
    for f in args.report:
        out += ["--kvcache-report", os.path.abspath(f)]
    if args.poison:
        out += ["--kvcache-poison", args.poison]
    if args.seed is not None:
        out += ["--kvcache-seed", str(args.seed)]
    if args.no_model:
        out.append("--kvcache-no-model")
    if args.exitfirst:
        out.append("-x")
    return out + list(extra)


def main(argv: Optional[list] = None) -> int:
    """``kvcache conformance ARGS [-- PYTEST ARGS]``: pytest's exit status (the summary's verdict
    reads CONFORMS only when it is 0); a usage mistake (no pytest, an unknown or unavailable
    backend) raises ``kvcache.cli.UsageError`` (exit 2 through ``kvcache``)."""
    argv = list(argv or [])
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    args = build_parser().parse_args(argv)
    from kvcache.cli_kit import UsageError, backend_for
    try:
        import pytest
    except ImportError:
        from kvcache.integrations import install_hint
        raise UsageError(f"kvcache conformance needs pytest: {install_hint('test')}") from None
    if args.jobs > 1:               # the workers fork from this process: no device started here
        from .parallel import backend_in_child
        what = backend_in_child(args.backend, args.device)
    else:
        cls = backend_for(args.backend, args.device)
        what = f"{cls.name!r} ({cls.__module__}.{cls.__qualname__})"
    print(f"kvcache conformance: backend {what}, device {args.device or 'default'}")
    if args.jobs > 1:
        from .parallel import run_parallel
        reports = [os.path.abspath(f) for f in args.report]
        single = pytest_args(argparse.Namespace(**{**vars(args), "report": []}), extra)
        return run_parallel(single, args.jobs, args.full, reports)
    return int(pytest.main(pytest_args(args, extra)))
