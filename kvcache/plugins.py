"""Backend discovery: pluggy over the ``kvcache`` entry-point group.

``KVCACHE_PLUGINS`` (comma-separated entry-point names) limits which plugins load; empty string
loads none but the built-in reference backend's entry point is still subject to the filter.

Looking up a backend by name loads only the entry points of that name (a plugin's entry point is
named after its backend, so ``backend="reference"`` imports neither torch nor MLX); only if that
does not find it, and for ``"auto"`` and ``list_backends``, are all plugins loaded.

Each plugin is checked on its own (its hooks when it registers, its backend classes whenever they
are listed), so a bad plugin is listed as unusable and hides no other backend. A backend name that
two different classes claim is unusable too: neither is picked, by name or by ``"auto"``.

Inside ``deferred_frameworks()`` (what ``kvcache info`` lists in) torch, Triton and MLX are not
imported: a plugin's ``import torch`` binds a stand-in that imports the real module at its first
use, and a backend whose availability (or priority, or platform) needs one of them is listed as
not checked instead. Capabilities and descriptions are class attributes and need none of them.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import importlib.abc
import inspect
import os
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from importlib.metadata import entry_points
from typing import Any, Optional, TypeVar

import pluggy

from . import hookspecs
from .backend import Backend, Capabilities
from .errors import BackendNotAvailableError, KVCacheError

T = TypeVar("T")

ENTRY_POINT_GROUP = "kvcache"
_manager: Optional[pluggy.PluginManager] = None
_load_errors: dict[str, str] = {}
_origins: dict[str, str] = {}     # plugin name -> where it came from, for duplicate-name reports
_loaded: set[tuple[str, str]] = set()   # (entry point name, value) already loaded
_all_loaded = False


def _manager_only() -> pluggy.PluginManager:
    """The process-wide plugin manager, with whatever entry points are loaded so far."""
    global _manager
    if _manager is None:
        pm = pluggy.PluginManager("kvcache")
        pm.add_hookspecs(hookspecs)
        _manager = pm
    return _manager


def _load_entry_points(name: Optional[str] = None) -> pluggy.PluginManager:
    """Load the entry points named ``name`` (None: all) that ``KVCACHE_PLUGINS`` allows and that
    are not loaded yet."""
    global _all_loaded
    pm = _manager_only()
    if _all_loaded:
        return pm
    allowed = os.environ.get("KVCACHE_PLUGINS")
    wanted = None if allowed is None else {n.strip() for n in allowed.split(",") if n.strip()}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        key = (ep.name, ep.value)
        if (wanted is None or ep.name in wanted) and (name is None or ep.name == name) \
                and key not in _loaded:
            _loaded.add(key)
            _load_entry_point(pm, ep)
    if name is None:
        _all_loaded = True
    return pm


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager with every allowed entry point loaded."""
    return _load_entry_points()


def _load_entry_point(pm: pluggy.PluginManager, ep) -> None:
    """Load and register one entry point; any failure is recorded, never raised."""
    dist = f"{ep.dist.name} {ep.dist.version}" if getattr(ep, "dist", None) else "unknown"
    name = ep.name
    if pm.has_plugin(name) or name in _load_errors:   # a second distribution uses this name
        name = f"{ep.name} ({dist})"                  # load it too: its backends may clash
    _origins[name] = f"distribution {dist}, entry point {ep.name!r}"
    try:
        with _loading_allowed():     # a plugin that uses torch as it loads imports it
            plugin = ep.load()
        _register(pm, plugin, name)
    except Exception as exc:  # a broken plugin must not hide the others
        _load_errors[name] = f"failed to load: {type(exc).__name__}: {exc}"


def _register(pm: pluggy.PluginManager, plugin, name: Optional[str]) -> Optional[str]:
    """``pm.register`` plus pluggy's ``check_pending`` for this plugin alone (the global check
    would let one plugin's typo break every lookup); a plugin that fails is not kept."""
    was_registered = pm.get_name(plugin) is not None
    try:
        name = pm.register(plugin, name=name)
        _check_hook_names(pm, plugin)
    except Exception:
        if not was_registered and pm.get_name(plugin) is not None:  # also: pluggy < 1.6 keeps
            pm.unregister(plugin)                                   # a plugin that fails to verify
        raise
    return name


def _check_hook_names(pm: pluggy.PluginManager, plugin) -> None:
    unknown = [caller.name for caller in pm.get_hookcallers(plugin) or ()
               if not caller.has_spec()
               and any(i.plugin is plugin and not i.optionalhook for i in caller.get_hookimpls())]
    if unknown:
        specs = [n for n, c in vars(pm.hook).items() if not n.startswith("_") and c.has_spec()]
        close = difflib.get_close_matches(unknown[0], specs, n=1)
        raise pluggy.PluginValidationError(
            plugin, f"unknown hook {unknown[0]!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))


def reset_plugins() -> None:
    """Forget loaded plugins (tests, or after installing a plugin at run time)."""
    global _manager, _all_loaded
    _manager = None
    _all_loaded = False
    _loaded.clear()
    _load_errors.clear()
    _origins.clear()


def register_plugin(module_or_object, name: Optional[str] = None) -> None:
    """Register a plugin object in-process (tests, notebooks); same hooks as entry points. A plugin
    with an unknown hook raises ``pluggy.PluginValidationError`` and is not registered."""
    name = _register(_manager_only(), module_or_object, name)
    if name is not None:
        _origins[name] = f"plugin {name!r}, registered in-process"


def _class_problem(cls) -> Optional[str]:
    """Why ``cls`` cannot serve as a backend class, or None. Checked before any use: the name is
    a dict key, the priority is sorted, the capabilities are read by every feature check."""
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        return f"kvcache_register_backends returned {cls!r}, not a Backend subclass"
    where = f"{cls.__module__}.{cls.__qualname__}"
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        return f"{where} does not implement the abstract methods {missing}"
    checks = (("name", lambda v: isinstance(v, str) and v not in ("", "auto"),
               "a non-empty string other than 'auto'"),
              ("priority", lambda v: isinstance(v, int) and not isinstance(v, bool), "an int"),
              ("capabilities", lambda v: isinstance(v, Capabilities), "a kvcache.Capabilities"))
    for attr, ok, expected in checks:
        try:
            value = getattr(cls, attr)
        except FrameworkNotImported:   # a priority computed by torch / MLX: checked once imported
            continue
        if not ok(value):
            return f"{where}.{attr} is {value!r} ({type(value).__name__}), not {expected}"
    return None


def _hook_classes(impl) -> tuple[list, Optional[str]]:
    """The backend classes one plugin's hook returns, or why that plugin is unusable."""
    if impl.hookwrapper or impl.wrapper:
        return [], "hook wrappers are not supported for kvcache_register_backends"
    try:
        with _loading_allowed():
            result = impl.function()
        classes = list(result or ()) if isinstance(result, (Iterable, type(None))) else None
    except Exception as exc:   # reported by list_backends, never raised from here
        return [], f"kvcache_register_backends raised {type(exc).__name__}: {exc}"
    if classes is None:
        return [], f"kvcache_register_backends returned {result!r}, not a list of Backend subclasses"
    for cls in classes:
        problem = _class_problem(cls)
        if problem:
            return [], problem
    return classes, None


def _duplicate_reason(name: str, providers: list) -> str:
    who = " and ".join(f"{cls.__module__}.{cls.__qualname__} ({_origins.get(p, f'plugin {p!r}')})"
                       for cls, p in providers)
    return f"duplicate backend name {name!r}: {who}; uninstall one of them"


def _plugin_backends(everything: bool = True
                     ) -> tuple[dict[str, type[Backend]], dict[str, str], dict[str, str]]:
    """Every usable backend class by name; {plugin name: why it is unusable} for each plugin whose
    hook raised or returned something unusable; {backend name: why} for each name that two
    different classes claim. Each plugin's hook is called on its own, so one broken plugin (a
    missing dependency, a bug) does not hide the others."""
    providers: dict[str, list[tuple[type[Backend], str]]] = {}
    broken: dict[str, str] = {}
    # pluggy calls the last registered implementation first; list in registration order.
    pm = get_plugin_manager() if everything else _manager_only()
    for impl in reversed(pm.hook.kvcache_register_backends.get_hookimpls()):
        classes, why = _hook_classes(impl)
        if why:
            broken[impl.plugin_name] = why
        for cls in classes:
            claims = providers.setdefault(cls.name, [])
            if all(cls is not other for other, _ in claims):   # the same class twice is no clash
                claims.append((cls, impl.plugin_name))
    found = {name: claims[0][0] for name, claims in providers.items() if len(claims) == 1}
    duplicates = {name: _duplicate_reason(name, claims)
                  for name, claims in providers.items() if len(claims) > 1}
    return found, broken, duplicates


def backend_classes() -> dict[str, type[Backend]]:
    """Every usable backend class by name (plugins whose hook fails, and names two classes claim,
    are left out; see ``list_backends`` for why)."""
    return _plugin_backends()[0]


def list_backends(device: Optional[str] = None) -> list[dict]:
    """All registered backends, highest priority first: name, priority, available, reason. A plugin
    that failed to load or whose hook failed is listed by its plugin name, and a backend name that
    two classes claim by that name, as unavailable (class and priority None) with the reason.
    Inside ``deferred_frameworks()``, a backend whose availability needs a framework not imported
    has ``available`` None ("not checked: needs torch, ..."), and ``priority`` None if that does
    too (listed after the others)."""
    classes, broken, duplicates = _plugin_backends()
    rows = [_check(cls, device)[0] for cls in classes.values()]
    _by_priority(rows)
    return rows + _unloaded_rows(broken, duplicates)


def _check(cls: type[Backend], device: Optional[str]) -> tuple[dict[str, Any], Optional[str]]:
    """``cls``'s row of ``list_backends``, and the framework its check needed that is not
    imported (inside ``deferred_frameworks()``; None: it was checked)."""
    needs: Optional[str] = None
    try:
        priority: Optional[int] = cls.priority
    except FrameworkNotImported as exc:
        priority, needs = None, exc.framework
    available: Optional[bool]
    try:
        ok, reason = cls.availability(device)
        available = bool(ok)
    except FrameworkNotImported as exc:
        available, reason, needs = None, f"not checked: needs {exc.framework}, not imported", exc.framework
    except Exception as exc:
        available, reason = False, f"availability() raised {type(exc).__name__}: {exc}"
    return ({"name": cls.name, "priority": priority, "available": available, "reason": reason,
             "class": cls}, needs)


def _unloaded_rows(broken: dict, duplicates: dict) -> list[dict[str, Any]]:
    """A row for each plugin that failed to load, is broken or names a backend twice."""
    return [{"name": name, "priority": None, "available": False, "reason": why, "class": None}
            for name, why in [*_load_errors.items(), *broken.items(), *duplicates.items()]]


def _by_priority(rows: list[dict[str, Any]]) -> None:
    rows.sort(key=lambda r: (r["priority"] is None, -(r["priority"] or 0)))   # stable


# ------------------------------------------------------------------ backend="auto", cheaply
_GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")
"""Device files a GPU driver makes on Linux (NVIDIA; AMD's ROCm; WSL2's GPU): with none of them,
``backend='auto'`` does not import torch to ask it for a GPU."""


def _why_not_import(framework: str, device: Optional[str]) -> Optional[str]:
    """Why ``backend='auto'`` does not import ``framework`` (not imported yet) to check a backend
    that needs it; None: it imports it. The array framework a caller works in is imported already
    (a torch or MLX model is), and its backends are checked as ever; one not imported is worth
    its import (torch 1.5 s, MLX 0.1 s here) only where it may give an accelerator."""
    dev = None if device is None else str(device).lower()
    if dev is not None and dev != "cpu" and not dev.startswith("cpu:"):
        return None             # a device was named: every backend that may serve it is checked
    if framework == "torch":
        where = "the cache is on the CPU" if dev is not None else None
        if where is None and sys.platform == "darwin":
            where = "macOS has no CUDA or ROCm GPU"
        if where is None and sys.platform.startswith("linux") \
                and not any(os.path.exists(node) for node in _GPU_DEVICE_NODES):
            where = f"no GPU device file ({', '.join(_GPU_DEVICE_NODES)}) exists"
        return where and f"torch is not imported and {where}"
    if framework == "mlx":
        import platform
        if sys.platform == "darwin" and platform.machine() == "arm64":
            return None         # Apple silicon: MLX may give the Metal GPU
        return "mlx is not imported and this is not macOS on Apple silicon (no Metal GPU)"
    return None


def _auto_rows(device: Optional[str]) -> list[dict[str, Any]]:
    """``list_backends(device)`` for ``backend='auto'``, without importing a framework that cannot
    change the choice. The backends are listed inside ``deferred_frameworks()`` first; one whose
    check needs a framework not imported is then checked for real (importing it) only when it
    could rank above the best backend found available so far (its priority is higher, or unknown
    without the framework) and ``_why_not_import`` finds the import worth it; otherwise it is
    listed unavailable, saying why it was not checked (naming the backend checks it). The pick
    (and each fallback of ``open_backend``) is checked again outside the deferral before use."""
    with deferred_frameworks():
        classes, broken, duplicates = _plugin_backends()
        checked = [_check(cls, device) for cls in classes.values()]
    best = max((row["priority"] for row, needs in checked
                if row["available"] and row["priority"] is not None), default=None)
    rows = []
    for row, needs in checked:
        if needs is not None:
            below = row["priority"] is not None and best is not None and row["priority"] < best
            why = f"a backend of priority {best} is available" if below else _why_not_import(needs, device)
            if why is None:
                row = _check(row["class"], device)[0]          # imports the framework
            else:
                row = dict(row, available=False, reason=(
                    f"not checked by backend='auto' (it needs {needs}, not imported: {why}); "
                    f"backend={row['name']!r} checks it"))
        rows.append(row)
    _by_priority(rows)
    return rows + _unloaded_rows(broken, duplicates)


def _auto_candidates(device: Optional[str], rows: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """The available rows of ``_auto_rows``, best first, each checked again outside the deferral
    (a framework's stand-in imports cleanly where the framework itself may fail to)."""
    for row in rows:
        if row["available"] and row["class"] is not None:
            again = _check(row["class"], device)[0]
            if again["available"]:
                yield again
            else:
                row.update(available=False, reason=again["reason"])


def available_backends(device: Optional[str] = None) -> list[str]:
    """Names of the backends that can run here, highest priority first."""
    return [row["name"] for row in list_backends(device) if row["available"]]


def _table(rows) -> str:
    return "\n".join(f"  - {r['name']}: {'available' if r['available'] else 'unavailable'} ({r['reason']})"
                     for r in rows)


def open_backend(name: str, device: Optional[str], make: Callable[[type[Backend]], T]
                 ) -> T:
    """``make(cls)`` for the backend class ``name`` resolves to. With ``"auto"``, a backend whose
    ``make`` fails with anything but a ``KVCacheError`` (its constructor or ``allocate_pages``
    raising, e.g. a driver that reports a device it cannot use) is skipped with a
    ``RuntimeWarning`` saying why, and the next available backend by priority is tried; when
    every one fails, ``BackendNotAvailableError`` lists each failure. A ``KVCacheError`` (the
    configuration asks for what the backend lacks, or more memory than it has) is the caller's
    to see and stops the search; so does a backend named explicitly, whose error is raised as
    is."""
    if name != "auto":
        return make(resolve_backend(name, device))
    rows = _auto_rows(device)
    skipped: list[str] = []
    for row in _auto_candidates(device, rows):
        try:
            return make(row["class"])
        except KVCacheError:
            raise
        except Exception as exc:    # a plugin's own failure: fall back, saying why
            why = f"backend {row['name']!r} failed to start: {type(exc).__name__}: {exc}"
            skipped.append(why)
            warnings.warn(f"backend='auto' skipped {why}", RuntimeWarning, stacklevel=3)
    if not skipped:
        raise BackendNotAvailableError(
            f"no kvcache backend is available for device={device!r}; registered backends:\n{_table(rows)}")
    raise BackendNotAvailableError(
        f"no kvcache backend could start for device={device!r} (backend='auto'):\n"
        + "\n".join(f"  - {why}" for why in skipped))


def resolve_backend(name: str = "auto", device: Optional[str] = None) -> type[Backend]:
    """The backend class for ``name`` ('auto': the highest-priority available one). A name loads
    only the plugins whose entry point has that name, unless they do not provide it."""
    if isinstance(name, str) and name != "auto":     # anything else fails below, with the table
        _load_entry_points(name)
        classes, _, duplicates = _plugin_backends(everything=False)
        cls = classes.get(name)
        if cls is not None and name not in duplicates:
            try:
                ok, reason = cls.availability(device)
            except Exception as exc:
                ok, reason = False, f"availability() raised {type(exc).__name__}: {exc}"
            if ok:
                return cls
    if name == "auto":
        rows = _auto_rows(device)
        for row in _auto_candidates(device, rows):
            return row["class"]
        raise BackendNotAvailableError(
            f"no kvcache backend is available for device={device!r}; registered backends:\n{_table(rows)}")
    rows = list_backends(device)
    for row in rows:
        if row["name"] == name:
            if row["available"]:
                return row["class"]
            raise BackendNotAvailableError(
                f"backend {name!r} is not available: {row['reason']}; registered backends:\n{_table(rows)}")
    raise BackendNotAvailableError(
        f"unknown backend {name!r}; registered backends:\n{_table(rows)}")


# ------------------------------------------------------------------ deferred frameworks
DEFERRED_FRAMEWORKS = ("torch", "triton", "mlx")
"""The packages ``deferred_frameworks()`` does not import: each takes 0.2 s to seconds."""


class FrameworkNotImported(BaseException):
    """Raised inside ``deferred_frameworks()`` where a backend's code uses a framework that is not
    imported. A ``BaseException``, so that a backend's ``except Exception`` (written for a missing
    or broken framework) cannot mistake it for one."""

    def __init__(self, module: str):
        super().__init__(module)
        self.module = module
        self.framework = module.partition(".")[0]


_state = threading.local()      # .forbid: >0 while a deferred framework must not be imported
_resolved: "weakref.WeakKeyDictionary[types.ModuleType, types.ModuleType]" = weakref.WeakKeyDictionary()
_imported_for_real: set[str] = set()     # top-level names a stand-in has imported since
_deferring = 0                           # open deferred_frameworks() contexts, all threads


_SPEC_ATTRIBUTES = frozenset(("__name__", "__loader__", "__package__", "__spec__", "__path__",
                              "__file__", "__cached__"))


class _DeferredModule(types.ModuleType):
    """What ``import torch`` binds inside ``deferred_frameworks()``: a module whose code has not
    run. The attributes its spec gives (``__name__``, ``__path__``, ``__spec__``, submodules)
    answer at once; any other imports the real module and reads it there (inside the listing's
    checks it raises ``FrameworkNotImported`` instead). Then the modules that bound the stand-in
    are given the real module, and the stand-in passes every read and write on to it."""

    def __getattr__(self, attr: str) -> Any:
        if attr in _SPEC_ATTRIBUTES and self not in _resolved:
            raise AttributeError(attr)    # the import machinery asking: the spec said all it has
        return getattr(_resolve(self), attr)

    def __setattr__(self, attr: str, value: Any) -> None:
        real = _resolved.get(self)
        if real is None:
            super().__setattr__(attr, value)
        else:
            setattr(real, attr, value)

    def __dir__(self) -> Iterable[str]:
        real = _resolved.get(self)
        return dir(real) if real is not None else super().__dir__()


def _resolve(stub: _DeferredModule) -> types.ModuleType:
    real = _resolved.get(stub)
    if real is not None:
        return real
    name = stub.__dict__["__name__"]
    if getattr(_state, "forbid", 0):
        raise FrameworkNotImported(name)
    top = name.partition(".")[0]
    _imported_for_real.add(top)
    for key, module in list(sys.modules.items()):     # this package's stand-ins make way
        if (key == top or key.startswith(top + ".")) and isinstance(module, _DeferredModule) \
                and module not in _resolved:
            del sys.modules[key]
    real = importlib.import_module(name)
    _resolved[stub] = real
    for module in list(sys.modules.values()):     # `import torch` bound the stand-in: now torch
        try:
            namespace = object.__getattribute__(module, "__dict__")
        except AttributeError:
            continue
        for key, value in list(namespace.items()):
            if value is stub:
                namespace[key] = real
    return real


class _DeferringLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return _DeferredModule(spec.name)

    def exec_module(self, module):
        pass                      # the real module's code runs at its first use


class _DeferringFinder(importlib.abc.MetaPathFinder):
    """Finds a deferred framework's modules as the other finders would, and hands out stand-ins
    for them: one that is not installed still fails to import, as it should."""

    loader = _DeferringLoader()

    def find_spec(self, fullname, path=None, target=None):
        top = fullname.partition(".")[0]
        if top not in DEFERRED_FRAMEWORKS or top in _imported_for_real or not _deferring:
            return None
        parent = sys.modules.get(top)
        if parent is not None and not isinstance(parent, _DeferredModule):
            return None           # imported already: nothing to save
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                spec.loader = self.loader
                return spec
        return None


_finder = _DeferringFinder()


@contextlib.contextmanager
def _loading_allowed() -> Iterator[None]:
    """Inside ``deferred_frameworks()``: a use of a framework imports it (loading a plugin)."""
    forbid = getattr(_state, "forbid", 0)
    _state.forbid = 0
    try:
        yield
    finally:
        _state.forbid = forbid


@contextlib.contextmanager
def deferred_frameworks() -> Iterator[None]:
    """Within: torch, Triton and MLX are not imported. Plugins load with stand-ins for them;
    ``list_backends`` lists a backend whose availability needs one as not checked, and code of
    this thread that uses one raises ``FrameworkNotImported``. Outside, a stand-in left in a
    plugin imports its module at the first use, so the process works on as if nothing was
    deferred. ``kvcache info`` lists in here unless asked to ``--check``."""
    global _deferring
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    _deferring += 1
    forbid = getattr(_state, "forbid", 0)
    _state.forbid = forbid + 1
    try:
        yield
    finally:
        _state.forbid = forbid
        _deferring -= 1
        if not _deferring:
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(_finder)
            for key, module in list(sys.modules.items()):    # `import torch` elsewhere: the real one
                if isinstance(module, _DeferredModule) and module not in _resolved:
                    del sys.modules[key]
