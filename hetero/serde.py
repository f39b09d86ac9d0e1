"""Dataclass <-> plain JSON-able dict, with validation that names the bad field.

Every contract type (specs, graph, plan) goes through here, so a malformed plan or profile file
fails with one line such as ``plan.json: stages[1].device: expected str, got int``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

from hetero.errors import PlanError

T = TypeVar("T")


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
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
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
        raise last or error(f"{where}: unexpected value {value!r}")
    if origin is typing.Literal:
        if value not in get_args(tp):
            raise error(f"{where}: expected one of {list(get_args(tp))}, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise error(f"{where}: expected an object, got {type(value).__name__}")
        hints = get_type_hints(tp)
        fields = {f.name: f for f in dataclasses.fields(tp)}
        unknown = set(value) - set(fields)
        if unknown:
            raise error(f"{where}: unknown field(s) {sorted(unknown)}")
        kwargs = {}
        for name, f in fields.items():
            if name in value:
                kwargs[name] = _convert(hints[name], value[name], f"{where}.{name}", error)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise error(f"{where}: missing field '{name}'")
        return tp(**kwargs)  # type: ignore[operator]  # tp is a dataclass type here
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise error(f"{where}: expected a list, got {type(value).__name__}")
        args = get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise error(f"{where}: expected {len(args)} items, got {len(value)}")
            return tuple(_convert(a, v, f"{where}[{i}]", error) for i, (a, v) in enumerate(zip(args, value, strict=True)))
        item = args[0] if args else Any
        out = [_convert(item, v, f"{where}[{i}]", error) for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if origin is dict:
        if not isinstance(value, dict):
            raise error(f"{where}: expected an object, got {type(value).__name__}")
        kt, vt = get_args(tp) or (Any, Any)
        return {_convert(kt, k, f"{where}", error): _convert(vt, v, f"{where}.{k}", error) for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise error(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise error(f"{where}: expected an integer, got {value!r}")
        return value
    if tp in (str, bool):
        if not isinstance(value, tp):
            raise error(f"{where}: expected {tp.__name__}, got {value!r}")
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
    check_schema_version(data, where=str(p), what=what, version=version, error=error, fix=fix)
    return data


def check_schema_version(data: Any, *, where: str, what: str, version: int, error: type[Exception], fix: str) -> None:
    """Refuse anything but a JSON object of this schema version, naming both versions."""
    from hetero import __version__

    if not isinstance(data, dict):
        raise error(f"{where}: not a {what} (expected a JSON object)")
    found = data.get("schema_version")
    if found != version:
        raise error(
            f"{where}: {what} schema v{found} (written by hetero {data.get('hetero_version', '?')}), "
            f"this hetero {__version__} reads v{version}: {fix}"
        )
