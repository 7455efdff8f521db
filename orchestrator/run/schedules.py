"""Nightly schedules: their records and their installation, a systemd user timer or a crontab line.

A schedule is a record under the config dir (`$ORCHESTRATE_CONFIG_DIR`, else
`$XDG_CONFIG_HOME/orchestrate`, else `~/.config/orchestrate`): `schedules/NAME.json` holds the sweep,
the inventory, the results root and the time. A systemd user timer is installed where systemd
runs, a crontab line elsewhere; either runs `python -m orchestrator.cli schedule run-now NAME`
(`orchestrator.run.nightly`). The crontab file and the systemd unit dir are settings
(`--crontab-file`, `--unit-dir`), so a test or a user who manages their own crontab file never
touches the machine's.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from orchestrator.analysis.history import (
    THRESHOLD,
    WINDOW,
)
from orchestrator.errors import (
    InfrastructureError,
    InputError,
)
from orchestrator.store.compact import COMPACT_AFTER_DAYS
from workers.files import write_atomic

TAG = "# orchestrate:"
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # matched whole: no '/', no '..', no newline
_CRON_FIELD = re.compile(r"^(\*|\d+(-\d+)?)(/\d+)?(,(\*|\d+(-\d+)?)(/\d+)?)*$")
_DOW = ["Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"]


def config_dir() -> Path:
    """Where schedules, their locks, logs and reports live."""
    if os.environ.get("ORCHESTRATE_CONFIG_DIR"):
        return Path(os.environ["ORCHESTRATE_CONFIG_DIR"])
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "orchestrate"


@dataclass(frozen=True)
class Schedule:
    """One nightly sweep."""

    name: str
    sweep: str  # built-in name or absolute path
    inventory: str | None  # absolute path; None: this machine
    results: str  # absolute path of the results root
    at: str  # as the user wrote it
    cron: str  # five cron fields
    window: int = WINDOW  # nights that estimate the night-to-night noise (orchestrator.analysis.history)
    threshold: float = THRESHOLD
    workdir: str = ""  # where `schedule add` ran: relative paths in the sweep (a command case's repo) start here
    compact_after: int | None = COMPACT_AFTER_DAYS  # after each run, compact dates this old (None: never)


def cron_expression(at: str) -> str:
    """`HH:MM` (daily) or five cron fields, as five cron fields; anything else is an `InputError`."""
    m = re.fullmatch(r"(\d{1,2}):(\d{2})", at.strip())
    if m:
        hour, minute = int(m.group(1)), int(m.group(2))
        if hour > 23 or minute > 59:
            raise InputError(f"--at {at!r}: not a time of day (HH:MM, 00:00 to 23:59)")
        return f"{minute} {hour} * * *"
    fields = at.split()
    if len(fields) != 5 or not all(_CRON_FIELD.match(f) for f in fields):
        raise InputError(f"--at {at!r}: give HH:MM or five cron fields such as '30 2 * * 1-5'")
    return " ".join(fields)


def _calendar_field(field: str, step_start: str) -> str:
    parts = []
    for part in field.split(","):
        part = re.sub(r"^\*/", f"{step_start}/", part)
        parts.append(part.replace("-", ".."))
    return ",".join(parts)


def on_calendar(cron: str) -> str:
    """Five cron fields as a systemd `OnCalendar=` value (`30 2 * * 1-5` -> `Mon..Fri *-*-* 2:30:00`)."""
    minute, hour, dom, month, dow = cron.split()
    when = f"*-{_calendar_field(month, '1')}-{_calendar_field(dom, '1')} "
    when += f"{_calendar_field(hour, '0')}:{_calendar_field(minute, '0')}:00"
    if dow == "*":
        return when
    days = re.sub(r"\d", lambda d: _DOW[int(d.group())], _calendar_field(dow, "0"))
    return f"{days} {when}"


class ScheduleBackend(Protocol):
    """Where schedules are installed: crontab or systemd user timers."""

    kind: str

    def install(self, name: str, cron: str, command: str) -> str: ...

    def remove(self, name: str) -> bool: ...

    def installed(self) -> dict[str, str]: ...


class Crontab:
    """Crontab lines tagged `# orchestrate:NAME`, in a file (`path`) or the user's crontab."""

    kind = "cron"

    def __init__(self, path: Path | None = None, command: str = "crontab") -> None:
        self.path = path
        self.command = command

    def _read(self) -> list[str]:
        if self.path is not None:
            return self.path.read_text().splitlines() if self.path.exists() else []
        if shutil.which(self.command) is None:
            raise InfrastructureError(f"no `{self.command}` on PATH; give --crontab-file or use systemd")
        proc = subprocess.run([self.command, "-l"], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            if "no crontab" in proc.stderr.lower():
                return []
            raise InfrastructureError(f"`{self.command} -l` failed: {proc.stderr.strip()}")
        return proc.stdout.splitlines()

    def _write(self, lines: list[str]) -> None:
        text = "".join(line + "\n" for line in lines)
        if self.path is not None:
            write_atomic(self.path, text)
            return
        proc = subprocess.run([self.command, "-"], input=text, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise InfrastructureError(f"`{self.command} -` failed: {proc.stderr.strip()}")

    def install(self, name: str, cron: str, command: str) -> str:
        if "%" in command:
            raise InputError(f"schedule {name!r}: '%' in a path cannot go into a crontab line")
        lines = [line for line in self._read() if not line.endswith(f"{TAG}{name}")]
        line = f"{cron} {command} {TAG}{name}"
        self._write([*lines, line])
        return line

    def remove(self, name: str) -> bool:
        lines = self._read()
        kept = [line for line in lines if not line.endswith(f"{TAG}{name}")]
        if len(kept) != len(lines):
            self._write(kept)
        return len(kept) != len(lines)

    def installed(self) -> dict[str, str]:
        out = {}
        for line in self._read():
            if TAG in line and not line.lstrip().startswith("#"):
                out[line.rsplit(TAG, 1)[1]] = line
        return out


class SystemdTimers:
    """`orchestrate-NAME.service` + `.timer` user units in `unit_dir`, enabled with `systemctl --user`."""

    kind = "systemd"

    def __init__(self, unit_dir: Path | None = None, systemctl: str = "systemctl") -> None:
        self.unit_dir = unit_dir or Path.home() / ".config" / "systemd" / "user"
        self.systemctl = systemctl

    def _ctl(self, *args: str) -> None:
        proc = subprocess.run([self.systemctl, "--user", *args], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise InfrastructureError(f"systemctl --user {' '.join(args)} failed: {proc.stderr.strip()}")

    def install(self, name: str, cron: str, command: str) -> str:
        self.unit_dir.mkdir(parents=True, exist_ok=True)
        unit = f"orchestrate-{name}"
        (self.unit_dir / f"{unit}.service").write_text(
            f"[Unit]\nDescription=orchestrate nightly sweep {name}\n\n"
            f"[Service]\nType=oneshot\nExecStart=/bin/sh -c {shlex.quote(command)}\n"
        )
        (self.unit_dir / f"{unit}.timer").write_text(
            f"[Unit]\nDescription=orchestrate nightly sweep {name} ({cron})\n\n"
            f"[Timer]\nOnCalendar={on_calendar(cron)}\nPersistent=true\n\n[Install]\nWantedBy=timers.target\n"
        )
        self._ctl("daemon-reload")
        self._ctl("enable", "--now", f"{unit}.timer")
        return str(self.unit_dir / f"{unit}.timer")

    def remove(self, name: str) -> bool:
        unit = f"orchestrate-{name}"
        timer = self.unit_dir / f"{unit}.timer"
        if not timer.exists():
            return False
        self._ctl("disable", "--now", f"{unit}.timer")
        timer.unlink()
        (self.unit_dir / f"{unit}.service").unlink(missing_ok=True)
        self._ctl("daemon-reload")
        return True

    def installed(self) -> dict[str, str]:
        if not self.unit_dir.is_dir():
            return {}
        return {
            p.name.removeprefix("orchestrate-").removesuffix(".timer"): str(p)
            for p in sorted(self.unit_dir.glob("orchestrate-*.timer"))
        }


def systemd_running() -> bool:
    """True where a systemd user manager answers (not in most containers)."""
    if not Path("/run/systemd/system").is_dir() or shutil.which("systemctl") is None:
        return False
    proc = subprocess.run(["systemctl", "--user", "is-system-running"], capture_output=True, text=True, check=False)
    return proc.stdout.strip() in ("running", "degraded")


def choose_backend(
    kind: str = "auto", *, crontab_file: Path | None = None, unit_dir: Path | None = None
) -> ScheduleBackend:
    """`systemd`, `cron` or `auto` (systemd where it runs, else cron; a crontab file means cron)."""
    if kind == "auto":
        kind = "cron" if crontab_file is not None or not systemd_running() else "systemd"
    if kind == "systemd":
        return SystemdTimers(unit_dir)
    if kind == "cron":
        return Crontab(crontab_file)
    raise InputError(f"--backend {kind!r}: one of auto, systemd, cron")


def check_name(name: str) -> str:
    """A schedule name is a file name in the config dir and a crontab tag: refuse anything else
    (a path such as `../../victim`, a trailing newline that would split a crontab line)."""
    if not NAME_RE.fullmatch(name):
        raise InputError(
            f"schedule name {name!r} must be letters, digits, '.', '_' or '-' (starting with a letter or digit)"
        )
    return name


def _record_path(name: str) -> Path:
    return config_dir() / "schedules" / f"{check_name(name)}.json"


def load_schedule(name: str) -> Schedule:
    """The stored schedule of that name; an unknown name or a broken record is an `InputError`."""
    path = _record_path(name)
    if not path.exists():
        raise InputError(f"no schedule named {name!r}", where=str(path.parent))
    try:
        return Schedule(**json.loads(path.read_text()))
    except (ValueError, TypeError) as exc:
        raise InputError(
            f"schedule record is broken ({exc}); remove it and add the schedule again", where=str(path)
        ) from None


def list_schedules() -> list[Schedule]:
    """Every stored schedule, by name."""
    root = config_dir() / "schedules"
    return [load_schedule(p.stem) for p in sorted(root.glob("*.json"))] if root.is_dir() else []


def run_command(name: str) -> str:
    """The shell command a timer or crontab line runs for a schedule (absolute paths, own log)."""
    log = config_dir() / "logs" / f"{name}.log"
    env = f"ORCHESTRATE_CONFIG_DIR={shlex.quote(str(config_dir()))} "
    cmd = f"{shlex.quote(sys.executable)} -m orchestrator.cli schedule run-now {shlex.quote(name)}"
    return f"{env}{cmd} >> {shlex.quote(str(log))} 2>&1"


def add_schedule(schedule: Schedule, backend: ScheduleBackend) -> str:
    """Store a schedule and install it; returns the installed crontab line or timer unit."""
    path = _record_path(schedule.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    (config_dir() / "logs").mkdir(parents=True, exist_ok=True)
    where = backend.install(schedule.name, schedule.cron, run_command(schedule.name))
    path.write_text(json.dumps(asdict(schedule), indent=2))
    return where


def remove_schedule(name: str, backend: ScheduleBackend) -> None:
    """Uninstall a schedule and forget it; a name neither stored nor installed is an `InputError`."""
    record = _record_path(name)  # refuses a name that is not one (`../../victim`) before anything is touched
    removed = backend.remove(name)
    if not removed and not record.exists():
        raise InputError(f"no schedule named {name!r}")
    record.unlink(missing_ok=True)
