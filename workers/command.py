"""Command cases: an external benchmark built at a git commit, run per arm, its output parsed.

This module holds a command case's settings and the steps on the worker host; the job that runs
them, arms and commits interleaved, is `workers.command_job`. The job's `options` carry the
case's `repo`, `ref` (or `refs`: several commits compared in one job), `build`, `gate`, `run`,
`parse` and `timeout`; `arm_env` the environment overrides per arm. The steps:

1. Mirror `repo` (a git URL or a local path) into the host's cache and fetch it. The head resolves
   each ref when it plans the run (`plan_commits`) and sends the commits (`options.commits`, part
   of the job key, so a branch that moved is measured again on the next run); a ref the head could
   not reach (a path that exists only on the hosts) is resolved here, once per run and host. The
   commit goes into every row's `commit` column.
2. Check the commit out once per (host, commit, build command) and run `build` there, once: a
   marker beside the checkout records the build time, so a second job of that commit is a cache
   hit (`extra["build_cache"] = "hit"`) that still reports the original `build_seconds`.
3. Run `gate` (the engine's own tests, e.g. `cargo test --test rocm_nvfp4_quant`) in that checkout,
   once per (host, commit, run): it must pass before anything is timed; a failure fails the job
   with the tail of the tests' output.
4. Run the `run` template (`{param}` from the job's parameters, plus `{arm}`, `{backend}`,
   `{device}`, `{host}`, `{commit}`; values are shell-quoted) and parse each output.

A non-zero exit, a timeout, output that does not parse, a failed build or gate or an unknown ref
becomes a failed row carrying the tail of the output, never an exception.

Each build, gate and run is a `workers.process_tree` tree (`_run_shell`): the timeout kills all of
it (also what calls `setsid`), what it leaves running is ended when it exits, and it inherits the
GPU lock's descriptor, so the lock is held until the last of it is gone. Its output streams
through files: stdout is read back for the parser (at most `$ORCHESTRATE_MAX_OUTPUT_MB`, default
64 MiB: a stream past it stops the run), stderr only as a tail. It runs with this host's
environment without Ray's variables (`workers.workload_run.workload_env`: no token path, no
cluster address), plus the arm's env.

The cache lives in `$ORCHESTRATE_CACHE_DIR` or `~/.cache/orchestrate` (`options.cache_dir` wins).
A relative local `repo` path starts at `options.base_dir`, else at the worker's working directory
(on the embedded Ray instance, where `orchestrate` was started; a scheduled run starts where
`schedule add` ran). On remote hosts give a git URL or an absolute path on that host.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import os
import re
import shlex
import shutil
import string
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from workers.gpulock import held_lock_fds
from workers.parsers import parser_for
from workers.workload_run import DEFAULT_MAX_OUTPUT, run_tree, workload_env

DEFAULT_TIMEOUT = 3600.0
TAIL_CHARS = 1500
BUILTIN_FIELDS = frozenset({"arm", "backend", "device", "host", "commit"})
FIELD_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class CommandCaseError(Exception):
    """A step of a command case that failed: the message is what the failed rows say."""


@dataclass(frozen=True)
class CommandCase:
    """A command case's settings, as the head put them into `JobSpec.options`."""

    repo: str
    ref: str  # the ref this instance resolves (the first of `refs`; `for_ref` picks another)
    run: str
    build: str | None = None
    parse: str | dict[str, Any] | None = None
    timeout: float = DEFAULT_TIMEOUT
    base_dir: str | None = None  # where a relative local `repo` path starts
    cache_dir: str | None = None
    refs: tuple[str, ...] = ()  # every ref of the job: BASE first, HEAD last
    gate: str | None = None
    commits: tuple[tuple[str, str], ...] = ()  # (ref, commit) as the head resolved them when it planned the run

    @property
    def commit(self) -> str | None:
        """The head's commit for `ref`, or None (the hosts resolve it)."""
        return dict(self.commits).get(self.ref)

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> CommandCase:
        """Read the settings; a missing `repo` or `run` is a `CommandCaseError`."""
        for key in ("repo", "run"):
            if not options.get(key):
                raise CommandCaseError(f"command case: options.{key} is missing")
        refs = tuple(str(r) for r in options.get("refs") or [options.get("ref") or "HEAD"])
        return cls(
            repo=str(options["repo"]),
            ref=refs[0],
            run=str(options["run"]),
            build=options.get("build") or None,
            parse=options.get("parse"),
            timeout=float(options.get("timeout") or DEFAULT_TIMEOUT),
            base_dir=options.get("base_dir"),
            cache_dir=options.get("cache_dir"),
            refs=refs,
            gate=options.get("gate") or None,
            commits=tuple(sorted((str(k), str(v)) for k, v in (options.get("commits") or {}).items())),
        )

    def for_ref(self, ref: str) -> CommandCase:
        """The same case resolving `ref`."""
        return replace(self, ref=ref)


def template_fields(template: str) -> set[str]:
    """The `{field}` names a run or build template uses (the head checks them against params).

    Literal braces (a shell's `${VAR}`) are doubled: `$${{VAR}}`. A field is a plain name: a
    conversion (`{p!r}`), a format spec (`{p:.3}`), an attribute or an index (`{p.x}`, `{p[0]}`)
    would rewrite the shell-quoted value (`{p!r}` quotes the quotes, `{p:.3}` cuts them off), so
    the quoting would no longer hold; they are refused.

    Raises:
        ValueError: a malformed template (an unmatched brace) or a field that is not a plain name.
    """
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"malformed template ({exc}; write literal braces twice)") from None
    names: set[str] = set()
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if conversion or spec or not FIELD_RE.fullmatch(name):
            written = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            raise ValueError(
                f"template field {written} is not a plain {{name}} (no conversion, format spec, attribute or index: "
                "values are shell-quoted as they are)"
            )
        names.add(name)
    return names


def render(template: str, values: dict[str, Any], what: str) -> str:
    """Fill a template with shell-quoted values; an unknown field is a `CommandCaseError`."""
    try:
        missing = template_fields(template) - set(values)
    except ValueError as exc:
        raise CommandCaseError(f"{what}: {exc}") from None
    if missing:
        raise CommandCaseError(f"{what}: template field {{{sorted(missing)[0]}}} is not a parameter")
    return template.format_map({k: shlex.quote(str(v)) for k, v in values.items()})


def check_case_settings(options: dict[str, Any], params: set[str]) -> None:
    """Check a command case's settings before anything runs (the head calls this on the sweep).

    Args:
        options: repo/ref/build/run/parse/timeout as the sweep file gives them.
        params: the case's parameter names.

    Raises:
        ValueError: `field: what is wrong`, e.g. `run: template field {x} is not a parameter`.
    """
    for key in ("repo", "run"):
        if not options.get(key):
            raise ValueError(f"{key}: a command case needs `{key}`")
    refs = options.get("refs")
    if refs is not None:
        if options.get("ref"):
            raise ValueError("refs: give `ref` (one commit) or `refs` (commits compared), not both")
        if not refs or any(not str(r).strip() for r in refs):
            raise ValueError('refs: a list of git refs, BASE first, e.g. refs = ["v0.3.0", "main"]')
        if len(set(refs)) != len(refs):
            raise ValueError("refs: a ref is named twice")
    parser_for(options.get("parse"))
    per_commit = BUILTIN_FIELDS - {"arm"}
    allowed = {"run": params | BUILTIN_FIELDS, "build": per_commit, "gate": per_commit}
    for key, names in allowed.items():
        template = options.get(key)
        if not template:
            continue
        try:
            unknown = template_fields(str(template)) - names
        except ValueError as exc:
            raise ValueError(f"{key}: {exc}") from None
        if unknown:
            raise ValueError(f"{key}: template field {{{sorted(unknown)[0]}}} is not a parameter")


def cache_root(case: CommandCase) -> Path:
    """Where this host keeps mirrors and builds."""
    if case.cache_dir:
        return Path(case.cache_dir).expanduser()
    env = os.environ.get("ORCHESTRATE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "orchestrate"


def _tail(text: str) -> str:
    text = text.strip()
    return text[-TAIL_CHARS:] if len(text) > TAIL_CHARS else text


def _with_stderr(message: str, stderr: str) -> str:
    tail = _tail(stderr)
    return f"{message}; stderr: {tail}" if tail else message


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Serialise jobs of one host on a mirror or a build directory (independent of the GPU lock)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _git(*args: str, cwd: Path | None = None, timeout: float = 600.0) -> str:
    # Never a prompt (no terminal here): a credential or host-key question fails the command.
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0"}
    env.setdefault("GIT_SSH_COMMAND", "ssh -o BatchMode=yes")
    try:
        proc = subprocess.run(
            ["git", *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=timeout, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise CommandCaseError(f"git {args[0]} did not finish within {timeout:g} s") from None
    if proc.returncode != 0:
        raise CommandCaseError(f"git {args[0]} failed: {_tail(proc.stderr) or proc.returncode}")
    return proc.stdout.strip()


_URL_RE = re.compile(r"^[a-z+]+://|^[\w.-]+@[\w.-]+:")  # a URL or an scp-like address


def _repo_location(case: CommandCase) -> str:
    if _URL_RE.match(case.repo):
        return case.repo
    path = Path(case.repo).expanduser()
    if not path.is_absolute():
        path = Path(case.base_dir or os.getcwd()) / path
    return str(path.resolve())


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name) or "_"


def _mirror_path(case: CommandCase, location: str) -> Path:
    slug = _safe(location.rstrip("/").split("/")[-1] or "repo")
    return cache_root(case) / "repos" / f"{slug}-{hashlib.sha256(location.encode()).hexdigest()[:12]}.git"


def _has_commit(mirror: Path, commit: str) -> bool:
    probe = ["git", "--git-dir", str(mirror), "cat-file", "-e", f"{commit}^{{commit}}"]
    return subprocess.run(probe, capture_output=True, timeout=60, check=False).returncode == 0


def resolve_commit(case: CommandCase, run_id: str | None = None) -> tuple[Path, str]:
    """Mirror (or fetch) the repo into the cache and resolve `ref` to a full commit id.

    A case that carries the head's commit for `ref` gets that commit (fetched when the mirror
    lacks it). Otherwise the first job of a run on this host fetches and resolves `ref`; the
    run's later jobs reuse that commit (a pin file per run), so a branch that moves during a sweep
    does not split the run over commits.

    Returns:
        The mirror's path and the commit.

    Raises:
        CommandCaseError: the repo cannot be cloned or fetched, or it has no such ref or commit.
    """
    location = _repo_location(case)
    mirror = _mirror_path(case, location)
    planned = case.commit
    pin = None
    if run_id and not planned:
        ref_hash = hashlib.sha256(case.ref.encode()).hexdigest()[:12]
        pin = cache_root(case) / "pins" / _safe(run_id) / f"{mirror.stem}-{ref_hash}"
    with _file_lock(mirror.with_suffix(".lock")):
        if pin is not None and pin.exists() and (mirror / "HEAD").exists():
            return mirror, pin.read_text().strip()
        if planned and (mirror / "HEAD").exists() and _has_commit(mirror, planned):
            return mirror, planned
        if (mirror / "HEAD").exists():
            _git("--git-dir", str(mirror), "fetch", "--prune", "--quiet", "origin")
        else:
            _git("clone", "--mirror", "--quiet", location, str(mirror))
        if planned:
            if not _has_commit(mirror, planned):
                when = f"ref {case.ref!r} when the run was planned"
                raise CommandCaseError(f"commit {planned} ({when}) is not in {location}")
            return mirror, planned
        try:
            commit = _git("--git-dir", str(mirror), "rev-parse", "--verify", "--quiet", f"{case.ref}^{{commit}}")
        except CommandCaseError:
            raise CommandCaseError(f"ref {case.ref!r} not found in {location}") from None
        if pin is not None:
            pin.parent.mkdir(parents=True, exist_ok=True)
            pin.write_text(commit + "\n")
    return mirror, commit


def plan_commits(options: dict[str, Any], base_dir: str | None = None) -> dict[str, str]:
    """Each of a case's refs resolved to a commit on the head, when it plans a run: the commits go
    into the job key, so a branch that moved is measured again. Empty when the head cannot reach
    the repo (a path that exists only on the worker hosts, a URL it has no access to): the hosts
    resolve the refs themselves then.

    Raises:
        CommandCaseError: the head reaches the repo, and it has no such ref.
    """
    case = CommandCase.from_options({**options, "commits": None, "base_dir": options.get("base_dir") or base_dir})
    location = _repo_location(case)
    if not _URL_RE.match(location) and not Path(location).exists():
        return {}
    commits = {}
    for ref in case.refs:
        try:
            commits[ref] = resolve_commit(case.for_ref(ref))[1]
        except CommandCaseError as exc:
            if "not found in" in exc.args[0]:
                raise
            return {}  # unreachable from here: the hosts resolve the refs
    return commits


@dataclass(frozen=True)
class BuildResult:
    """A checkout of one commit, built: where, how long the build took, whether it was cached."""

    path: Path
    seconds: float
    cache_hit: bool


def build_commit(case: CommandCase, mirror: Path, commit: str, values: dict[str, Any]) -> BuildResult:
    """Check out `commit` and run the build command there, once per host, commit and command.

    Raises:
        CommandCaseError: the checkout or the build failed or timed out (with stderr's tail).
    """
    command = render(case.build, values, "build") if case.build else ""
    key = hashlib.sha256(command.encode()).hexdigest()[:10]
    path = mirror.parent.parent / "builds" / mirror.stem / f"{commit[:16]}-{key}"
    marker = path.with_name(path.name + ".build.json")
    with _file_lock(path.with_name(path.name + ".lock")):
        if marker.exists():
            record = json.loads(marker.read_text())
            os.utime(marker)  # used now: the pruning below keeps the builds used last
            return BuildResult(path, float(record["build_seconds"]), cache_hit=True)
        if not (path / ".git").exists():
            _git("clone", "--quiet", "--no-checkout", str(mirror), str(path))
        _git("checkout", "--quiet", "--detach", "--force", commit, cwd=path)
        seconds = 0.0
        if command:
            outcome = _run_shell(command, path, dict(os.environ), case.timeout)
            seconds = outcome.seconds
            path.with_name(path.name + ".build.log").write_text(outcome.stdout + outcome.stderr)  # stderr's tail
            if outcome.failure:
                raise CommandCaseError(f"build {outcome.failure}")
        marker.write_text(json.dumps({"commit": commit, "build": command, "build_seconds": seconds}))
    prune_builds(path.parent, keep_builds())
    return BuildResult(path, seconds, cache_hit=False)


KEEP_BUILDS = 4
RECENT_S = 24 * 3600.0


def keep_builds() -> int:
    """How many builds of one repository a host keeps (`$ORCHESTRATE_KEEP_BUILDS`, default 4)."""
    raw = os.environ.get("ORCHESTRATE_KEEP_BUILDS", "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else KEEP_BUILDS


def prune_builds(builds: Path, keep: int, *, recent_s: float = RECENT_S) -> list[Path]:
    """Remove a repository's least recently used builds beyond the newest `keep`.

    An engine's build is gigabytes and a nightly sweep makes one per commit; this keeps a host's
    disk bounded. A build used within `recent_s` (this run's BASE and HEAD, say) or held by
    another job (its lock is taken) is never removed.

    Returns:
        The checkouts removed.
    """
    markers = sorted(builds.glob("*.build.json"), key=lambda m: m.stat().st_mtime, reverse=True)
    removed = []
    for marker in markers[keep:]:
        if time.time() - marker.stat().st_mtime < recent_s:
            continue
        path = marker.with_name(marker.name.removesuffix(".build.json"))
        fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # in use by another job
            marker.unlink()
            shutil.rmtree(path, ignore_errors=True)
            for log in builds.glob(f"{glob.escape(path.name)}.*.log"):
                log.unlink(missing_ok=True)
            removed.append(path)
        finally:
            os.close(fd)
    return removed


_FAILURE_LINE = re.compile(r"panicked at|^test .* FAILED$|^test result:|^FAILED |^E  |^error(\[|:)", re.M)


def _failure_summary(output: str) -> str:
    """The lines that say what failed (a panic and its message, FAILED tests), then the output's tail.

    A test runner's backtrace or build log can push the failure out of a plain tail.
    """
    lines = output.splitlines()
    picked: list[str] = []
    for i, line in enumerate(lines):
        if _FAILURE_LINE.search(line):
            picked.append(line.strip())
            if "panicked at" in line and i + 1 < len(lines):
                picked.append(lines[i + 1].strip())  # the panic's message
    head = "; ".join(dict.fromkeys(picked[:12]))
    tail = _tail(output) or "no output"
    return f"{head}\n... {tail}" if head and head not in tail else tail


@dataclass(frozen=True)
class GateResult:
    """The correctness gate at one commit: how long it took, whether this run had it already, why it failed."""

    seconds: float
    cache_hit: bool
    failure: str | None  # None: passed; else the command, how it ended and its output's tail


def run_gate(
    case: CommandCase, build: BuildResult, values: dict[str, Any], env: dict[str, str], run_id: str | None
) -> GateResult:
    """Run the case's `gate` in the built checkout, once per host, commit and run.

    Its outcome (pass or fail) is kept for the run's later jobs on this host, which report the
    original time as a cache hit; the next run tests again. The output is kept beside the build
    (`<checkout>.gate-<key>.log`).

    Raises:
        CommandCaseError: the gate template names an unknown field.
    """
    assert case.gate is not None
    command = render(case.gate, values, "gate")
    key = hashlib.sha256(command.encode()).hexdigest()[:10]
    marker = None
    if run_id:
        run_slug = _safe(run_id)
        marker = cache_root(case) / "gates" / run_slug / f"{build.path.name}-{key}.json"
    with _file_lock(build.path.with_name(build.path.name + ".lock")):
        if marker is not None and marker.exists():
            record = json.loads(marker.read_text())
            return GateResult(float(record["seconds"]), True, record["failure"])
        outcome = _run_shell(command, build.path, env, case.timeout)
        output = outcome.stdout + ("\n" if outcome.stdout and outcome.stderr else "") + outcome.stderr
        build.path.with_name(f"{build.path.name}.gate-{key}.log").write_text(output)
        failure = None
        if outcome.failure is not None:
            how = outcome.failure.split("; stderr:")[0]
            failure = f"gate `{command}` {how}: {_failure_summary(output)}"
        if marker is not None:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(json.dumps({"command": command, "seconds": outcome.seconds, "failure": failure}))
        return GateResult(outcome.seconds, False, failure)


@dataclass(frozen=True)
class RunOutcome:
    """One run of a shell command: its whole stdout (at most `max_output()` bytes), stderr's tail."""

    stdout: str
    stderr: str
    seconds: float
    failure: str | None  # None: exit 0 within the timeout and the output limit; else why, with stderr's tail


def max_output() -> int:
    """Bytes a run may print on one stream (`$ORCHESTRATE_MAX_OUTPUT_MB` MiB, default 64)."""
    raw = os.environ.get("ORCHESTRATE_MAX_OUTPUT_MB", "")
    try:
        return int(float(raw) * 2**20) if raw else DEFAULT_MAX_OUTPUT
    except ValueError:
        return DEFAULT_MAX_OUTPUT


def _run_shell(command: str, cwd: Path, env: dict[str, str], timeout: float) -> RunOutcome:
    """Run `command` as one process tree with the GPU lock's descriptor and no Ray variables,
    its output through files (memory stays bounded whatever it prints)."""
    limit = max_output()
    with tempfile.TemporaryDirectory(prefix="orchestrate-run-") as tmp:
        out = Path(tmp) / "stdout"
        try:
            result = run_tree(
                ["bash", "-c", command], cwd=cwd, env=workload_env(env), timeout=timeout, stdout=out,
                pass_fds=held_lock_fds(), max_output=limit, tail_bytes=TAIL_CHARS * 4,
            )  # fmt: skip
        except OSError as exc:
            raise CommandCaseError(f"cannot start bash: {exc.strerror or exc}") from None
        stdout = result.stdout_tail if result.overflow else out.read_text(encoding="utf-8", errors="replace")
    failure = result.failure(timeout, limit)
    return RunOutcome(
        stdout, result.stderr_tail, result.seconds, _with_stderr(failure, result.stderr_tail) if failure else None
    )
