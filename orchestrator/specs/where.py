"""The `where` of a criterion: a tiny, safe filter over parameter points (never `eval`).

Grammar: `comparison ("and" comparison)*`, a comparison being `name op value` with `op` one of
`== != < <= > >=` and `value` a number, a bare word or a quoted string. Numbers compare as
numbers; words only with `==` and `!=` (an ordering against a word, `tokens >= 4k`, is refused:
it could select nothing). Examples: `prompt_tokens >= 4096`, `tokens > 1 and dtype == bfloat16`.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from orchestrator.errors import InputError

TOKEN_RE = re.compile(
    r"""\s*(?:
        (?P<op><=|>=|==|!=|<|>)
      | (?P<str>"[^"]*"|'[^']*')
      | (?P<word>[A-Za-z0-9_.+-]+)
    )""",
    re.VERBOSE,
)
OPS: dict[str, Callable[[Any, Any], bool]] = {
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}
NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def as_number(text: str) -> float | None:
    """The number a value's text spells, or None for a word."""
    try:
        return float(text)
    except ValueError:
        return None


@dataclass(frozen=True)
class Comparison:
    """`name op value`."""

    name: str
    op: str
    value: str

    def matches(self, point: dict[str, str]) -> bool:
        """True when the point's parameter satisfies the comparison (False when it lacks it)."""
        if self.name not in point:
            return False
        have, want = point[self.name], self.value
        a, b = as_number(have), as_number(want)
        if a is not None and b is not None:
            return OPS[self.op](a, b)
        if self.op in ("==", "!="):
            return OPS[self.op](have.lower(), want.lower())
        return False


@dataclass(frozen=True)
class Condition:
    """Comparisons joined by `and`; the empty condition matches every point."""

    parts: tuple[Comparison, ...] = ()

    def matches(self, point: dict[str, str]) -> bool:
        """True when every comparison holds at `point` (parameter values as text)."""
        return all(p.matches(point) for p in self.parts)

    def names(self) -> set[str]:
        """The parameter names the condition reads."""
        return {p.name for p in self.parts}


def _tokens(text: str, what: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    text = text.rstrip()
    while pos < len(text):
        m = TOKEN_RE.match(text, pos)
        if m is None or m.end() == pos:
            rest = text[pos:].strip()
            hint = " (compare with ==)" if rest.startswith("=") else ""
            raise InputError(f"{what}: cannot read {rest!r} in {text!r}{hint}")
        kind = m.lastgroup or ""
        value = m.group(kind)
        out.append((kind, value[1:-1] if kind == "str" else value))
        pos = m.end()
    return out


def parse_where(text: str, *, what: str = "where") -> Condition:
    """Parse a `where` expression.

    Args:
        text: the expression; empty or blank matches everything.
        what: names the field in error messages (e.g. `criteria 'x': where`).

    Returns:
        The parsed condition.

    Raises:
        InputError: the expression does not follow the grammar.
    """
    tokens = _tokens(text, what)
    parts: list[Comparison] = []
    i = 0
    while i < len(tokens):
        chunk = tokens[i : i + 3]
        if len(chunk) < 3 or chunk[0][0] != "word" or chunk[1][0] != "op" or chunk[2][0] == "op":
            got = " ".join(v for _, v in chunk)
            raise InputError(f"{what}: expected `name op value` (op one of {' '.join(OPS)}), got {got!r}")
        name, op, value = chunk[0][1], chunk[1][1], chunk[2][1]
        if not NAME_RE.fullmatch(name):
            raise InputError(f"{what}: {name!r} is not a parameter name")
        if op not in ("==", "!=") and as_number(value) is None:
            raise InputError(f"{what}: {op} compares numbers, and {value!r} is not one")
        parts.append(Comparison(name, op, value))
        i += 3
        if i < len(tokens):
            if tokens[i] != ("word", "and"):
                raise InputError(f"{what}: expected `and` between comparisons, got {tokens[i][1]!r}")
            i += 1
            if i == len(tokens):
                raise InputError(f"{what}: a comparison must follow `and`")
    return Condition(tuple(parts))
