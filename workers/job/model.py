"""The `model` case: whole-decoder load time and its parts, prefill and decode tok/s at steady state,
a chat user's token latency, peak memory, greedy digest.

`run_model_job` (called by `workers.job.runner` for cases of kind "model") measures in two kinds of
process (`workers.job.model_sample`):

* Cold loads, one per fresh process (no MLX state; the OS page cache is not dropped: a first load
  may read from disk, the later ones from memory; the round is in every row), arms in ABBA order,
  as many rounds as `workers.job.sampling.Rounds` asks (at least `repetitions`): `load_seconds`,
  its parts in the row's extra (`load_<part>_s`: reading, building, repacking, evaluating), and
  `peak_memory_bytes` of the arm loaded and run once (in the first `repetitions` rounds; a later
  load, taken to narrow the load time's interval, skips the run). One round comes first (an arm
  that cannot load is known before the steady process); the rest come after the steady process,
  with what it left of the point's `max_seconds` (at least a third: `workers.job.steady.PHASES`).
* Steady state, one process with every arm loaded (`workers.job.steady`): prefill rounds
  (`prefill_tok_s`), decode windows generated as mlx-lm generates (`decode_tok_s`, the host's
  share of the window in the extra) and a chat user's one-token-at-a-time latency
  (`token_latency_ms`), arms ABBA, each metric to the job's precision target within its share of
  the budget.

The prompt is `prompt_tokens` random token ids from the job's seed, the same for every arm. The
steady process checks every arm's loaded layers against the NVFP4 reference
(`kernels.model.check_layers`) before its rounds: one `rel_error` row per arm, and an arm over its
tolerance has all its rows failed, however fast it was. Every decode window of an arm starts from
the same prefilled state, so its greedy tokens' digest is the same in every window.

The `checkpoint` parameter names a local mlx-lm model directory, used as it is; when it is absent
every row says `unsupported` and why. Without it, the decoder described by the parameters is
generated once per (config, seed) into a cache directory shared by all runs on the host:
`$ORCHESTRATE_MODEL_CACHE`, else `models/` in the host's spool (`$ORCHESTRATE_SPOOL`, the job's
`spool_dir`, or `~/.orchestrate/spool`, as `workers.job.task` picks it).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kernels import registry
from kernels.timing import abba_order
from workers.contract import JobContext, JobSpec, RowBuilder, Status
from workers.job import phases
from workers.job.model_sample import RESULT_MARK, LoadRequest, LoadSample, SteadyRequest
from workers.job.sampling import Rounds
from workers.job.steady import PHASES, ArmOutcome, SteadyResult, Timed
from workers.job.task import DEFAULT_SPOOL
from workers.proc import spawn as forkclient

DEFAULT_TIMEOUT_S = 3600.0
LOAD_METRICS = (("load_seconds", "seconds"), ("peak_memory_bytes", "bytes"))
STEADY_METRICS = (("prefill_tok_s", "tok/s"), ("decode_tok_s", "tok/s"), ("token_latency_ms", "ms"))
METRICS = LOAD_METRICS + STEADY_METRICS
CONFIG_FIELDS = ("architecture", "hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim", "vocab", "dtype")


@dataclass(frozen=True)
class SampleError:
    """Why a sample or a job has no numbers: a failure, or an arm/checkpoint this host cannot run."""

    message: str
    unsupported: bool = False


def model_cache_root(job: JobSpec) -> Path:
    """Where generated checkpoints live on this host, shared by all runs (module docstring)."""
    env = os.environ.get("ORCHESTRATE_MODEL_CACHE")
    if env:
        return Path(env).expanduser()
    spool = os.environ.get("ORCHESTRATE_SPOOL") or job.spool_dir or DEFAULT_SPOOL
    return Path(spool).expanduser() / "models"


@dataclass(frozen=True)
class ChildResult:
    """A finished child process: exit code (None: timed out), output, how it was started."""

    returncode: int | None
    stdout: str
    stderr: str
    how: str


def _child(args: list[str], env: dict[str, str], timeout: float) -> ChildResult:
    """`python -m workers.job.model_sample ARGS` in a process of its own.

    Forked from the job's fork server (`workers.proc.forkserver`) when there is one and `env` sets
    nothing (a variable MLX or mlx-lm reads at import must reach a fresh interpreter),
    else a fresh interpreter. Output goes through temporary files, never pipes held in memory.
    """
    root = str(Path(__file__).resolve().parents[2])
    base = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    server = None if env else forkclient.ForkServer.from_env()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        code, how = forkclient.run_entry(
            "model_sample",
            args,
            env=base,
            changes=env,
            stdout=out.fileno(),
            stderr=err.fileno(),
            timeout=timeout,
            server=server,
        )
        out.seek(0)
        err.seek(0)
        return ChildResult(code, out.read().decode(errors="replace"), _tail(err.read()), how)


def _tail(data: bytes, limit: int = 4096) -> str:
    return data[-limit:].decode(errors="replace")


def _child_error(proc: ChildResult) -> str:
    if proc.returncode is None:
        return "timed out"
    tail = (proc.stderr or proc.stdout or "").strip().splitlines()
    return f"exit {proc.returncode}: {tail[-1] if tail else 'no output'}"


def _checkpoint(job: JobSpec, params: dict[str, Any], timeout: float) -> Path | SampleError:
    """The checkpoint directory to load: the named one, or the generated one (written if needed)."""
    named = str(params.get("checkpoint") or "")
    if named:
        path = Path(named).expanduser().resolve()
        if not (path / "config.json").is_file():
            msg = f"checkpoint {named!r} not found on this host (no {path}/config.json)"
            return SampleError(msg, unsupported=True)
        return path
    # MLX comes with it: imported by a job that generates a checkpoint, never at this module's import
    from kernels.checkpoint import DecoderConfig

    try:
        config = DecoderConfig(**{k: params[k] for k in CONFIG_FIELDS if k in params})
    except (TypeError, ValueError) as exc:
        return SampleError(f"model parameters: {exc}")
    dest = model_cache_root(job) / f"{config.architecture}-{config.cache_key(job.seed)}"
    if (dest / "config.json").is_file():
        return dest
    spec = json.dumps({"config": asdict(config), "seed": job.seed, "dest": str(dest)})
    with phases.span("build"):
        proc = _child(["write", spec], {}, timeout)
    if proc.returncode != 0:
        return SampleError(f"generating the checkpoint failed: {_child_error(proc)}")
    return dest


def _answer(proc: ChildResult, timeout: float) -> dict[str, Any] | SampleError:
    """The child's answer (the line marked `RESULT_MARK`), or why there is none."""
    if proc.returncode is None:
        return SampleError(f"sample timed out after {timeout:.0f} s")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            out: dict[str, Any] = json.loads(line[len(RESULT_MARK) :])
            if "unsupported" in out:
                return SampleError(out["unsupported"], unsupported=True)
            return out
    return SampleError(_child_error(proc))


def _ask(
    verb: str, request: LoadRequest | SteadyRequest, env: dict[str, str], timeout: float
) -> tuple[dict[str, Any] | SampleError, float, str]:
    """A fresh process's answer to `verb REQUEST`, the seconds it took as asked, and how it was
    started; a process that gave no answer is charged to the job's `sample_other` phase."""
    asked = time.time()
    proc = _child([verb, json.dumps(asdict(request))], env, timeout)
    spent = time.time() - asked
    out = _answer(proc, timeout)
    if isinstance(out, SampleError):
        phases.current().add("sample_other", spent)
    return out, spent, proc.how


def _charge(parts: dict[str, float], spent: float) -> None:
    """A process's phases to the job, what they leave of `spent` as `sample_other`."""
    account = phases.current()
    for name, seconds in (parts | {"sample_other": spent - sum(parts.values())}).items():
        account.add(name, seconds)


def _cold_load(job: JobSpec, req: LoadRequest, timeout: float) -> LoadSample | SampleError:
    """One cold load in a fresh process; its time is split into the job's phases: the process's
    start and imports, the load, the untimed run after it (`warmup`), and the rest."""
    asked = time.time()
    out, spent, how = _ask("load", req, job.arm_env.get(req.arm, {}), timeout)
    if isinstance(out, SampleError):
        return out
    sample = LoadSample(**{**out, "process": how})
    parts = {
        "sample_start": max(sample.started_at - asked, 0.0) + sample.imports_seconds,
        "load": sample.load_seconds,
        "warmup": sample.run_seconds,
    }
    _charge(parts, spent)
    return sample


def _steady(
    job: JobSpec, path: Path, arms: list[str], params: dict[str, Any], timeout: float
) -> SteadyResult | SampleError:
    """The steady-state rounds of `arms`, all in one process (`workers.job.steady`)."""
    envs = {json.dumps(sorted(job.arm_env.get(arm, {}).items())) for arm in arms}
    if len(envs) > 1:
        return SampleError("the arms set different environments: steady-state rounds need every arm in one process")
    req = SteadyRequest(job=job.model_dump_json(), checkpoint=str(path), arms=arms, params=params)
    out, spent, _ = _ask("steady", req, job.arm_env.get(arms[0], {}), timeout)
    if isinstance(out, SampleError):
        return out
    result = SteadyResult(
        timed=[Timed(**{**t, "window": tuple(t["window"])}) for t in out["timed"]],
        arms={arm: ArmOutcome(**o) for arm, o in out["arms"].items()},
        extras=out["extras"],
        phases=out["phases"],
        device=out["device"],
    )
    _charge(result.phases, spent)
    return result


def _outcome_rows(
    rows: RowBuilder, arm: str, sample: int, error: str, status: Status, metrics: tuple[tuple[str, str], ...] = METRICS
) -> None:
    for metric, unit in metrics:
        rows.add(arm, metric, None, unit, sample=sample, status=status, error=error)


@dataclass
class Loads:
    """An arm's cold loads: (round, sample, window) each, and the error that stopped them."""

    samples: list[tuple[int, LoadSample, tuple[float, float]]]
    error: SampleError | None = None


def run_model_job(job: JobSpec, rows: RowBuilder, context: JobContext) -> Status:
    """Measure every arm of a `model` job (module docstring); returns the job status."""
    params = {**registry.CASES["model"].defaults, **job.params}
    timeout = float(job.options.get("timeout", DEFAULT_TIMEOUT_S))
    path = _checkpoint(job, params, timeout)
    if isinstance(path, SampleError):
        status = Status.UNSUPPORTED if path.unsupported else Status.FAILED
        for arm in job.arms:
            _outcome_rows(rows, arm, -1, path.message, status)
        return status
    loads = {arm: Loads([]) for arm in job.arms}
    first = int(job.options.get("first_round", 0))
    for arm in job.arms:  # one cold load each first: an arm that cannot load stays out of the steady process
        _load_into(job, path, params, timeout, loads[arm], arm, first)
    live = [arm for arm in job.arms if loads[arm].error is None]
    steady = _steady(job, path, live, params, timeout) if live else None
    rounds = Rounds(_loads_after(job, loads, steady), list(job.arms), metric="load_seconds")
    for arm in live:
        rounds.record(first, arm, loads[arm].samples[0][1].load_seconds)
    rounds.resume_after(first)
    for arm in (a for a in job.arms if a not in live):
        _leave_out(rounds, arm)
    for round_ in rounds if live else ():
        for arm in abba_order(job.arms, round_):
            if loads[arm].error is not None:
                continue
            if _load_into(job, path, params, timeout, loads[arm], arm, round_):
                rounds.record(round_, arm, loads[arm].samples[-1][1].load_seconds)
            else:
                _leave_out(rounds, arm)
        if all(load.error for load in loads.values()):
            break
    load_extras = {arm: rounds.extras(arm) for arm in job.arms}
    statuses = [_arm_rows(rows, arm, loads[arm], load_extras[arm], steady, str(path)) for arm in job.arms]
    if Status.FAILED in statuses:
        return Status.FAILED
    return Status.OK if Status.OK in statuses else Status.UNSUPPORTED


def _load_into(
    job: JobSpec, path: Path, params: dict[str, Any], timeout: float, loads: Loads, arm: str, round_: int
) -> bool:
    """One cold load of `arm` in round `round_` into `loads`; False when it failed (an arm that failed
    or is unsupported once is not retried)."""
    t0 = time.monotonic()
    # the peak memory of a run after the load is measured in the minimum rounds; the later loads, taken
    # to narrow the load time's interval, skip that run (it costs a cold process more than its load)
    req = LoadRequest(str(path), arm, int(params["prompt_tokens"]), job.seed, run=round_ < job.repetitions)
    outcome = _cold_load(job, req, timeout)
    if isinstance(outcome, SampleError):
        loads.error = outcome
        return False
    loads.samples.append((round_, outcome, (t0, time.monotonic())))
    return True


def _leave_out(rounds: Rounds, arm: str) -> None:
    """An arm whose load failed: out of the stop rule; when it is the baseline, nothing is left to
    compare with, and the rule asks for the minimum rounds."""
    rounds.exclude(arm)
    if arm == rounds.baseline:
        rounds.baseline = None


def _loads_after(job: JobSpec, loads: dict[str, Loads], steady: SteadyResult | SampleError | None) -> JobSpec:
    """The job as the cold loads after the steady process see it: with what the first loads and the
    steady rounds left of the point's sampling budget, at least the loads' own share (`PHASES`)."""
    seconds = job.options.get("max_seconds")
    if seconds is None:
        return job
    spent = sum(w[1] - w[0] for load in loads.values() for _, _, w in load.samples)
    spent += steady.phases.get("timed", 0.0) if isinstance(steady, SteadyResult) else 0.0
    left = max(float(seconds) / PHASES, float(seconds) - spent)
    return job.model_copy(update={"options": {**job.options, "max_seconds": left}})


def _check_error(outcome: ArmOutcome) -> str | None:
    """The failure of an arm's layer check, or None when it passed."""
    rel, tol = outcome.rel_error, outcome.tolerance
    if rel is None or tol is None or rel <= tol:
        return None
    return f"rel_error {rel:.3g} over tolerance {tol:.3g} at {outcome.checked}"  # NaN fails too


def _arm_rows(
    rows: RowBuilder,
    arm: str,
    loads: Loads,
    load_extra: dict[str, str],
    steady: SteadyResult | SampleError | None,
    checkpoint: str,
) -> Status:
    if loads.error is not None and loads.error.unsupported and not loads.samples:
        _outcome_rows(rows, arm, -1, loads.error.message, Status.UNSUPPORTED)
        return Status.UNSUPPORTED
    outcome = steady.arms.get(arm) if isinstance(steady, SteadyResult) else None
    errors = [e.message for e in (loads.error, steady if isinstance(steady, SampleError) else None) if e]
    if outcome is not None and outcome.unsupported:
        errors.append(outcome.unsupported)
    error = (outcome and _check_error(outcome)) or (errors[0] if errors else None)
    status = Status.FAILED if error else Status.OK
    common = {"checkpoint": checkpoint}
    digests = sorted(set(outcome.digests)) if outcome else []
    if digests:
        common["greedy_digest"] = max(digests, key=outcome.digests.count) if outcome else ""
    # Greedy output that differs between windows of one arm is recorded, not failed: each decode
    # row keeps its own digest, and every row of the arm lists them all (`greedy_digests`), so the
    # same-output criterion calls the point AMBIGUOUS (an unstable reference) and a reader sees it.
    # The layer check is what says the arm computes the right thing.
    if len(digests) > 1:
        common["greedy_digests"] = ",".join(digests)
    for round_, sample, window in loads.samples:
        extra = common | load_extra | {"mlx_device": sample.device, "sample_process": sample.process}
        extra |= {f"load_{part}_s": f"{seconds:.4g}" for part, seconds in sample.parts.items()}
        for metric, unit in LOAD_METRICS:
            value = getattr(sample, metric)
            if value is None:
                continue  # a load without the run after it: no peak memory
            rows.add(arm, metric, value, unit, sample=round_, status=status, error=error, route=sample.route,
                     extra=extra, window=window)  # fmt: skip
    if outcome is not None and outcome.rel_error is not None:
        extra = common | {"tolerance": repr(outcome.tolerance), "layer": outcome.checked}
        if isinstance(steady, SteadyResult):
            extra["mlx_device"] = steady.device
        rows.add(arm, "rel_error", outcome.rel_error, "ratio", status=status, error=error, route=outcome.route,
                 extra=extra)  # fmt: skip
    if loads.error is not None:
        _outcome_rows(rows, arm, -1, loads.error.message, Status.FAILED, LOAD_METRICS)
    if isinstance(steady, SteadyResult) and outcome is not None and not outcome.unsupported:
        units = dict(STEADY_METRICS)
        for timed in (t for t in steady.timed if t.arm == arm):
            extra = common | {"mlx_device": steady.device} | timed.extra | steady.extras[timed.metric][arm]
            rows.add(arm, timed.metric, timed.value, units[timed.metric], sample=timed.round, status=status,
                     error=error, route=outcome.route, extra=extra, window=timed.window)  # fmt: skip
    elif loads.samples or error:
        _outcome_rows(rows, arm, -1, error or "not measured at steady state", Status.FAILED, STEADY_METRICS)
    return status
