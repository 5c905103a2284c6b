"""The Python subset a traced NKI kernel body may use, checked on the kernel's source before it runs.

The interpreter executes any Python, but NKI's compiler traces a documented subset: plain arithmetic,
``assert``, loops, conditionals, slices and calls. AWS's kernels (nki-library) and this project's follow it;
shape contracts that need ``raise`` belong on the host (``kernels/host.py``). This module rejects, in the
kernel function and in every function of the same module it calls by name (helpers are traced too):

* ``lambda`` expressions,
* ``raise`` statements,
* dictionaries: ``dict(...)``, ``{...}`` literals and dict comprehensions,
* ``try`` blocks (exceptions do not exist in the traced program).

Helpers imported from a sibling module of the kernel's package (e.g. ``kernels/projections.py``) are traced too.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types

from .machine import NkiValidationError

_RULES = (
    (ast.Lambda, "a lambda"),
    (ast.Raise, "a raise statement (check shapes on the host, kernels/host.py)"),
    (ast.Dict, "a dict literal"),
    (ast.DictComp, "a dict comprehension"),
    (ast.Try, "a try block"),
)


def _source_tree(fn: types.FunctionType) -> ast.AST:
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError) as exc:
        raise NkiValidationError(
            f"kernel {fn.__qualname__}: its source is unavailable ({exc}), so the traced-kernel subset cannot be checked; "
            "define kernels in a .py file"
        ) from None
    return ast.parse(textwrap.dedent(source))


def _violation(node: ast.AST) -> str | None:
    for kind, what in _RULES:
        if isinstance(node, kind):
            return what
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
        return "a dict(...) call"
    return None


def _traced_with(target: types.FunctionType, fn: types.FunctionType) -> bool:
    """A helper is traced with the kernel when it lives in the kernel's module or in a sibling kernel module of
    the same package (shared projection helpers), not in the interpreter or the NKI binding."""
    if target.__module__ == fn.__module__:
        return True
    package = fn.__module__.rpartition(".")[0]
    return bool(package) and target.__module__.rpartition(".")[0] == package and not target.__module__.endswith("nki_api")


def _called_helpers(tree: ast.AST, fn: types.FunctionType) -> list[types.FunctionType]:
    """Plain functions of ``fn``'s module or a sibling kernel module that ``fn`` calls by a bare name (traced with it)."""
    helpers = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            target = fn.__globals__.get(node.func.id)
            target = getattr(target, "fn", target)  # a @jit Kernel called from another kernel
            if isinstance(target, types.FunctionType) and _traced_with(target, fn):
                helpers.append(target)
    return helpers


def check_traced_subset(fn: types.FunctionType) -> None:
    """Raise :class:`NkiValidationError` naming the function and line of the first construct outside the subset."""
    seen: set[types.FunctionType] = set()
    pending = [fn]
    while pending:
        f = pending.pop()
        if f in seen:
            continue
        seen.add(f)
        tree = _source_tree(f)
        first_line = f.__code__.co_firstlineno
        body = tree.body[0]
        for node in ast.walk(body):
            if node is not body and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                what = "a nested function or class definition"
            else:
                what = _violation(node)
            if what:
                line = first_line + getattr(node, "lineno", 1) - 1
                where = f"{f.__code__.co_filename}:{line}"
                via = "" if f is fn else f" (called from kernel {fn.__qualname__})"
                raise NkiValidationError(
                    f"{f.__qualname__}{via} uses {what} at {where}: NKI traces only a Python subset "
                    "(arithmetic, assert, loops, if, slices, calls); rewrite it without this construct"
                )
        pending.extend(_called_helpers(body, f))
