"""Dataclass <-> plain JSON-able dict, with validation that names the bad field.

Every contract type (specs, graph, plan) goes through here, so a malformed plan or profile file
fails with one line such as ``plan.json: stages[1].device: expected str, got int``.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

from hetero.errors import PlanError

T = TypeVar("T")

# How deep a plan or profile file may nest (theirs is about 6 levels; a resolved config is a few more).
MAX_NESTING = 32


def short_repr(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters: an error message quotes the bad value, not all of it."""
    try:
        text = repr(value)
    except (RecursionError, ValueError):  # nested too deep to print; an int too long to print
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def nesting_depth(value: Any, limit: int = MAX_NESTING) -> int:
    """Levels of lists and dicts in ``value``, counted without recursion; stops counting past ``limit``."""
    deepest = 0
    stack = [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (dict, list, tuple)):
            level += 1
            if level > limit:
                return level
            deepest = max(deepest, level)
            stack.extend((v, level) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


def to_dict(obj: Any) -> Any:
    """Convert a dataclass tree to plain dicts/lists/scalars (tuples become lists)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_dict(v) for k, v in obj.items()}
    return obj


def from_dict(cls: type[T], data: Any, where: str = "", error: type[Exception] = PlanError) -> T:
    """Build ``cls`` from ``data``; unknown or missing fields and wrong types raise ``error``."""
    return _convert(cls, data, where or cls.__name__, error)


def _convert(tp: Any, value: Any, where: str, error: type[Exception]) -> Any:
    """``value`` checked against type ``tp`` (and built, for dataclasses), or ``error`` naming ``where``."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        return _convert_union(get_args(tp), value, where, error)
    if origin is typing.Literal:
        if not isinstance(value, (str, int)) or value not in get_args(tp):
            raise error(f"{where}: expected one of {list(get_args(tp))}, got {short_repr(value)}")
        return value
    if dataclasses.is_dataclass(tp):
        return _convert_dataclass(tp, value, where, error)  # type: ignore[arg-type]  # tp is a type here
    if origin in (list, tuple):
        return _convert_sequence(origin, get_args(tp), value, where, error)
    if origin is dict:
        if not isinstance(value, dict):
            raise error(f"{where}: expected an object, got {type(value).__name__}")
        kt, vt = get_args(tp) or (Any, Any)
        return {_convert(kt, k, f"{where}", error): _convert(vt, v, f"{where}.{k}", error) for k, v in value.items()}
    return _convert_scalar(tp, value, where, error)


def _convert_union(args: tuple[Any, ...], value: Any, where: str, error: type[Exception]) -> Any:
    """The first alternative of ``X | Y | None`` that takes ``value``; the last one's error if none does."""
    if value is None and type(None) in args:
        return None
    last: Exception | None = None
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _convert(arg, value, where, error)
        except error as exc:  # try the next alternative
            last = exc
    raise last or error(f"{where}: unexpected value {short_repr(value)}")


@functools.cache
def _type_hints(tp: type) -> dict[str, Any]:
    """get_type_hints of a dataclass, once per class: it compiles every (string) annotation on each call, which
    made most of a plan.json's load time (read-only: callers share the dict)."""
    return get_type_hints(tp)


def _convert_dataclass(tp: type, value: Any, where: str, error: type[Exception]) -> Any:
    """A dataclass from a dict: unknown and missing fields named, each field converted by its type hint."""
    if not isinstance(value, dict):
        raise error(f"{where}: expected an object, got {type(value).__name__}")
    hints = _type_hints(tp)
    fields = {f.name: f for f in dataclasses.fields(tp)}
    unknown = [str(k) for k in value if k not in fields]
    if unknown:
        raise error(f"{where}: unknown field(s) {short_repr(sorted(unknown), 200)}")
    kwargs = {}
    for name, f in fields.items():
        if name in value:
            kwargs[name] = _convert(hints[name], value[name], f"{where}.{name}", error)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise error(f"{where}: missing field '{name}'")
    return tp(**kwargs)


def _convert_sequence(origin: Any, args: tuple[Any, ...], value: Any, where: str, error: type[Exception]) -> Any:
    """``list[X]``, ``tuple[X, ...]`` or a fixed ``tuple[X, Y]`` from a JSON list (a tuple comes back a tuple)."""
    if not isinstance(value, (list, tuple)):
        raise error(f"{where}: expected a list, got {type(value).__name__}")
    if origin is tuple and args and args[-1] is not Ellipsis:
        if len(args) != len(value):
            raise error(f"{where}: expected {len(args)} items, got {len(value)}")
        return tuple(_convert(a, v, f"{where}[{i}]", error) for i, (a, v) in enumerate(zip(args, value, strict=True)))
    item = args[0] if args else Any
    out = [_convert(item, v, f"{where}[{i}]", error) for i, v in enumerate(value)]
    return tuple(out) if origin is tuple else out


def _convert_scalar(tp: Any, value: Any, where: str, error: type[Exception]) -> Any:
    """float (an int is taken), int and str/bool exactly (a bool is no number); anything else as is."""
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise error(f"{where}: expected a number, got {short_repr(value)}")
        try:
            return float(value)
        except OverflowError:  # an int past 1e308
            raise error(f"{where}: {short_repr(value)} is out of range for a number") from None
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise error(f"{where}: expected an integer, got {short_repr(value)}")
        return value
    if tp in (str, bool):
        if not isinstance(value, tp):
            raise error(f"{where}: expected {tp.__name__}, got {short_repr(value)}")
        return value
    return value


def read_versioned_json(
    path: Any, *, what: str, version: int, error: type[Exception], fix: str, missing_fix: str
) -> dict[str, Any]:
    """Read a versioned JSON file (plan, profile): a missing, malformed or other-version file is one line.

    ``fix`` tells the user how to make a new one (e.g. "recompile with `hetero compile`");
    ``missing_fix`` what to do when the file is absent.
    """
    import json
    from pathlib import Path

    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise error(f"{p}: no such {what} file ({missing_fix})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise error(f"{p}: not valid JSON ({exc}); {fix}") from None
    except RecursionError:  # json's decoder recurses once per level
        raise error(f"{p}: nested more than {MAX_NESTING} levels deep, not a {what}; {fix}") from None
    except (IsADirectoryError, PermissionError) as exc:
        raise error(f"{p}: cannot read it ({exc.strerror})") from None
    if nesting_depth(data) > MAX_NESTING:  # everything after this (serde, hashing) recurses too
        raise error(f"{p}: nested more than {MAX_NESTING} levels deep, not a {what}; {fix}")
    check_schema_version(data, where=str(p), what=what, version=version, error=error, fix=fix)
    return data


def check_schema_version(data: Any, *, where: str, what: str, version: int, error: type[Exception], fix: str) -> None:
    """Refuse anything but a JSON object of this schema version, naming both versions."""
    from hetero import __version__

    if not isinstance(data, dict):
        raise error(f"{where}: not a {what} (expected a JSON object)")
    found = data.get("schema_version")
    if found != version or isinstance(found, bool):
        written_by = data.get("hetero_version")
        raise error(
            f"{where}: {what} schema v{short_repr(found, 20)} (written by hetero "
            f"{written_by[:20] if isinstance(written_by, str) else '?'}), this hetero {__version__} reads "
            f"v{version}: {fix}"
        )
