"""Every public name of kvcache's API has a docstring (issue 30, finding 5): the API reference
(``tools/build_docs.sh``, mkdocs + mkdocstrings) is rendered from them.

What is walked: ``kvcache.__all__``, ``kvcache.reference``, ``kvcache.transfer``,
``kvcache.distributed`` (+ ``.tp``, ``.transfer``), ``kvcache.integrations`` (+ ``.engine``,
``.sampling``, ``.runner``, and ``.transformers``, ``.tp``, ``.mlx_lm`` where their model library
is installed), ``kvcache.serving``, and ``kvcache.conformance`` (its ``__all__`` test classes and
the building blocks it exports). A module's public names
are its ``__all__`` (or, without one, the names it defines that do not start with ``_``).

The rule, for each name:

* a module, class, function, method or property: a docstring of its own (a method that overrides
  a documented one of a base class inherits its docstring, as ``inspect.getdoc`` does; a class
  needs its own: a dataclass's generated ``Name(field: type, ...)`` does not count);
* a class: every public method and property it defines, and those of its bases that kvcache
  defines (each checked where it is defined); not the methods of a pytest test class
  (``Test*``: the suite's test names say what they test);
* a field (a public name annotated in a class body: dataclass and NamedTuple fields, annotated
  class attributes): an attribute docstring (the string literal right after it, which the
  reference renders), or a ``field(metadata={"doc": ...})`` sentence, or the class docstring
  naming it as ````name```` (or ``name:`` at the start of a line, as in an ``Attributes:``
  section);
* a module-level constant: an attribute docstring after its assignment in the module that
  defines it, or that module's docstring naming it as ````NAME````.

Any name missing one fails ``test_public_api_is_documented``, which lists them all.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import re
import sys
import textwrap
import types
from pathlib import Path

import pytest

API_PAGES = Path(__file__).resolve().parents[2] / "docs" / "api"

MODULES = [
    "kvcache", "kvcache.reference", "kvcache.transfer", "kvcache.distributed",
    "kvcache.distributed.tp", "kvcache.distributed.transfer", "kvcache.integrations",
    "kvcache.integrations.engine", "kvcache.integrations.sampling", "kvcache.integrations.runner",
    "kvcache.integrations.transformers", "kvcache.integrations.tp",
    "kvcache.integrations.mlx_lm", "kvcache.serving", "kvcache.conformance",
]
# walked where the model library they adapt is installed (`make` installs both)
OPTIONAL = {"kvcache.integrations.transformers": "transformers",
            "kvcache.integrations.tp": "transformers", "kvcache.integrations.mlx_lm": "mlx_lm"}


def _own_doc(obj) -> str:
    doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)
    if not isinstance(doc, str) or not doc.strip():
        return ""
    if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, tuple)) \
            and doc.startswith(obj.__name__ + "("):
        return ""               # the generated signature of a dataclass / NamedTuple
    return doc


def _method_doc(cls, name, member) -> str:
    func = member.fget if isinstance(member, property) else member
    func = getattr(func, "__func__", func)           # staticmethod / classmethod
    if isinstance(func, functools.cached_property):
        func = func.func
    doc = getattr(func, "__doc__", None)
    if isinstance(doc, str) and doc.strip():
        return doc
    for base in cls.__mro__[1:]:                     # an override of a documented method
        if name in vars(base):
            return _method_doc(base, name, vars(base)[name])
    return ""


@functools.lru_cache(maxsize=None)
def _module_tree(modname: str):
    return ast.parse(inspect.getsource(importlib.import_module(modname)))


def _attribute_docs(body) -> set[str]:
    """Names assigned in ``body`` (a class or module body) that a string literal follows."""
    out = set()
    for stmt, after in zip(body, body[1:]):
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) \
                and isinstance(after.value.value, str):
            targets = [stmt.target] if isinstance(stmt, ast.AnnAssign) else \
                stmt.targets if isinstance(stmt, ast.Assign) else []
            out.update(t.id for t in targets if isinstance(t, ast.Name))
    return out


def _class_node(cls):
    try:
        tree = _module_tree(cls.__module__)
    except (OSError, TypeError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            return node
    return None


def _named_in(doc: str, name: str) -> bool:
    at_line_start = rf"^\s*(\* )?`{{0,2}}{re.escape(name)}`{{0,2}}\s*(\(|:)"
    return f"``{name}``" in doc or re.search(at_line_start, doc, re.M) is not None


def _field_gaps(cls, where: str, checked: set) -> list[str]:
    own = cls.__dict__.get("__annotations__", {})
    names = [n for n in own if not n.startswith("_")]
    checked.update(f"{where}.{n}" for n in names)
    if not names:
        return []
    node = _class_node(cls)
    documented = _attribute_docs(node.body) if node is not None else set()
    meta = {f.name for f in dataclasses.fields(cls) if f.metadata.get("doc")} \
        if dataclasses.is_dataclass(cls) else set()
    doc = _own_doc(cls)
    return [f"{where}.{n}" for n in names
            if n not in documented and n not in meta and not _named_in(doc, n)]


def _defining_module(modname: str, name: str) -> str:
    """The module whose source assigns ``name`` (following ``from X import name``, and
    ``kvcache.conformance``'s lazy ``_WHERE`` table)."""
    lazy = getattr(importlib.import_module(modname), "_WHERE", {})
    if name in lazy:
        return f"{modname}.{lazy[name]}"
    for stmt in _module_tree(modname).body:
        if isinstance(stmt, ast.ImportFrom) and any(a.name == name and a.asname is None
                                                    for a in stmt.names):
            package = modname if hasattr(importlib.import_module(modname), "__path__") \
                else modname.rpartition(".")[0]
            base = importlib.util.resolve_name("." * stmt.level + (stmt.module or ""), package)
            return _defining_module(base, name)
    return modname


def _constant_gap(modname: str, name: str) -> list[str]:
    home = _defining_module(modname, name)
    tree = _module_tree(home)
    if name in _attribute_docs(tree.body) or f"``{name}``" in (ast.get_docstring(tree) or ""):
        return []
    return [f"{home}.{name}"]


def _class_gaps(cls, seen: set, checked: set | None = None) -> list[str]:
    """The undocumented names of ``cls`` and of its kvcache bases not in ``seen`` (each class
    once); every name checked is added to ``checked``."""
    gaps = []
    checked = set() if checked is None else checked
    for klass in cls.__mro__:
        if not klass.__module__.startswith("kvcache") or klass in seen:
            continue
        seen.add(klass)
        where = f"{klass.__module__}.{klass.__qualname__}"
        checked.add(where)
        if not _own_doc(klass):
            gaps.append(where)
        gaps += _field_gaps(klass, where, checked)
        if klass.__name__.startswith("Test"):
            continue
        for name, member in vars(klass).items():
            if name.startswith("_") or name in klass.__dict__.get("__annotations__", {}):
                continue
            if isinstance(member, (types.FunctionType, staticmethod, classmethod, property,
                                   functools.cached_property)):
                checked.add(f"{where}.{name}")
                if not _method_doc(klass, name, member):
                    gaps.append(f"{where}.{name}")
    return gaps


def _public_names(module) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    return [n for n, v in vars(module).items() if not n.startswith("_")
            and getattr(v, "__module__", None) == module.__name__]


def undocumented() -> tuple[set[str], set[str], set[str]]:
    """(missing docstrings, every name walked, the ``OPTIONAL`` modules skipped) over
    ``MODULES``."""
    missing: list[str] = []
    walked: set[str] = set()
    skipped: set[str] = set()
    seen_classes: set = set()
    seen_funcs: set = set()
    for modname in MODULES:
        if modname in OPTIONAL:
            try:
                importlib.import_module(OPTIONAL[modname])
            except ImportError:
                skipped.add(modname)
                continue
        module = importlib.import_module(modname)
        walked.add(modname)
        if not (module.__doc__ or "").strip():
            missing.append(modname)
        names = _public_names(module)
        if modname == "kvcache.conformance":
            names += sorted(module._WHERE)
        for name in names:
            obj = getattr(module, name)
            if isinstance(obj, type):
                missing += _class_gaps(obj, seen_classes, walked)
            elif isinstance(obj, types.ModuleType):
                continue
            elif inspect.isroutine(obj):
                key = f"{getattr(obj, '__module__', modname)}.{getattr(obj, '__qualname__', name)}"
                walked.add(key)
                if key not in seen_funcs:
                    seen_funcs.add(key)
                    if not _own_doc(obj):
                        missing.append(key)
            else:
                gap = _constant_gap(modname, name)
                walked.add(f"{_defining_module(modname, name)}.{name}")
                missing += gap
    return set(missing), walked, skipped


def top_level_names() -> dict[str, str]:
    """{where a walked module exports it: where it is defined} for every public name of
    ``MODULES`` (the ``OPTIONAL`` ones where importable), modules left out."""
    out = {}
    for modname in MODULES:
        if modname in OPTIONAL:
            try:
                importlib.import_module(OPTIONAL[modname])
            except ImportError:
                continue
        module = importlib.import_module(modname)
        names = _public_names(module)
        if modname == "kvcache.conformance":
            names += sorted(module._WHERE)
        for name in names:
            obj = getattr(module, name)
            if isinstance(obj, types.ModuleType):
                continue
            if isinstance(obj, type) or inspect.isroutine(obj):
                home = f"{obj.__module__}.{obj.__qualname__}"
            else:
                home = f"{_defining_module(modname, name)}.{name}"
            out[f"{modname}.{name}"] = home
    return out


def rendered_directives() -> dict[str, list[str] | None]:
    """The API pages' mkdocstrings directives: {object path: its ``members`` list, None for
    all of its public members, [] for ``members: false``}."""
    found: dict[str, list[str] | None] = {}
    for page in sorted(API_PAGES.glob("*.md")):
        current = None
        for line in page.read_text().splitlines():
            start = re.match(r"^::: (\S+)\s*$", line)
            if start:
                current = start.group(1)
                found[current] = None
                continue
            members = re.match(r"^\s+members:\s*(.*?)\s*$", line)
            if current is not None and members:
                value = members.group(1)
                found[current] = [] if value == "false" else \
                    [m.strip() for m in value.strip("[]").split(",") if m.strip()]
            elif line and not line.startswith(" "):
                current = None
    return found


def _renders(directives: dict, path: str) -> bool:
    if path in directives:
        return True
    parent, _, name = path.rpartition(".")
    members = directives.get(parent, [])
    return members is None or name in members


@functools.lru_cache(maxsize=None)
def _result():
    return undocumented()


def test_public_api_is_documented():
    missing, _, _ = _result()
    assert not missing, "public names without a docstring:\n" + "\n".join(sorted(missing))


def test_the_reference_renders_every_public_name():
    """Each walked module's public names appear in the API reference (docs/api/*.md): a
    ``::: path`` directive for the object, for the module that defines it, or for the module
    that exports it (with the name among its ``members`` where it lists them)."""
    directives = rendered_directives()
    assert directives, f"no mkdocstrings directive in {API_PAGES}"
    missing = sorted(f"{where} (defined as {home})" for where, home in top_level_names().items()
                     if not _renders(directives, home) and not _renders(directives, where))
    assert not missing, "public names the API reference leaves out (add them to a page in " \
        "docs/api):\n" + "\n".join(missing)


def test_the_check_catches_a_missing_docstring(tmp_path, monkeypatch):
    """The rule itself: a class without a docstring, an undocumented method, a dataclass field
    with no attribute docstring, and a dataclass's generated __doc__ are all caught; an attribute
    docstring, a field named in the class docstring and an inherited method docstring count."""
    (tmp_path / "kvcache_docprobe.py").write_text(textwrap.dedent('''
        import dataclasses

        @dataclasses.dataclass
        class Plain:
            size: int
            shape: tuple = ()
            """Documented."""

            def method(self):
                pass

            def documented(self):
                """Yes."""

        @dataclasses.dataclass
        class Named:
            """``rows`` are documented here, and so is the next one.

            Attributes:
                cols: the columns.
            """

            rows: int
            cols: int
            depth: int

        class Sub(Plain):
            def documented(self):       # inherits the base's docstring
                pass
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "kvcache_docprobe", raising=False)
    probe = importlib.import_module("kvcache_docprobe")
    try:
        gaps = _class_gaps(probe.Sub, set()) + _class_gaps(probe.Named, set())
    finally:
        del sys.modules["kvcache_docprobe"]
        _module_tree.cache_clear()
    assert sorted(gaps) == ["kvcache_docprobe.Named.depth", "kvcache_docprobe.Plain",
                            "kvcache_docprobe.Plain.method", "kvcache_docprobe.Plain.size",
                            "kvcache_docprobe.Sub"]
