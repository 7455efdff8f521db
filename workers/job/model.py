"""The `model` case: whole-decoder load time, prefill and decode tok/s, peak memory, greedy digest.

`run_model_job` (called by `workers.job.runner` for cases of kind "model") measures every sample in a
fresh Python process (`workers.job.model_sample`), so `load_seconds` is a cold
load from disk into a process with no MLX state (the OS page cache is not dropped: a first sample
may read from disk, the later ones from memory; the sample index is in every row). In the process:
load the checkpoint for the arm (`kernels.model.load_decoder`), `warmup` untimed passes, then one
timed prefill of `prompt_tokens` tokens (chunks of `PREFILL_STEP`, as mlx-lm's generate does),
`decode_tokens` greedy steps timed one token at a time, the peak memory since the process began,
and a digest of the greedy token ids. Arms are interleaved ABBA across repetitions.

The prompt is `prompt_tokens` random token ids from the job's seed, the same for every arm and
sample. The digest must be the same in every sample of an arm (same weights, same greedy
tokens); an arm whose digest changes between samples is failed. The first sample of each arm
also checks the loaded layers against the NVFP4 reference (`kernels.model.check_layers`, after
everything else is measured): one `rel_error` row per arm, and an arm over its tolerance has all
its rows failed, however fast it was.

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
from workers.contract import JobContext, JobSpec, RowBuilder, Status, Window
from workers.job import phases
from workers.job.measure import abba_order
from workers.job.model_sample import RESULT_MARK, Sample, SampleRequest
from workers.job.task import DEFAULT_SPOOL
from workers.proc import spawn as forkclient

DEFAULT_TIMEOUT_S = 3600.0
METRICS = (
    ("load_seconds", "seconds"),
    ("prefill_tok_s", "tok/s"),
    ("decode_tok_s", "tok/s"),
    ("peak_memory_bytes", "bytes"),
)
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

    Forked from the job's fork server (`workers.proc.forkserver`) when there is one and the arm sets
    no environment (a variable MLX or mlx-lm reads at import must reach a fresh interpreter),
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


def sample_phases(sample: Sample, asked: float, spent: float) -> dict[str, float]:
    """A finished sample's `spent` seconds from the request (at wall-clock `asked`) split into the
    job's phases: its process's start and imports, the cold load, warm-up, the timed part, the
    layer check, and the rest (request, result, exit)."""
    start = max(sample.started_at - asked, 0.0) + sample.imports_seconds
    parts = {
        "sample_start": start,
        "load": sample.load_seconds,
        "warmup": sample.warmup_seconds,
        "timed": sample.timed_seconds,
        "reference": sample.check_seconds,
    }
    return parts | {"sample_other": spent - sum(parts.values())}


def _sample(job: JobSpec, req: SampleRequest, timeout: float) -> Sample | SampleError:
    """One sample in a process of its own; its time is split into the job's phases."""
    asked = time.time()
    proc = _child(["sample", json.dumps(asdict(req))], job.arm_env.get(req.arm, {}), timeout)
    spent = time.time() - asked
    if proc.returncode is None:
        phases.current().add("sample_other", spent)
        return SampleError(f"sample timed out after {timeout:.0f} s")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            out = json.loads(line[len(RESULT_MARK) :])
            if "unsupported" in out:
                phases.current().add("sample_other", spent)
                return SampleError(out["unsupported"], unsupported=True)
            sample = Sample(**{**out, "process": proc.how})
            account = phases.current()
            for name, seconds in sample_phases(sample, asked, spent).items():
                account.add(name, seconds)
            return sample
    phases.current().add("sample_other", spent)
    return SampleError(_child_error(proc))


def _outcome_rows(rows: RowBuilder, arm: str, sample: int, error: str, status: Status) -> None:
    for metric, unit in METRICS:
        rows.add(arm, metric, None, unit, sample=sample, status=status, error=error)


def run_model_job(job: JobSpec, rows: RowBuilder, context: JobContext) -> Status:
    """Measure every arm of a `model` job, one row per metric per sample; returns the job status."""
    params = {**registry.CASES["model"].defaults, **job.params}
    timeout = float(job.options.get("timeout", DEFAULT_TIMEOUT_S))
    path = _checkpoint(job, params, timeout)
    if isinstance(path, SampleError):
        status = Status.UNSUPPORTED if path.unsupported else Status.FAILED
        for arm in job.arms:
            _outcome_rows(rows, arm, -1, path.message, status)
        return status
    results: dict[str, list[tuple[int, Sample | SampleError, Window]]] = {arm: [] for arm in job.arms}
    skip: set[str] = set()
    for rep in range(job.repetitions):
        for arm in abba_order(job.arms, rep):
            if arm not in skip:
                req = SampleRequest(
                    checkpoint=str(path),
                    arm=arm,
                    prompt_tokens=int(params["prompt_tokens"]),
                    decode_tokens=int(params["decode_tokens"]),
                    warmup=job.warmup,
                    seed=job.seed,
                    check=not results[arm],  # the first sample of each arm
                )
                t0 = time.monotonic()
                outcome = _sample(job, req, timeout)
                results[arm].append((rep, outcome, (t0, time.monotonic())))
                if isinstance(outcome, SampleError):
                    skip.add(arm)  # an arm that failed or is unsupported once is not retried
    statuses = [_arm_rows(rows, arm, results[arm], str(path)) for arm in job.arms]
    if Status.FAILED in statuses:
        return Status.FAILED
    return Status.OK if Status.OK in statuses else Status.UNSUPPORTED


def _extra(sample: Sample, checkpoint: str) -> dict[str, str]:
    return {
        "greedy_digest": sample.greedy_digest,
        "checkpoint": checkpoint,
        "mlx_device": sample.device,
        "sample_process": sample.process,
    }


def _check_error(sample: Sample) -> str | None:
    """The failure of a sample's layer check, or None when it passed."""
    rel, tol = sample.rel_error, sample.tolerance
    if rel is None or tol is None or rel <= tol:
        return None
    return f"rel_error {rel:.3g} over tolerance {tol:.3g} at {sample.checked}"  # NaN fails too


def _arm_rows(
    rows: RowBuilder, arm: str, outcomes: list[tuple[int, Sample | SampleError, Window]], checkpoint: str
) -> Status:
    samples = [(rep, s, w) for rep, s, w in outcomes if isinstance(s, Sample)]
    errors = [(rep, s) for rep, s, _ in outcomes if isinstance(s, SampleError)]
    if errors and errors[0][1].unsupported and not samples:
        _outcome_rows(rows, arm, -1, errors[0][1].message, Status.UNSUPPORTED)
        return Status.UNSUPPORTED
    digests = sorted({s.greedy_digest for _, s, _ in samples})
    error = errors[0][1].message if errors else None
    checked = next((s for _, s, _ in samples if s.rel_error is not None), None)
    error = (checked and _check_error(checked)) or error
    # Greedy output that differs between samples of one arm is recorded, not failed: each sample
    # row keeps its own digest, and every row of the arm lists them all (`greedy_digests`), so the
    # same-output criterion calls the point AMBIGUOUS (an unstable reference) and a reader sees it.
    # The layer check above is what says the arm computes the right thing; on a CUDA GPU every
    # arm, MLX's affine included, can give different digests in fresh sample processes (bfloat16
    # GEMMs are not bitwise reproducible across processes there, and random weights make near-ties).
    unstable = {"greedy_digests": ",".join(digests)} if len(digests) > 1 else {}
    status = Status.FAILED if error else Status.OK
    if checked is not None:
        extra = _extra(checked, checkpoint) | {"tolerance": repr(checked.tolerance), "layer": checked.checked}
        extra |= unstable
        value = checked.rel_error
        rows.add(arm, "rel_error", value, "ratio", status=status, error=error, route=checked.route, extra=extra)
    for rep, s, window in samples:
        extra = _extra(s, checkpoint) | unstable
        for metric, unit in METRICS:
            value = getattr(s, metric)
            rows.add(
                arm,
                metric,
                value,
                unit,
                sample=rep,
                status=status,
                error=error,
                route=s.route,
                extra=extra,
                window=window,
            )
    if errors:
        _outcome_rows(rows, arm, errors[0][0], errors[0][1].message, Status.FAILED)
    return status
