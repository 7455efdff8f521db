"""Command cases: an external benchmark built at a git commit, run per arm, its output parsed.

This module holds a command case's settings and the steps on the worker host; the job that runs
them, arms and commits interleaved, is `workers.command.job`. The job's `options` carry the
case's `repo`, `ref` (or `refs`: several commits compared in one job), `build`, `gate`, `run`,
`parse` and `timeout`; `arm_env` the environment overrides per arm. The steps:

1. Mirror `repo` (a git URL or a local path) into the host's cache and fetch it. The head resolves
   each ref when it plans the run (`plan_commits`) and sends the commits (`options.commits`, part
   of the job key, so a branch that moved is measured again on the next run); a ref the head could
   not reach (a path that exists only on the hosts) is resolved here, once per run and host. The
   commit goes into every row's `commit` column.
2. Check the commit out once per (host, commit, build command) and run `build` there, once: a
   marker beside the checkout records the build time, so a second job of that commit is a cache
   hit (`extra["build_cache"] = "hit"`) that still reports the original `build_seconds`
   (`workers.command.build`).
3. Run `gate` (the engine's own tests, e.g. `cargo test --test rocm_nvfp4_quant`) in that
   checkout, once per (host, commit, run): it must pass before anything is timed; a failure fails
   the job with the tail of the tests' output (`workers.command.build`).
4. Run the `run` template (`{param}` from the job's parameters, plus `{arm}`, `{backend}`,
   `{device}`, `{host}`, `{commit}`; values are shell-quoted) and parse each output.

A non-zero exit, a timeout, output that does not parse, a failed build or gate or an unknown ref
becomes a failed row carrying the tail of the output, never an exception.

Each build, gate and run is a `workers.proc.tree` tree (`run_shell`): the timeout kills all of
it (also what calls `setsid`), what it leaves running is ended when it exits, and it inherits the
GPU lock's descriptor, so the lock is held until the last of it is gone. Its output streams
through files: stdout is read back for the parser (at most `$ORCHESTRATE_MAX_OUTPUT_MB`, default
64 MiB: a stream past it stops the run), stderr only as a tail. It runs with this host's
environment without Ray's variables (`workers.command.workload.workload_env`: no token path, no
cluster address), plus the arm's env.

The cache lives in `$ORCHESTRATE_CACHE_DIR` or `~/.cache/orchestrate` (`options.cache_dir` wins).
A relative local `repo` path starts at `options.base_dir`, else at the worker's working directory
(on the embedded Ray instance, where `orchestrate` was started; a scheduled run starts where
`schedule add` ran). On remote hosts give a git URL or an absolute path on that host.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shlex
import string
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from workers.command.parsers import parser_for
from workers.command.workload import DEFAULT_MAX_OUTPUT, run_tree, workload_env
from workers.lock.gpu import held_lock_fds

DEFAULT_TIMEOUT = 3600.0
TAIL_CHARS = 1500
BUILTIN_FIELDS = frozenset({"arm", "backend", "device", "host", "commit"})
FIELD_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class CommandCaseError(Exception):
    """A step of a command case that failed: the message is what the failed rows say."""


class RefNotFoundError(CommandCaseError):
    """The repo was reached, and it has no such ref."""


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


def tail_of(text: str) -> str:
    text = text.strip()
    return text[-TAIL_CHARS:] if len(text) > TAIL_CHARS else text


def with_stderr(message: str, stderr: str) -> str:
    tail = tail_of(stderr)
    return f"{message}; stderr: {tail}" if tail else message


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Serialise jobs of one host on a mirror or a build directory (independent of the GPU lock)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def git(*args: str, cwd: Path | None = None, timeout: float = 600.0) -> str:
    # Never a prompt (no terminal here): a credential or host-key question fails the command.
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0"}
    env.setdefault("GIT_SSH_COMMAND", "ssh -o BatchMode=yes")
    try:
        proc = subprocess.run(
            ["git", *args],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise CommandCaseError(f"git {args[0]} did not finish within {timeout:g} s") from None
    if proc.returncode != 0:
        raise CommandCaseError(f"git {args[0]} failed: {tail_of(proc.stderr) or proc.returncode}")
    return proc.stdout.strip()


_URL_RE = re.compile(r"^[a-z+]+://|^[\w.-]+@[\w.-]+:")  # a URL or an scp-like address


def _repo_location(case: CommandCase) -> str:
    if _URL_RE.match(case.repo):
        return case.repo
    path = Path(case.repo).expanduser()
    if not path.is_absolute():
        path = Path(case.base_dir or os.getcwd()) / path
    return str(path.resolve())


def safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name) or "_"


def _mirror_path(case: CommandCase, location: str) -> Path:
    slug = safe_name(location.rstrip("/").split("/")[-1] or "repo")
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
        pin = cache_root(case) / "pins" / safe_name(run_id) / f"{mirror.stem}-{ref_hash}"
    with file_lock(mirror.with_suffix(".lock")):
        if pin is not None and pin.exists() and (mirror / "HEAD").exists():
            return mirror, pin.read_text().strip()
        if planned and (mirror / "HEAD").exists() and _has_commit(mirror, planned):
            return mirror, planned
        if (mirror / "HEAD").exists():
            git("--git-dir", str(mirror), "fetch", "--prune", "--quiet", "origin")
        else:
            git("clone", "--mirror", "--quiet", location, str(mirror))
        if planned:
            if not _has_commit(mirror, planned):
                when = f"ref {case.ref!r} when the run was planned"
                raise CommandCaseError(f"commit {planned} ({when}) is not in {location}")
            return mirror, planned
        try:
            commit = git("--git-dir", str(mirror), "rev-parse", "--verify", "--quiet", f"{case.ref}^{{commit}}")
        except CommandCaseError:
            raise RefNotFoundError(f"ref {case.ref!r} not found in {location}") from None
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
        except RefNotFoundError:
            raise
        except CommandCaseError:
            return {}  # unreachable from here: the hosts resolve the refs
    return commits


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


def run_shell(command: str, cwd: Path, env: dict[str, str], timeout: float) -> RunOutcome:
    """Run `command` as one process tree with the GPU lock's descriptor and no Ray variables,
    its output through files (memory stays bounded whatever it prints)."""
    limit = max_output()
    with tempfile.TemporaryDirectory(prefix="orchestrate-run-") as tmp:
        out = Path(tmp) / "stdout"
        try:
            result = run_tree(
                ["bash", "-c", command],
                cwd=cwd,
                env=workload_env(env),
                timeout=timeout,
                stdout=out,
                pass_fds=held_lock_fds(),
                max_output=limit,
                tail_bytes=TAIL_CHARS * 4,
            )
        except OSError as exc:
            raise CommandCaseError(f"cannot start bash: {exc.strerror or exc}") from None
        stdout = result.stdout_tail if result.overflow else out.read_text(encoding="utf-8", errors="replace")
    failure = result.failure(timeout, limit)
    return RunOutcome(
        stdout, result.stderr_tail, result.seconds, with_stderr(failure, result.stderr_tail) if failure else None
    )
