"""A sweep's definition as a run stores it: canonical JSON of the validated `SweepSpec`, its digest.

Every fragment of a run carries the sweep it ran (`orchestrator.run.sweep` writes the footer
keys), so `check`, `compare`, `report` and `history` judge a run by what it ran, not by whatever
file has that name today: a user's edited copy of a built-in sweep and the built-in itself share a
name but never a digest. `differences` names the fields two definitions disagree on, for the one
line that says the file on disk is not what the run ran.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from orchestrator.specs.sweep import SweepSpec, builtin_sweeps
from workers.contract import META_SWEEP_DEFINITION, META_SWEEP_DIGEST, META_SWEEP_SOURCE

DIGEST_CHARS = 12
SHOWN_FIELDS = 5  # differing fields named in a line before "..."


def canonical(spec: SweepSpec) -> str:
    """The sweep as canonical JSON: every field after validation (the `[command]` defaults merged
    into its cases), keys sorted, no spaces; equal sweeps give equal text."""
    return json.dumps(spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


def digest(spec: SweepSpec) -> str:
    """A short hash of `canonical(spec)`: what tells two sweeps of one name apart."""
    return hashlib.sha256(canonical(spec).encode()).hexdigest()[:DIGEST_CHARS]


def describe_source(where: str) -> str:
    """`built-in NAME` for a shipped sweep's file, else the file's absolute path."""
    path = Path(where)
    for name, builtin in builtin_sweeps().items():
        if path.exists() and builtin.exists() and path.resolve() == builtin.resolve():
            return f"built-in {name}"
    return str(path.resolve()) if path.exists() else where


def definition_footer(spec: SweepSpec, where: str) -> dict[bytes, bytes]:
    """The footer keys a run's fragments carry: the sweep's canonical JSON, digest and source file."""
    return {
        META_SWEEP_DEFINITION: canonical(spec).encode(),
        META_SWEEP_DIGEST: digest(spec).encode(),
        META_SWEEP_SOURCE: describe_source(where).encode(),
    }


def stored_spec(text: str) -> SweepSpec | None:
    """A stored definition validated again, or None when this orchestrate no longer accepts it."""
    try:
        return SweepSpec.model_validate(json.loads(text))
    except (ValueError, ValidationError):
        return None


def _case_key(case: Any) -> str:
    return str(case.get("name") or case.get("case")) if isinstance(case, dict) else repr(case)


def differences(ours: SweepSpec, theirs: SweepSpec) -> list[str]:
    """The fields two sweeps disagree on: `devices`, `command.repo`, `cases[bench-decode].run`, ...

    A case field the `[command]` table sets (and that differs there) is named once, as `command.X`,
    not again under every case it was merged into.
    """
    a, b = ours.model_dump(mode="json"), theirs.model_dump(mode="json")
    out: list[str] = []
    command_a, command_b = a.get("command") or {}, b.get("command") or {}
    from_command = {k for k in command_a.keys() | command_b.keys() if command_a.get(k) != command_b.get(k)}
    for key in sorted(a.keys() | b.keys()):
        va, vb = a.get(key), b.get(key)
        if va == vb:
            continue
        if key == "command" and isinstance(va, dict) and isinstance(vb, dict):
            out += [f"command.{k}" for k in sorted(from_command)]
        elif key == "cases" and isinstance(va, list) and isinstance(vb, list):
            cases_a = {_case_key(c): c for c in va}
            cases_b = {_case_key(c): c for c in vb}
            for label in sorted(cases_a.keys() | cases_b.keys()):
                ca, cb = cases_a.get(label), cases_b.get(label)
                if ca is None or cb is None:
                    out.append(f"cases[{label}]")
                    continue
                out += [
                    f"cases[{label}].{k}"
                    for k in sorted(ca.keys() | cb.keys())
                    if ca.get(k) != cb.get(k) and k not in from_command
                ]
            if not any(p.startswith("cases") for p in out) and va != vb and not from_command:
                out.append("cases")
        else:
            out.append(key)
    return out


def shown(fields: list[str]) -> str:
    """`devices, command.repo` (at most `SHOWN_FIELDS`, then `...`)."""
    more = ", ..." if len(fields) > SHOWN_FIELDS else ""
    return ", ".join(fields[:SHOWN_FIELDS]) + more
