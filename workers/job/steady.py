"""The `model` case at steady state: every arm loaded in one process, prefill and decode in ABBA rounds.

Runs in the sample process (`workers.job.model_sample steady`), after the cold loads. Each arm is
loaded (`kernels.model.load_decoder`), checked against the NVFP4 reference
(`kernels.model.check_layers`), prefilled once with the job's prompt, and that state is kept
(`Snapshot`): every decode window starts from it, so every window of an arm decodes the same
context and, greedily, the same tokens (their digest is the arm's `greedy_digest`).

Then, after `warmup` untimed passes per arm, right before the rounds they warm:

* prefill rounds (`prefill_tok_s`): the prompt through a fresh cache, in chunks of `PREFILL_STEP`
  as mlx-lm's generate does;
* decode rounds: per arm, a window of the job's `decode_tokens` tokens (the built-in sweeps ask for
  128, long enough that a window's start and end are a small share of it) generated as mlx-lm's
  `generate_step` generates them, the next step built and queued (`mx.async_eval`) before the
  current token is read (`decode_tok_s`; its extra has the host's share of the window, the time
  Python spent building and queueing steps over the window's wall time, and the milliseconds per
  step of each: `host_ms_per_step`, `build_ms_per_step`), then `LATENCY_TOKENS` tokens one at a
  time, each evaluated before the next is built, as a chat user waits for them
  (`token_latency_ms`, milliseconds per token).

Both run through `workers.job.sampling.Rounds`: ABBA order, at least `repetitions` rounds, then
until the job's precision target or its share of the budget (`budget_share`) is reached; the decode
rounds also get what the prefill rounds left of theirs (a prefill reaches its target sooner).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kernels import mlx_lm_classes
from kernels.timing import abba_order
from workers.contract import JobSpec
from workers.job.sampling import Rounds

PREFILL_STEP = 2048  # mlx-lm's prefill_step_size
LATENCY_TOKENS = 16
WARMUP_TOKENS = 8
PHASES = 3  # the budget is shared by the cold loads, the prefill rounds and the decode rounds


def budget_share(job: JobSpec, unused: float = 0.0) -> JobSpec:
    """The job as one of its `PHASES` sampling phases sees it: a third of its time budget, and the
    `unused` seconds an earlier phase left of its own third."""
    seconds = job.options.get("max_seconds")
    if seconds is None:
        return job
    share = float(seconds) / PHASES + max(0.0, unused)
    return job.model_copy(update={"options": {**job.options, "max_seconds": share}})


@dataclass(frozen=True)
class Timed:
    """One timed value: a round's sample of one arm (window: monotonic seconds, as rows take it)."""

    metric: str
    arm: str
    round: int
    value: float
    window: tuple[float, float]
    extra: dict[str, str] = field(default_factory=dict)


@dataclass
class ArmOutcome:
    """What the steady process found about one arm besides its timed values."""

    route: str = ""
    unsupported: str | None = None
    digests: list[str] = field(default_factory=list)
    rel_error: float | None = None
    tolerance: float | None = None
    checked: str = ""


@dataclass
class SteadyResult:
    """The steady process's answer: timed values, per-arm outcomes, how each metric's rounds ended."""

    timed: list[Timed]
    arms: dict[str, ArmOutcome]
    extras: dict[str, dict[str, dict[str, str]]]  # metric -> arm -> `Rounds.extras`
    phases: dict[str, float]
    device: str


class Snapshot:
    """A prompt cache's state (mlx-lm's `state`, as its prompt-cache files keep it), restored as
    fresh cache objects over fresh array objects: a window's in-place cache writes replace those
    objects' contents, never the kept ones'."""

    def __init__(self, cache: list[Any]) -> None:
        self.kept = [(type(c), tuple(c.state)) for c in cache]

    def restore(self) -> list[Any]:
        import mlx.core as mx

        return [
            kind.from_state(tuple(mx.array(v) if isinstance(v, mx.array) else v for v in state))
            for kind, state in self.kept
        ]


def digest(token_ids: list[int]) -> str:
    """A short, stable digest of a greedy token sequence."""
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()[:16]


class ArmRunner:
    """One loaded arm: its prefill, its pipelined decode window and its one-at-a-time latency."""

    def __init__(self, model: Any, prompt: Any, stream: Any) -> None:
        import mlx.core as mx

        self.mx = mx
        self.model = model
        self.prompt = prompt
        self.stream = stream
        self.make_cache = mlx_lm_classes.import_models("cache").make_prompt_cache
        cache = self.make_cache(model)
        self.first = self.prefill(cache)
        self.snapshot = Snapshot(cache)

    def prefill(self, cache: list[Any]) -> Any:
        """The prompt through `cache` (chunks as mlx-lm's), evaluated: the first generated token."""
        mx, n = self.mx, self.prompt.size
        with mx.stream(self.stream):
            for start in range(0, n, PREFILL_STEP):
                logits = self.model(self.prompt[None, start : start + PREFILL_STEP], cache=cache)
                if start + PREFILL_STEP < n:
                    mx.eval([c.state for c in cache])
            token = mx.argmax(logits[:, -1, :], axis=-1)
        mx.eval(token)
        return token

    def timed_prefill(self) -> float:
        """Seconds of one prefill of the prompt through a fresh cache."""
        cache = self.make_cache(self.model)
        self.mx.synchronize()
        start = time.perf_counter()
        self.prefill(cache)
        self.mx.synchronize()
        return time.perf_counter() - start

    def _step(self, token: Any, cache: list[Any]) -> Any:
        """One decode step's graph as mlx-lm's `generate_step` builds it (greedy sampler)."""
        mx = self.mx
        logits = self.model(token[None], cache=cache)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        return mx.argmax(logprobs, axis=-1)

    def window(self, steps: int) -> tuple[list[int], float, float, float]:
        """`steps` tokens from the kept state, pipelined: (token ids, wall seconds, host seconds,
        of which building the steps' graphs).

        As mlx-lm's loop: step n+1 is built and queued with `mx.async_eval` before token n is read
        (`.item()`), so the device works while Python builds the next graph. Host seconds are the
        time spent building and queueing; queueing returns at once while the device keeps up, but
        waits where MLX caps the work in flight (on its CPU backend, every op is a task): building
        alone is the Python cost of a step on any backend.
        """
        mx, cache = self.mx, self.snapshot.restore()
        ids: list[int] = []
        mx.synchronize()
        start = time.perf_counter()
        with mx.stream(self.stream):
            y = self._step(self.first, cache)
            build = time.perf_counter() - start
            mx.async_eval(y)
            host = time.perf_counter() - start
            for n in range(steps):
                following = None
                if n + 1 < steps:
                    t0 = time.perf_counter()
                    following = self._step(y, cache)
                    t1 = time.perf_counter()
                    mx.async_eval(following)
                    build += t1 - t0
                    host += time.perf_counter() - t0
                ids.append(int(y.item()))
                y = following
        return ids, time.perf_counter() - start, host, build

    def latency(self, steps: int) -> float:
        """Mean seconds per token of `steps` tokens from the kept state, each evaluated before the
        next is built (a chat user waiting for every token)."""
        mx, cache = self.mx, self.snapshot.restore()
        y = self.first
        mx.synchronize()
        start = time.perf_counter()
        with mx.stream(self.stream):
            for _ in range(steps):
                y = self._step(y, cache)
                mx.eval(y)
        return (time.perf_counter() - start) / steps


def _phase(phases: dict[str, float], name: str, since: float) -> float:
    now = time.perf_counter()
    phases[name] = phases.get(name, 0.0) + now - since
    return now


def measure_steady(
    job: JobSpec, checkpoint: Path, arms: list[str], params: dict[str, Any], imports_seconds: float
) -> SteadyResult:
    """Load every arm, check it, then prefill and decode rounds (module docstring)."""
    import mlx.core as mx

    from kernels.model import ArmUnsupported, check_layers, load_decoder

    phases = {"sample_start": imports_seconds}
    mark = time.perf_counter()
    outcomes: dict[str, ArmOutcome] = {}
    runners: dict[str, ArmRunner] = {}
    stream = mx.new_stream(mx.default_device())  # as mlx-lm's generation stream
    prompt_tokens = int(params["prompt_tokens"])
    for arm in arms:
        try:
            loaded = load_decoder(checkpoint, arm)
        except ArmUnsupported as exc:
            outcomes[arm] = ArmOutcome(unsupported=str(exc))
            continue
        prompt = np.random.default_rng(job.seed).integers(0, loaded.vocab, prompt_tokens)
        runners[arm] = ArmRunner(loaded.model, mx.array(prompt, dtype=mx.int32), stream)
        outcomes[arm] = ArmOutcome(route=loaded.route)
    mark = _phase(phases, "build", mark)  # loaded to be measured at steady state: the cold loads are timed apart
    for arm, runner in runners.items():
        check = check_layers(runner.model, checkpoint, arm, np.random.default_rng(job.seed))
        if check.layers:
            outcome = outcomes[arm]
            outcome.rel_error, outcome.tolerance = check.rel_error, check.tolerance
            outcome.checked = f"{check.layer} (worst of {check.layers})"
    mark = _phase(phases, "reference", mark)
    window_tokens = int(params["decode_tokens"])  # the memory estimate, `kernels.shapes.model_bytes`, counts it
    for _ in range(job.warmup):
        for runner in runners.values():
            runner.timed_prefill()
            runner.window(WARMUP_TOKENS)
    mark = _phase(phases, "warmup", mark)
    live = list(runners)
    failing = [a for a in live if _check_fails(outcomes[a])]
    timed: list[Timed] = []
    extras: dict[str, dict[str, dict[str, str]]] = {}

    prefill_rounds = _rounds(job, live, "prefill_tok_s", failing)
    for round_ in prefill_rounds:
        for arm in abba_order(live, round_):
            t0 = time.monotonic()
            seconds = runners[arm].timed_prefill()
            value = prompt_tokens / seconds
            prefill_rounds.record(round_, arm, value)
            timed.append(Timed("prefill_tok_s", arm, round_, value, (t0, time.monotonic())))
    extras["prefill_tok_s"] = {a: prefill_rounds.extras(a) for a in live}
    mark = _phase(phases, "timed", mark)

    for arm in live:  # the decode rounds' warm-up, right before them
        runners[arm].window(WARMUP_TOKENS)
    mark = _phase(phases, "warmup", mark)
    left = (prefill_rounds.target.max_seconds or 0.0) - prefill_rounds.seconds  # the prefill's unused share
    decode_rounds = _rounds(job, live, "decode_tok_s", failing, left)
    latency_rounds = _rounds(job, live, "token_latency_ms", failing, left)
    for round_ in decode_rounds:
        for arm in abba_order(live, round_):
            runner = runners[arm]
            t0 = time.monotonic()
            ids, seconds, host, build = runner.window(window_tokens)
            t1 = time.monotonic()
            value = window_tokens / seconds
            decode_rounds.record(round_, arm, value)
            outcomes[arm].digests.append(digest(ids))
            extra = {
                "window_tokens": str(window_tokens),
                "host_share": f"{host / seconds:.4g}",
                "host_ms_per_step": f"{1e3 * host / window_tokens:.4g}",
                "build_ms_per_step": f"{1e3 * build / window_tokens:.4g}",
                "greedy_digest": digest(ids),
            }
            timed.append(Timed("decode_tok_s", arm, round_, value, (t0, t1), extra))
            latency_ms = 1e3 * runner.latency(LATENCY_TOKENS)
            latency_rounds.record(round_, arm, latency_ms)
            extra = {"latency_tokens": str(LATENCY_TOKENS)}
            timed.append(Timed("token_latency_ms", arm, round_, latency_ms, (t1, time.monotonic()), extra))
    # the latency rides on the decode rounds: it says how they ended, with its own interval
    latency_rounds.reason = decode_rounds.reason
    if latency_rounds.target.adaptive:
        latency_rounds.measure_widths(min_blocks=2)  # as `Rounds` reports a finished point
    extras["decode_tok_s"] = {a: decode_rounds.extras(a) for a in live}
    extras["token_latency_ms"] = {a: latency_rounds.extras(a) for a in live}
    _phase(phases, "timed", mark)
    return SteadyResult(timed, outcomes, extras, phases, str(mx.default_device()))


def _rounds(job: JobSpec, arms: list[str], metric: str, failing: list[str], unused: float = 0.0) -> Rounds:
    rounds = Rounds(budget_share(job, unused), arms, metric=metric)
    for arm in failing:
        rounds.exclude(arm)  # failed its check: no precision is owed on it
    return rounds


def _check_fails(outcome: ArmOutcome) -> bool:
    rel, tol = outcome.rel_error, outcome.tolerance
    return rel is not None and tol is not None and not rel <= tol
