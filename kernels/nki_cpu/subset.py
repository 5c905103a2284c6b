"""The Python subset a traced NKI kernel body may use, checked on the kernel's source before it runs.

The interpreter executes any Python, but "the NKI compiler ... only supports a restricted subset of Python for
meta-programming" (aws-neuron-sdk @81ce03ae ``nki/guides/nki_simulator.rst``), which the NKI Language Guide
(``nki/get-started/nki-language-guide.rst``) lists: None, bools, 32-bit ints and floats, strings, tensors; tuples,
lists, "Dictionaries with string-value keys", simple classes; ``if``, ``for``, ``while``; functions (inlined).
This module rejects, in the kernel function and in every function of the same module it calls by name (helpers are
traced too), what that list leaves out:

* ``lambda`` expressions and nested function / class definitions (the guide passes module-level functions),
* ``raise`` statements and ``try`` blocks (the traced program has no exceptions; shape contracts that need
  ``raise`` belong on the host, ``kernels/host.py``),
* dictionary keys that are not strings ("the keys must be string values"): a dict literal or comprehension with a
  non-string constant key.
Dictionaries with string keys (``{...}``, ``dict(...)``) are allowed.

Helpers imported from a sibling module of the kernel's package (e.g. ``kernels/projections.py``) are traced too.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types

from .rules import GUIDE, rule

SUBSET = rule("PY-SUBSET", GUIDE, "Dictionaries with string-value keys", "a kernel (and the helpers of its module and sibling "
              "modules it calls) uses the Language Guide's Python: no lambda, nested def/class, raise, try; dict keys strings")

_RULES = (
    (ast.Lambda, "a lambda"),
    (ast.Raise, "a raise statement (check shapes on the host, kernels/host.py)"),
    (ast.Try, "a try block"),
)


def _source_tree(fn: types.FunctionType) -> ast.AST:
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError) as exc:
        raise SUBSET.error(
            f"kernel {fn.__qualname__}: its source is unavailable ({exc}), so the traced-kernel subset cannot be checked; "
            "define kernels in a .py file"
        ) from None
    return ast.parse(textwrap.dedent(source))


def _violation(node: ast.AST) -> str | None:
    for kind, what in _RULES:
        if isinstance(node, kind):
            return what
    keys = node.keys if isinstance(node, ast.Dict) else [node.key] if isinstance(node, ast.DictComp) else []
    for k in keys:
        if isinstance(k, ast.Constant) and not isinstance(k.value, str):
            return f"a dictionary key {k.value!r} that is not a string (NKI dictionaries take string keys)"
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
                raise SUBSET.error(
                    f"{f.__qualname__}{via} uses {what} at {where}: NKI traces only a Python subset "
                    "(arithmetic, assert, loops, if, slices, calls); rewrite it without this construct"
                )
        pending.extend(_called_helpers(body, f))
