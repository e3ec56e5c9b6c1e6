"""The API reference's contract (docs/api/, rendered by mkdocstrings from the docstrings): every
public name has a Google-style docstring, as torch and Horovod write them.

Public: ``hvd_sparse.__all__``, ``hvd_sparse.ddp.__all__``, ``hvd_sparse.sparsifiers.__all__``,
``Config`` and ``from_env_and_kwargs``, the CLI's ``main``, ``logs.configure`` and
``reduction.start``/``finish``; of each public class, the methods, static and class methods,
properties and callable attributes (``Compression.sparse``) defined in the class itself (or in
a private hvd_sparse base), whose names have no leading underscore, and ``__call__``. Names
re-exported from torch or Horovod are theirs to document.

Each needs a docstring of its own (an inherited one does not count) with:

- ``Args:`` naming every parameter but self/cls (``*args``/``**options`` as written), and no
  other; a class documents its constructor's parameters (a dataclass may use ``Attributes:``);
- ``Returns:`` (or ``Yields:``) unless the return annotation is None (properties, classes: none);
  unannotated, when the body returns a value;
- ``Raises:`` when the function's own body (not nested functions) has a ``raise``, naming every
  exception class raised there by name (a class: its ``__init__``'s);
- an ``Example:`` section, where there is one, holds ``>>>`` lines.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.unit

# Google-style section headers (mkdocstrings' google parser); a section ends at the next line
# that is not indented. "Arguments:"/"Parameters:" are not headers here: the style is "Args:".
HEADERS = ("Args", "Attributes", "Returns", "Yields", "Raises", "Example", "Examples", "Note",
           "Notes", "Warning", "Warnings", "See Also", "References")
HEADER = re.compile(rf"^({'|'.join(HEADERS)}):\s*$")
ENTRY = re.compile(r"^(\*{0,2}[A-Za-z_][\w.]*)\s*(\([^)]*\))?\s*:(\s|$)")
REEXPORTED = ("torch", "horovod")  # modules whose objects hvd_sparse may re-export as they are
MODULE_LISTS = ("hvd_sparse", "hvd_sparse.ddp", "hvd_sparse.sparsifiers")
SINGLE_NAMES = ("hvd_sparse.config.Config", "hvd_sparse.config.from_env_and_kwargs",
                "hvd_sparse.tools.cli.main", "hvd_sparse.logs.configure",
                "hvd_sparse.reduction.start", "hvd_sparse.reduction.finish")


def sections(doc: str) -> dict[str, list[str]]:
    """Section name -> its body lines (dedented), of a cleaned docstring."""
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in doc.splitlines():
        m = HEADER.match(line)
        if m:
            current = out.setdefault(m.group(1), [])
        elif line and not line[0].isspace():
            current = None  # back to prose
        elif current is not None:
            current.append(line)
    return {k: textwrap.dedent("\n".join(v)).strip("\n").splitlines() for k, v in out.items()}


def entries(body: list[str]) -> list[str]:
    """The names an Args/Attributes/Raises section lists (its unindented ``name: ...`` lines)."""
    return [m.group(1) for line in body if (m := ENTRY.match(line))]


def _own_node(fn: Callable[..., Any]) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):  # generated (a dataclass's __init__) or not Python
        return None
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return node
    return None


def _own_nodes(node: ast.AST) -> Iterator[ast.AST]:
    """``node``'s body, not descending into nested functions, lambdas or classes."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda | ast.ClassDef):
            continue
        yield child
        yield from _own_nodes(child)


def _raised_name(exc: ast.expr | None) -> str | None:
    """``raise Foo(...)``/``raise mod.Foo`` -> "Foo"; a re-raise or a variable -> None."""
    if isinstance(exc, ast.Call):
        exc = exc.func
    name = exc.id if isinstance(exc, ast.Name) else exc.attr if isinstance(exc, ast.Attribute) \
        else None
    return name if name and name[0].isupper() else None


def body_facts(fn: Callable[..., Any]) -> tuple[bool, set[str], bool]:
    """(own body raises, exception classes it raises by name, own body returns a value)."""
    node = _own_node(fn)
    if node is None:
        return False, set(), False
    raises, names, returns = False, set(), False
    for child in _own_nodes(node):
        if isinstance(child, ast.Raise):
            raises = True
            if (name := _raised_name(child.exc)) is not None:
                names.add(name)
        elif isinstance(child, ast.Return) and child.value is not None:
            returns = True
    return raises, names, returns


def _own_doc(obj: Any) -> str | None:
    doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)
    if isinstance(obj, type) and dataclasses.is_dataclass(obj) and doc \
            and doc.startswith(f"{obj.__name__}("):
        return None  # the signature dataclasses writes where the class has no docstring
    return inspect.cleandoc(doc) if doc and doc.strip() else None


def _check_sections(doc: str, params: list[str], param_sections: tuple[str, ...],
                    needs_returns: bool, raises: bool, raised: set[str]) -> list[str]:
    found = sections(doc)
    problems = []
    documented = [n for s in param_sections for n in entries(found.get(s, []))]
    if params and not any(s in found for s in param_sections):
        problems.append(f"no {' or '.join(s + ':' for s in param_sections)} section "
                        f"(parameters: {', '.join(params)})")
    else:
        missing = [p for p in params if p not in documented]
        if missing:
            problems.append(f"{param_sections[0]}: does not document {', '.join(missing)}")
        if "Args" in found:
            unknown = [n for n in entries(found["Args"]) if n not in params]
            if unknown:
                problems.append(f"Args: documents {', '.join(unknown)}, not a parameter")
    if needs_returns and not ({"Returns", "Yields"} & set(found)):
        problems.append("no Returns: section")
    for name in ("Returns", "Yields", "Raises"):
        if name in found and not "".join(found[name]).strip():
            problems.append(f"{name}: section is empty")
    if raises and "Raises" not in found:
        problems.append("no Raises: section (its body raises"
                        + (f" {', '.join(sorted(raised))})" if raised else ")"))
    elif raised:
        listed = {n.rsplit(".", 1)[-1] for n in entries(found.get("Raises", []))}
        if raised - listed:
            problems.append(f"Raises: does not name {', '.join(sorted(raised - listed))}")
    for name in ("Example", "Examples"):
        if name in found and not any(line.lstrip().startswith(">>>") for line in found[name]):
            problems.append(f"{name}: has no >>> line")
    return problems


def _params(sig: inspect.Signature, drop_first: bool) -> list[str]:
    ps = list(sig.parameters.values())[1 if drop_first else 0:]
    stars = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return [stars.get(p.kind, "") + p.name for p in ps]


def check_function(fn: Callable[..., Any], kind: str = "function") -> list[str]:
    """What ``fn``'s docstring lacks; ``kind``: "function", "method", "staticmethod",
    "classmethod" or "property" (a property's getter)."""
    doc = _own_doc(fn)
    if doc is None:
        return ["no docstring"]
    target = inspect.unwrap(fn)
    sig = inspect.signature(target)
    raises, raised, returns_value = body_facts(target)
    if kind == "property":
        params, needs_returns = [], False
    else:
        params = _params(sig, drop_first=kind in ("method", "classmethod"))
        ann = sig.return_annotation
        if ann is inspect.Signature.empty:
            needs_returns = returns_value or inspect.isgeneratorfunction(target)
        else:
            needs_returns = ann not in (None, "None")
        if target.__name__ == "__init__":
            needs_returns = False
    return _check_sections(doc, params, ("Args",), needs_returns, raises, raised)


def check_class(cls: type) -> list[str]:
    """What the class's docstring lacks to document its constructor (``cls(...)``)."""
    doc = _own_doc(cls)
    if doc is None:
        return ["no docstring"]
    owner = next(c for c in cls.__mro__ if "__init__" in c.__dict__)
    params: list[str] = []
    raises, raised = False, set()
    if owner.__module__.split(".")[0] not in ("builtins", *REEXPORTED):  # theirs to document
        params = _params(inspect.signature(cls), drop_first=False)
        raises, raised, _ = body_facts(owner.__dict__["__init__"])
    param_sections = ("Args", "Attributes") if dataclasses.is_dataclass(cls) else ("Args",)
    return _check_sections(doc, params, param_sections, False, raises, raised)


def members(cls: type) -> Iterator[tuple[str, Callable[..., Any], str]]:
    """(name, function, kind) of the class's public callables, defined in it or in a private
    hvd_sparse base (whose methods nobody else documents)."""
    seen: set[str] = set()
    for owner in cls.__mro__:
        if owner is not cls and not (owner.__module__.startswith("hvd_sparse")
                                     and owner.__name__.startswith("_")):
            continue
        for name, value in vars(owner).items():
            if name in seen or (name.startswith("_") and name != "__call__"):
                continue
            seen.add(name)
            if isinstance(value, staticmethod):
                yield name, value.__func__, "staticmethod"
            elif isinstance(value, classmethod):
                yield name, value.__func__, "classmethod"
            elif isinstance(value, property):
                yield name, value.fget, "property"
            elif inspect.isfunction(value):
                yield name, value, "method"
            elif not isinstance(value, type) and callable(value) \
                    and type(value).__module__.startswith("hvd_sparse"):
                yield name, type(value).__call__, "method"  # Compression.sparse(...)


def public_api() -> dict[str, Any]:
    """Public name -> object, each object once (under its first name)."""
    named: dict[str, Any] = {}
    for mod_name in MODULE_LISTS:
        mod = importlib.import_module(mod_name)
        for name in mod.__all__:
            named[f"{mod_name}.{name}"] = getattr(mod, name)  # lazy names resolve here
    for path in SINGLE_NAMES:
        mod_name, _, name = path.rpartition(".")
        named[path] = getattr(importlib.import_module(mod_name), name)
    out: dict[str, Any] = {}
    ids: set[int] = set()
    for name, obj in named.items():
        if id(obj) in ids or getattr(obj, "__module__", "").split(".")[0] in REEXPORTED:
            continue
        ids.add(id(obj))
        out[name] = obj
    return out


def offenders() -> list[str]:
    out = []
    for name, obj in public_api().items():
        if isinstance(obj, type):
            out += [f"{name}: {p}" for p in check_class(obj)]
            for attr, fn, kind in members(obj):
                out += [f"{name}.{attr}: {p}" for p in check_function(fn, kind)]
        elif callable(obj):
            out += [f"{name}: {p}" for p in check_function(obj)]
        else:
            out.append(f"{name}: neither a function nor a class")
    return out


def test_public_api_is_documented() -> None:
    found = offenders()
    assert not found, ("public names whose docstrings lack Google-style sections "
                       f"({len(found)}):\n  " + "\n  ".join(found))


def test_public_api_is_found() -> None:
    """The listing itself: the names the reference documents are all in it (so the check above
    cannot pass by finding nothing)."""
    api = public_api()
    for name in ("hvd_sparse.init", "hvd_sparse.allreduce_async", "hvd_sparse.TopK",
                 "hvd_sparse.SparseCompressor", "hvd_sparse.Compression", "hvd_sparse.metrics",
                 "hvd_sparse.ddp.State", "hvd_sparse.ddp.hook", "hvd_sparse.config.Config",
                 "hvd_sparse.tools.cli.main", "hvd_sparse.reduction.finish"):
        assert name in api, name
    topk = {n: k for n, _, k in members(api["hvd_sparse.TopK"])}
    assert topk["select"] == "method" and "__init__" not in topk and "STATE" not in topk
    sparsifier = {n: k for n, _, k in members(api["hvd_sparse.Sparsifier"])}
    assert sparsifier["rank"] == "property" and sparsifier["record_union"] == "staticmethod"
    assert "__call__" in sparsifier and "_steps" not in sparsifier
    assert "sparse" in {n for n, _, _ in members(api["hvd_sparse.Compression"])}


# --- the checker on examples: it must fail where a docstring lacks a section ---------------

def _prose(a: int, *rest: int, **options: int) -> int:
    """Adds ``a`` (prose, no sections)."""
    if a < 0:
        raise ValueError("negative")
    return a


def _good(a: int, *rest: int, **options: int) -> int:
    """Adds.

    Args:
        a: first.
        *rest: more.
        **options: named.

    Returns:
        The sum.

    Raises:
        ValueError: ``a`` < 0.

    Example:
        >>> _good(1)
        1
    """
    if a < 0:
        raise ValueError("negative")

    def inner() -> None:
        raise KeyError("nested functions' raises are their own")

    return a


def _partial(a: int, b: int) -> None:
    """Half.

    Args:
        a: first.
        c: gone.

    Raises:
        KeyError: never.

    Example:
        _partial(1, 2)
    """
    if a:
        raise TypeError("a")


def _unannotated(a):
    """Returns a value without saying so.

    Args:
        a: anything.
    """
    return a


class _Documented:
    """A class.

    Args:
        x: the value.

    Raises:
        ValueError: ``x`` < 0.
    """

    def __init__(self, x: int) -> None:
        if x < 0:
            raise ValueError("x")
        self.x = x

    @property
    def double(self) -> int:
        """Twice ``x``."""
        return 2 * self.x

    def bare(self, y: int) -> int:
        return y


class _Undocumented(_Documented):
    """No constructor parameters here."""

    def __init__(self, x: int, y: int) -> None:
        if y:
            raise RuntimeError("y")
        super().__init__(x)


def test_checker_fails_on_missing_sections() -> None:
    assert check_function(_good) == []
    assert check_function(_prose) == ["no Args: section (parameters: a, *rest, **options)",
                                      "no Returns: section",
                                      "no Raises: section (its body raises ValueError)"]
    assert check_function(_partial) == ["Args: does not document b",
                                        "Args: documents c, not a parameter",
                                        "Raises: does not name TypeError",
                                        "Example: has no >>> line"]
    assert check_function(_unannotated) == ["no Returns: section"]
    assert check_function(lambda: None) == ["no docstring"]
    assert check_class(_Documented) == []
    assert check_class(_Undocumented) == ["no Args: section (parameters: x, y)",
                                          "no Raises: section (its body raises RuntimeError)"]
    kinds = {n: (k, check_function(fn, k)) for n, fn, k in members(_Documented)}
    assert kinds == {"double": ("property", []), "bare": ("method", ["no docstring"])}
