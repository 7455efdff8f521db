"""The TOML files users write: read them safely, and turn pydantic's complaints into one line.

A file is refused, naming it and the line or field, when it is larger than `MAX_FILE_BYTES`, not
UTF-8 (TOML is UTF-8 by definition; a UTF-16 byte-order mark is named as such; a UTF-8 one is
skipped), malformed, nested deeper than `MAX_DEPTH` tables and arrays (no sweep or inventory
needs more than five), or holds a NUL byte in a key or a string. A validation error becomes
`field a.b: what is wrong (found X)`, with the nearest allowed name for an unknown field.
"""

from __future__ import annotations

import tomllib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from kernels.registry import did_you_mean
from orchestrator.errors import InputError

MAX_FILE_BYTES = 4 * 1024 * 1024
MAX_DEPTH = 16
BOMS = {
    b"\xff\xfe\x00\x00": "UTF-32",
    b"\x00\x00\xfe\xff": "UTF-32",
    b"\xff\xfe": "UTF-16",
    b"\xfe\xff": "UTF-16",
}
UTF8_BOM = b"\xef\xbb\xbf"
M = TypeVar("M", bound=BaseModel)


def read_toml(path: Path, what: str) -> dict[str, Any]:
    """Parse a TOML file; a missing, unreadable, oversized, non-UTF-8, malformed or too deeply
    nested file is an `InputError` naming it (and the line where it went wrong)."""
    where = str(path)
    try:
        with path.open("rb") as fh:
            raw = fh.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise InputError(f"{what} file not found", where=where) from None
    except OSError as exc:
        raise InputError(f"cannot read {what} file: {exc.strerror or exc}", where=where) from None
    if len(raw) > MAX_FILE_BYTES:
        raise InputError(f"{what} file is larger than {MAX_FILE_BYTES // (1024 * 1024)} MiB", where=where)
    text = decode_utf8(raw, what, where)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"malformed TOML: {exc}", where=where) from None
    except RecursionError:
        raise InputError(f"malformed TOML: nested deeper than {MAX_DEPTH} tables or arrays", where=where) from None
    check_structure(data, where)
    return data


def load_model(path: Path, what: str, model: type[M]) -> M:
    """Read a TOML file and validate it as `model`; any problem is one `InputError` naming the file."""
    data = read_toml(path, what)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise InputError(validation_message(exc, model), where=str(path)) from None


def decode_utf8(raw: bytes, what: str, where: str) -> str:
    """The file's text; anything but UTF-8 is an `InputError` naming the line of the first bad byte."""
    for bom, name in BOMS.items():
        if raw.startswith(bom):
            raise InputError(f"{what} file is {name} (byte-order mark); TOML files must be UTF-8", where=where)
    raw = raw.removeprefix(UTF8_BOM)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        byte = raw[exc.start : exc.start + 1].hex()
        raise InputError(
            f"{what} file is not UTF-8 text (byte 0x{byte} at line {line}); TOML files must be UTF-8", where=where
        ) from None


def check_structure(data: Any, where: str) -> None:
    """Refuse nesting deeper than `MAX_DEPTH` and a NUL byte in any key or string (no program
    argument, environment variable or path can hold one), without recursion."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(data, ())]
    while stack:
        item, path = stack.pop()
        if len(path) > MAX_DEPTH:
            raise InputError(f"malformed TOML: nested deeper than {MAX_DEPTH} tables or arrays", where=where)
        if isinstance(item, dict):
            for key, value in item.items():
                if "\0" in key:
                    raise InputError(f"field {_dotted(path)}: the key {key!r} holds a NUL byte", where=where)
                stack.append((value, (*path, key)))
        elif isinstance(item, list):
            stack.extend((value, (*path, i)) for i, value in enumerate(item))
        elif isinstance(item, str) and "\0" in item:
            raise InputError(f"field {_dotted(path)}: {item!r} holds a NUL byte", where=where)


def _dotted(path: tuple[str | int, ...]) -> str:
    return ".".join(str(p) for p in path) or "(top level)"


# ------------------------------------------------------------------------------- error messages

# Pydantic names the member of a union it tried in the error's location (`list[str]`, `int`,
# `function-after[...]`); those are not fields the user wrote.
_TYPE_TAGS = {"int", "float", "str", "bool", "list", "dict", "none"}


def _user_part(part: str | int) -> bool:
    return isinstance(part, int) or not ("[" in part or part in _TYPE_TAGS or part.startswith("function-"))


def _user_loc(loc: tuple[str | int, ...]) -> tuple[str | int, ...]:
    return tuple(p for p in loc if _user_part(p))


def _unwrap(annotation: Any) -> list[Any]:
    """The members of a union (or the annotation itself)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return list(typing.get_args(annotation))
    return [annotation]


def _step(annotation: Any, part: str | int) -> Any:
    """The annotation one location part further in (a field, a list item, a table value)."""
    for member in _unwrap(annotation):
        if isinstance(member, type) and issubclass(member, BaseModel):
            if isinstance(part, str) and part in member.model_fields:
                return member.model_fields[part].annotation
            continue
        origin, args = typing.get_origin(member), typing.get_args(member)
        if origin is list and isinstance(part, int) and args:
            return args[0]
        if origin is dict and isinstance(part, str) and len(args) == 2:
            return args[1]
    return None


def fields_at(model: type[BaseModel], loc: tuple[str | int, ...]) -> list[str]:
    """The field names a table at `loc` (inside a file of `model`) may have."""
    annotation: Any = model
    for part in loc:
        annotation = _step(annotation, part)
        if annotation is None:
            return []
    for member in _unwrap(annotation):
        if isinstance(member, type) and issubclass(member, BaseModel):
            return list(member.model_fields)
    return []


def _found(value: Any) -> str:
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def validation_message(exc: ValidationError, model: type[BaseModel]) -> str:
    """The most specific pydantic error as `field a.b: message (found X)`, one line."""
    errors = exc.errors()
    locs = [_user_loc(tuple(e["loc"])) for e in errors]
    # A union's alternatives each complain; the one that got furthest into the value is the one
    # the user meant (an `arms` table with a typo inside, not "arms should be a list").
    deeper = [i for i, loc in enumerate(locs) if not any(o != loc and o[: len(loc)] == loc for o in locs)]
    # A misspelt field explains the errors it causes (`parms` leaves `params` missing): it goes first.
    deeper.sort(key=lambda i: errors[i]["type"] != "extra_forbidden")
    first = deeper[0] if deeper else 0
    err, loc = errors[first], locs[first]
    path = ".".join(str(p) for p in loc)
    prefix = f"field {path}: " if path else ""
    if err["type"] == "extra_forbidden":
        name = str(loc[-1])
        allowed = fields_at(model, loc[:-1])
        hint = did_you_mean(name, allowed) or (f" (allowed: {', '.join(allowed)})" if allowed else "")
        return f"{prefix}unknown field {name!r}{hint}"
    if err["type"] == "missing":
        return f"{prefix}required field missing"
    same = [e for e, other in zip(errors, locs, strict=True) if other == loc]
    if len(same) > 1 and all(e["type"] != "value_error" for e in same):  # no member of a union fits
        tags = dict.fromkeys(str(p) for e in same for p in e["loc"] if not _user_part(p))
        return f"{prefix}{_found(err.get('input'))} is not one of the allowed types ({', '.join(tags) or '?'})"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] != "value_error" and "input" in err:
        msg += f" (found {_found(err['input'])})"
    return prefix + msg
