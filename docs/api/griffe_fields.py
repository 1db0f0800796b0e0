"""A griffe extension for the API reference (mkdocs.yml loads it): a dataclass field documented
by ``field(metadata={"doc": ...})`` (through a helper such as ``kvcache.backend._cap(default,
doc)``) gets that sentence as its docstring, so the reference shows it as it shows an attribute
docstring. ``tests/packaging/test_docstrings.py`` accepts the same two forms."""

from __future__ import annotations

import ast
from typing import Any

import griffe


def _doc_argument(call: ast.Call) -> str | None:
    """The doc sentence of ``_cap(default, "doc")`` or ``field(..., metadata={"doc": "..."})``."""
    name = call.func.id if isinstance(call.func, ast.Name) else \
        call.func.attr if isinstance(call.func, ast.Attribute) else ""
    if name == "_cap" and len(call.args) >= 2 and isinstance(call.args[1], ast.Constant):
        return call.args[1].value if isinstance(call.args[1].value, str) else None
    for keyword in call.keywords:
        if keyword.arg == "metadata" and isinstance(keyword.value, ast.Dict):
            for key, value in zip(keyword.value.keys, keyword.value.values):
                if isinstance(key, ast.Constant) and key.value == "doc" \
                        and isinstance(value, ast.Constant) and isinstance(value.value, str):
                    return value.value
    return None


class FieldMetadataDocs(griffe.Extension):
    """Attribute docstrings from dataclass field metadata (see the module docstring)."""

    def on_attribute_instance(self, *, node: Any, attr: griffe.Attribute, agent: Any,
                              **kwargs: Any) -> None:
        if attr.docstring is not None or not isinstance(node, ast.AnnAssign):
            return
        if isinstance(node.value, ast.Call):
            doc = _doc_argument(node.value)
            if doc:
                attr.docstring = griffe.Docstring(doc, lineno=node.lineno, parent=attr)
