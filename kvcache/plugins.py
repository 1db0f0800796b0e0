"""Backend discovery: pluggy over the ``kvcache`` entry-point group.

``KVCACHE_PLUGINS`` (comma-separated entry-point names) limits which plugins load; empty string
loads none but the built-in reference backend's entry point is still subject to the filter.
"""

from __future__ import annotations

import os
from importlib.metadata import entry_points
from typing import Optional

import pluggy

from . import hookspecs
from .backend import Backend
from .errors import BackendNotAvailableError

ENTRY_POINT_GROUP = "kvcache"
_manager: Optional[pluggy.PluginManager] = None
_load_errors: dict[str, str] = {}


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, loading entry points on first use."""
    global _manager
    if _manager is None:
        pm = pluggy.PluginManager("kvcache")
        pm.add_hookspecs(hookspecs)
        allowed = os.environ.get("KVCACHE_PLUGINS")
        wanted = None if allowed is None else {n.strip() for n in allowed.split(",") if n.strip()}
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if wanted is not None and ep.name not in wanted:
                continue
            if pm.get_plugin(ep.name) is not None:
                continue
            try:
                pm.register(ep.load(), name=ep.name)
            except Exception as exc:  # a broken plugin must not hide the others
                _load_errors[ep.name] = f"failed to load: {type(exc).__name__}: {exc}"
        pm.check_pending()
        _manager = pm
    return _manager


def reset_plugins() -> None:
    """Forget loaded plugins (tests, or after installing a plugin at run time)."""
    global _manager
    _manager = None
    _load_errors.clear()


def register_plugin(module_or_object, name: Optional[str] = None) -> None:
    """Register a plugin object in-process (tests, notebooks); same hooks as entry points."""
    pm = get_plugin_manager()
    pm.register(module_or_object, name=name)
    pm.check_pending()


def _plugin_backends() -> tuple[dict[str, type[Backend]], dict[str, str]]:
    """Every registered backend class by name, and {plugin name: why it is unusable} for each
    plugin whose ``kvcache_register_backends`` raised or returned something that is not a list of
    Backend subclasses. Each plugin's hook is called on its own, so one broken plugin (a missing
    dependency, a bug) does not hide the others."""
    found: dict[str, type[Backend]] = {}
    broken: dict[str, str] = {}
    hook = get_plugin_manager().hook.kvcache_register_backends
    # pluggy calls the last registered implementation first; keep that order (first name wins).
    for impl in reversed(hook.get_hookimpls()):
        if impl.hookwrapper or impl.wrapper:
            broken[impl.plugin_name] = "hook wrappers are not supported for kvcache_register_backends"
            continue
        try:
            classes = list(impl.function() or ())
        except Exception as exc:   # reported by list_backends, never raised from here
            broken[impl.plugin_name] = f"kvcache_register_backends raised {type(exc).__name__}: {exc}"
            continue
        bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, Backend))]
        if bad:
            broken[impl.plugin_name] = (f"kvcache_register_backends returned {bad[0]!r}, "
                                        f"not a Backend subclass")
            continue
        for cls in classes:
            found.setdefault(cls.name, cls)
    return found, broken


def backend_classes() -> dict[str, type[Backend]]:
    """Every registered backend class by name (plugins whose hook fails are left out; see
    ``list_backends`` for why)."""
    return _plugin_backends()[0]


def list_backends(device: Optional[str] = None) -> list[dict]:
    """All registered backends, highest priority first: name, priority, available, reason. A plugin
    that failed to load or whose hook raised is listed by its plugin name as unavailable (class
    None) with the error as its reason."""
    classes, broken = _plugin_backends()
    rows = []
    for cls in sorted(classes.values(), key=lambda c: -c.priority):
        try:
            ok, reason = cls.availability(device)
        except Exception as exc:
            ok, reason = False, f"availability() raised {type(exc).__name__}: {exc}"
        rows.append({"name": cls.name, "priority": cls.priority, "available": bool(ok),
                     "reason": reason, "class": cls})
    for name, why in list(_load_errors.items()) + list(broken.items()):
        rows.append({"name": name, "priority": None, "available": False, "reason": why, "class": None})
    return rows


def available_backends(device: Optional[str] = None) -> list[str]:
    """Names of the backends that can run here, highest priority first."""
    return [row["name"] for row in list_backends(device) if row["available"]]


def _table(rows) -> str:
    return "\n".join(f"  - {r['name']}: {'available' if r['available'] else 'unavailable'} ({r['reason']})"
                     for r in rows)


def resolve_backend(name: str = "auto", device: Optional[str] = None) -> type[Backend]:
    """The backend class for ``name`` ('auto': the highest-priority available one)."""
    rows = list_backends(device)
    if name == "auto":
        for row in rows:
            if row["available"] and row["class"] is not None:
                return row["class"]
        raise BackendNotAvailableError(
            f"no kvcache backend is available for device={device!r}; registered backends:\n{_table(rows)}")
    for row in rows:
        if row["name"] == name:
            if row["available"]:
                return row["class"]
            raise BackendNotAvailableError(
                f"backend {name!r} is not available: {row['reason']}; registered backends:\n{_table(rows)}")
    raise BackendNotAvailableError(
        f"unknown backend {name!r}; registered backends:\n{_table(rows)}")
