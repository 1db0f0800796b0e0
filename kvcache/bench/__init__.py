"""``kvcache bench``: host overhead of ``begin_forward`` (``--host``) and, for backends that
provide them, kernel benchmarks against the memory-bandwidth floor (``--backend NAME``).

The benches, one module each: ``host`` (``begin_forward`` on fixed and changing batches) and
``host_prefix`` (the prefix cache's lookups), the two of ``--host``; ``serving`` (``--serving``:
the Engine beside transformers' serving paths); ``transfer`` (``--transfer``: one sequence's KV
between two processes); ``files`` (``--files``: a KV file saved and loaded); ``memory``
(``--memory``: tokens per GiB of KV with window groups against without). A backend's kernel
benchmarks are its own (``Backend.benchmarks``)."""

from __future__ import annotations

import argparse
import json
import platform
from typing import Optional

import numpy as np

from ..cli_kit import UsageError, backend_for, positive_int
from .host import changing_bench, host_bench, numpy_call_us, print_changing, print_host


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvcache bench",
        description="Benchmarks. --host (the default): host time of begin_forward and the aux "
                    "upload for decode batches of 1..1024 sequences on the reference backend. "
                    "--backend NAME: that backend's kernel benchmarks against the memory-bandwidth "
                    "floor (a GPU backend needs its GPU). --serving --model llama: serving "
                    "throughput of the kvcache Engine beside transformers' own serving paths and "
                    "the decode-step roofline (--backend then names the Engine's backend). "
                    "--transfer: one sequence's KV sent between two processes vs a plain "
                    "torch.distributed send of the same bytes. --files: one sequence's KV file "
                    "saved and loaded vs a plain write and read of the same bytes. --memory: "
                    "tokens held per GiB of KV with window groups (5:1 local:global, w=1024, "
                    "32k context) against the same cache without them.",
        epilog="Options this parser does not know are passed to the backend's benchmarks "
               "(e.g. kvcache bench --backend cuda --iters 50 --only decode); "
               "`kvcache bench --backend NAME --help` lists them.")
    p.add_argument("--host", action="store_true",
                   help="time begin_forward + the aux upload on the host (default without --backend)")
    p.add_argument("--backend", default=None, metavar="NAME",
                   help="run this backend's kernel benchmarks (see `kvcache info` for names); with "
                        "--serving: the Engine's backend (default cuda on a GPU, else reference)")
    p.add_argument("--device", default=None, metavar="DEV",
                   help="device for the backend's benchmarks (default: the backend's own); with "
                        "--serving: the model's device (default cuda when there is one)")
    p.add_argument("--repeat", type=positive_int, default=200, metavar="N",
                   help="begin_forward calls timed per batch size for --host (default 200)")
    p.add_argument("--json", action="store_true",
                   help="print the --host (or --serving) results as JSON (for machines) instead "
                        "of a table")
    from .serving import add_arguments
    add_arguments(p)
    from .transfer import add_arguments as add_transfer_arguments
    add_transfer_arguments(p)
    from .files import add_arguments as add_files_arguments
    add_files_arguments(p)
    from .memory import add_arguments as add_memory_arguments
    add_memory_arguments(p)
    return p


def main(argv: Optional[list] = None) -> int:
    """``kvcache bench ARGS``: 0 on success, 2 for a usage mistake (unknown or unavailable
    backend, an option no part of the bench knows)."""
    parser = build_parser()
    argv = list(argv or [])
    wants_help = [a for a in argv if a in ("-h", "--help")]
    if wants_help and any(a == "--backend" or a.startswith("--backend=") for a in argv):
        # --backend NAME --help: the backend's own options (after the backend check below)
        argv = [a for a in argv if a not in wants_help]
    else:
        wants_help = []
    args, rest = parser.parse_known_args(argv)
    rest += wants_help
    if args.memory:
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        if args.host or args.serving or args.transfer or args.files:
            raise UsageError("--memory is a separate bench; run it alone")
        for name in ("memory_context", "memory_window", "memory_local"):
            if getattr(args, name) < (0 if name == "memory_window" else 1):
                raise UsageError(f"--{name.replace('_', '-')} must be a positive integer")
        if args.backend is not None:
            backend_for(args.backend, args.device)
        from . import memory
        return memory.main(args)
    if args.files:
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        if args.host or args.serving or args.transfer:
            raise UsageError("--files is a separate bench; run it without --host / --serving / "
                             "--transfer")
        if args.files_mib < 1:
            raise UsageError("--files-mib must be a positive integer")
        if args.backend is not None:
            backend_for(args.backend, args.device)
        from . import files
        return files.main(args)
    if args.transfer:
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        if args.host or args.serving:
            raise UsageError("--transfer is a separate bench; run it without --host / --serving")
        for name in ("transfer_tokens", "transfer_layers", "transfer_repeat"):
            if getattr(args, name) is not None and getattr(args, name) < 1:
                raise UsageError(f"--{name.replace('_', '-')} must be a positive integer")
        if args.backend is not None:
            backend_for(args.backend, args.device)
        from . import transfer
        return transfer.main(args)
    if args.serving:
        # --backend here is the Engine's backend (a), not a kernel benchmark
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        if args.host:
            raise UsageError("--serving and --host are separate benches; run them one at a time")
        from . import serving
        try:
            serving.parse_skip(args.skip)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if args.backend is not None:
            backend_for(args.backend, args.device)
        serving.check_device(args.device)
        return serving.main(args)
    if rest and args.backend is None:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.device is not None and args.backend is None:     # was ignored: the host bench ran
        raise UsageError(f"--device {args.device} applies to a backend's benchmarks (--backend "
                         "NAME), --serving and --transfer; the host bench (--host) runs on the CPU")
    if not args.host and args.backend is None:
        args.host = True
    run = None
    if args.backend is not None:
        # checked before any host work: a missing GPU or backend fails at once
        cls = backend_for(args.backend, args.device)
        run = cls.run_benchmarks if cls.benchmarks is not None else None
        if run is None:
            raise UsageError(f"backend {cls.name!r} ships no kernel benchmarks; "
                             "use --host, or a backend that has them (e.g. cuda)")
        if args.json:
            raise UsageError("--json applies to --host; the backend's benchmarks write JSON "
                             "with their own option (see `kvcache bench --backend NAME --help`)")
    if args.host:
        call_us = numpy_call_us()
        rows = host_bench(args.repeat)
        call_us = (call_us + numpy_call_us()) / 2
        changing = changing_bench(args.repeat)
        from .host_prefix import prefix_bench, print_prefix
        prefix = prefix_bench(args.repeat)
        if args.json:
            print(json.dumps({"numpy_call_us": call_us, "python": platform.python_version(),
                              "numpy": np.__version__,
                              "machine": platform.processor() or platform.machine(),
                              "rows": rows, "changing": changing, "prefix_cache": prefix},
                             indent=2))
        else:
            print_host(rows, call_us)
            print_changing(changing)
            print_prefix(prefix)
    if run is not None:
        return int(run(rest + (["--device", args.device] if args.device else [])) or 0)
    return 0
