"""The ``--kvcache-*`` pytest options of the conformance suite, defined once.

Nothing of kvcache is registered with pytest by installing it (no ``pytest11`` entry point): an
unrelated pytest run sees no kvcache option, module or fixture. A run opts in by naming the suite's
plugin, which adds these options:

    pytest -p kvcache.conformance.plugin --pyargs kvcache.conformance --kvcache-backend NAME

(``kvcache conformance --backend NAME`` does that for you), or with the environment
(``KVCACHE_CONFORMANCE_BACKEND=NAME pytest --pyargs kvcache.conformance``: the package's
``conftest.py`` registers the plugin), or with ``pytest_plugins = ["kvcache.conformance.plugin"]``
in a plugin author's ``conftest.py``.
"""

GROUP = ("kvcache", "kvcache conformance suite")

# (flag, addoption keywords). Every default is None: "not given" stays distinguishable, so the
# suite can fall back to its KVCACHE_CONFORMANCE_* environment variables.
OPTIONS = (
    ("--kvcache-backend", dict(default=None, help="backend under test (default: reference)")),
    ("--kvcache-device", dict(default=None, help="device for the backend under test")),
    ("--kvcache-full", dict(action="store_true", default=None,
                            help="the whole matrix (default: the quick one, every test "
                                 "function on fewer dtypes, page sizes, shapes and values)")),
    ("--kvcache-xfail", dict(action="append", default=None, metavar="FILE",
                             help="expected-failure list (one 'pattern  # reason' a line); strict")),
    ("--kvcache-poison", dict(default=None, choices=["nan", "large", "none"],
                              help="value written into page slots that hold no token (default nan)")),
    ("--kvcache-no-model", dict(action="store_true", default=None,
                                help="do not check the reference against the dense SPEC model")),
    ("--kvcache-seed", dict(type=int, default=None, help="base random seed")),
    ("--kvcache-ballast", dict(type=int, default=None, metavar="TOKENS",
                               help="run-ahead tests: tokens of the prefill that keeps the device "
                                    "busy (default 4096 on an accelerator, 64 on a CPU device)")),
    ("--kvcache-report", dict(action="append", default=None, metavar="PATH",
                              help="write the summary as JSON (.json) or Markdown (.md); may be "
                                   "given more than once")),
    ("--kvcache-shard", dict(default=None, metavar="I/N",
                             help="run every N-th selected test of the suite from the I-th (a "
                                  "worker of `kvcache conformance --jobs N`)")),
    ("--kvcache-dump", dict(default=None, metavar="PATH",
                            help="write this run's results as JSON to PATH instead of printing "
                                 "the summary (a worker of `kvcache conformance --jobs N`)")),
)


def add_options(parser) -> None:
    """Add the ``--kvcache-*`` group to ``parser``; a no-op for options it already has."""
    group = parser.getgroup(*GROUP)
    have = {name for option in group.options for name in option.names()}
    for flag, kwargs in OPTIONS:
        if flag not in have:
            group.addoption(flag, **kwargs)
