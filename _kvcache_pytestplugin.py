"""kvcache's ``pytest11`` entry point: the ``--kvcache-*`` options of the conformance suite, and
nothing else until a run asks for the suite.

pytest parses its command line before it imports the ``conftest.py`` of a ``--pyargs`` package,
so ``pytest --pyargs kvcache.conformance --kvcache-backend NAME`` only works if something pytest
loads up front defines ``--kvcache-backend``. pytest loads every ``pytest11`` entry point in every
run, so this module is kept tiny: it sits outside the ``kvcache`` package (importing ``kvcache``
imports numpy and the cache) and imports only the standard library.

The suite itself (``kvcache.conformance.plugin``: fixtures, parametrization, expected failures,
the summary table) is opt-in, never autoloaded. It is registered when

* a ``--kvcache-*`` option is on the command line (this module, in ``pytest_configure``), or
* ``kvcache.conformance``'s own ``conftest.py`` is collected (``pytest --pyargs kvcache.conformance``,
  e.g. with ``KVCACHE_CONFORMANCE_BACKEND=NAME``), or
* it is named: ``-p kvcache.conformance.plugin`` or ``pytest_plugins = ["kvcache.conformance.plugin"]``.

The options are defined here only; ``kvcache.conformance.plugin`` adds them through
:func:`add_options` too, so ``-p kvcache.conformance.plugin`` also works where this entry point is
not loaded (``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1``, ``-p no:kvcache``); adding is idempotent. With
autoload disabled, ``-p kvcache`` loads this entry point by name.
"""

SUITE_PLUGIN = "kvcache.conformance.plugin"
GROUP = ("kvcache", "kvcache conformance suite")

# (flag, addoption keywords). Every default is None: "not given" stays distinguishable, so the
# suite can fall back to its KVCACHE_CONFORMANCE_* environment variables, and so that giving any
# of them is what opts a run in.
OPTIONS = (
    ("--kvcache-backend", dict(default=None, help="backend under test (default: reference)")),
    ("--kvcache-device", dict(default=None, help="device for the backend under test")),
    ("--kvcache-full", dict(action="store_true", default=None,
                            help="the whole matrix of dtypes x GQA x head dims x page sizes")),
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
    ("--kvcache-report", dict(default=None, metavar="PATH",
                              help="write the summary as JSON (.json) or Markdown (.md)")),
)
DESTS = tuple(flag[2:].replace("-", "_") for flag, _ in OPTIONS)


def add_options(parser) -> None:
    """Add the ``--kvcache-*`` group to ``parser``; a no-op for options it already has."""
    group = parser.getgroup(*GROUP)
    have = {name for option in group.options for name in option.names()}
    for flag, kwargs in OPTIONS:
        if flag not in have:
            group.addoption(flag, **kwargs)


def opted_in(config) -> bool:
    """Whether the command line gave any ``--kvcache-*`` option."""
    return any(config.getoption(dest, default=None) is not None for dest in DESTS)


def pytest_addoption(parser):
    add_options(parser)


def pytest_configure(config):
    if opted_in(config):
        # Registers under SUITE_PLUGIN; a no-op if -p, pytest_plugins or the conftest already did,
        # and respects -p no:kvcache.conformance.plugin.
        config.pluginmanager.import_plugin(SUITE_PLUGIN)
