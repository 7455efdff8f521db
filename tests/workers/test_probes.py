"""Foreign-GPU-user probes, the idle gate and the contention monitor, with real processes.

There is no GPU here: the KFD list is a directory the test makes (the probe reads only names), and
`nvidia-smi` is a small fake executable on PATH, named as such, printing what the real one prints.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from workers.contract import ErrorKind, HostFingerprint, JobSpec, LockSettings, Status, footer_error_kind, footer_status
from workers.host.fingerprint import host_fingerprint
from workers.job.runner import run_job
from workers.lock.file import lock_status
from workers.lock.gpu import GUARD_ENV, LockBusyError
from workers.lock.probes import (
    PROBES,
    ContentionMonitor,
    CpuQuietProbe,
    IgnoringProbe,
    KfdProbe,
    NvidiaSmiProbe,
    ProbeSample,
    ProbeUnavailableError,
    backend_probe,
    gate_knob,
    parse_compute_apps,
    probe_for,
    wait_idle,
)
from workers.lock.probes.base import command_of


@pytest.fixture(autouse=True)
def _no_outer_holder(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(GUARD_ENV, raising=False)


def spawn_foreign(command: str) -> int:
    """Start `command` outside our process tree (its shell parent exits, so init adopts it)."""
    out = subprocess.run(
        ["setsid", "sh", "-c", f"{command} </dev/null >/dev/null 2>&1 & echo $!"],
        capture_output=True,
        text=True,
        check=True,
        timeout=10,
    ).stdout
    return int(out.strip())


@pytest.fixture
def foreign_sleeper() -> Iterator[int]:
    pid = spawn_foreign("sleep 60")
    yield pid
    os.kill(pid, signal.SIGKILL)


@pytest.fixture
def dead_pid() -> int:
    gone = subprocess.Popen(["true"])
    gone.wait()
    return gone.pid


def test_kfd_live_foreign_pid_is_contention(tmp_path: Path, foreign_sleeper: int) -> None:
    kfd = tmp_path / "kfd"
    kfd.mkdir()
    (kfd / str(foreign_sleeper)).mkdir()
    probe = KfdProbe(str(kfd))
    seen = probe.sample()
    assert list(seen.foreign) == [foreign_sleeper]
    assert "sleep" in seen.foreign[foreign_sleeper]
    monitor = ContentionMonitor(probe, interval=0.1)
    monitor.start()
    time.sleep(0.35)
    report = monitor.stop()
    assert report.contended
    assert report.foreign_pids == [foreign_sleeper]
    assert report.samples >= 3 and report.busy_samples == report.samples


def test_kfd_dead_pid_and_our_own_children_are_not_contention(tmp_path: Path, dead_pid: int) -> None:
    kfd = tmp_path / "kfd"
    kfd.mkdir()
    own_child = subprocess.Popen(["sleep", "30"])
    grandchild_holder = subprocess.Popen(["sh", "-c", "sleep 30 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
    assert grandchild_holder.stdout is not None
    grandchild = int(grandchild_holder.stdout.readline())
    try:
        for pid in (dead_pid, os.getpid(), own_child.pid, grandchild):
            (kfd / str(pid)).mkdir()
        (kfd / "not-a-pid").mkdir()
        probe = KfdProbe(str(kfd))
        assert probe.sample() == ProbeSample()
        monitor = ContentionMonitor(probe, interval=0.1)
        monitor.start()
        time.sleep(0.25)
        report = monitor.stop()
        assert (report.contended, report.foreign_pids, report.busy_samples) == (False, [], 0)
        assert report.samples >= 2
    finally:
        for proc in (own_child, grandchild_holder):
            proc.kill()
            proc.wait()
        os.kill(grandchild, signal.SIGKILL)


def test_wait_idle_times_out_while_a_foreign_user_stays(tmp_path: Path, foreign_sleeper: int) -> None:
    (tmp_path / str(foreign_sleeper)).mkdir()
    start = time.monotonic()
    with pytest.raises(LockBusyError, match=f"pid {foreign_sleeper} \\(sleep"):
        wait_idle(KfdProbe(str(tmp_path)), 0.2, max_wait=0.5)
    assert 0.5 <= time.monotonic() - start < 2


def test_wait_idle_returns_once_the_foreign_user_is_gone(tmp_path: Path) -> None:
    pid = spawn_foreign("sleep 60")
    (tmp_path / str(pid)).mkdir()
    threading.Timer(0.4, os.kill, (pid, signal.SIGKILL)).start()
    waited = wait_idle(KfdProbe(str(tmp_path)), 0.3, max_wait=10)
    assert 0.6 <= waited < 3  # 0.4 s busy, then 0.3 s quiet
    assert wait_idle(KfdProbe(str(tmp_path)), 0) == 0.0


def test_cpu_quiet_gate_sees_a_busy_foreign_process_but_not_ours() -> None:
    spinner = spawn_foreign(f"{sys.executable} -c 'while True: pass'")
    own_spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        probe = CpuQuietProbe(threshold=20.0)
        probe.prime()
        time.sleep(0.5)
        seen = probe.sample()
        assert spinner in seen.foreign, seen.describe()
        assert seen.foreign[spinner].startswith(f"{Path(sys.executable).name} -c while True: pass, ")
        assert seen.foreign[spinner].endswith("% of a core")
        assert own_spinner.pid not in seen.foreign
        assert os.getpid() not in seen.foreign
        with pytest.raises(LockBusyError, match=f"pid {spinner}"):
            wait_idle(probe, 0.3, max_wait=0.8)
    finally:
        os.kill(spinner, signal.SIGKILL)
        own_spinner.kill()
        own_spinner.wait()


def test_a_host_s_ignored_processes_pass_every_gate_by_name(tmp_path: Path) -> None:
    spin = tmp_path / "busyspin"  # the program's own name, as `ps -o comm` shows it
    spin.symlink_to(sys.executable)
    spinner = spawn_foreign(f"{spin} -c 'while True: pass'")
    try:
        settings = LockSettings(cpu_busy_threshold=20.0)
        plain = probe_for("cpu", settings)
        plain.prime()
        time.sleep(0.5)
        assert spinner in plain.sample().foreign
        ignoring = probe_for("cpu", settings.model_copy(update={"ignore_processes": ["busyspin"]}))
        assert isinstance(ignoring, IgnoringProbe)
        ignoring.prime()
        time.sleep(0.5)
        assert spinner not in ignoring.sample().foreign
        knob = gate_knob(ignoring.name, settings.model_copy(update={"ignore_processes": ["busyspin"]}))
        assert "cpu_busy_threshold = 20 (% of one core)" in knob and "(ignored now: busyspin)" in knob
    finally:
        os.kill(spinner, signal.SIGKILL)


SMI_OUTPUT = "{own}, /usr/bin/python3, 812\n4242, /opt/vllm/bin/python, 70321\n99, [Not Found], [N/A]\n"


def fake_nvidia_smi(bin_dir: Path, body: str) -> None:
    """A fake `nvidia-smi` (no NVIDIA driver here): a shell script printing what the real one does."""
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\n# FAKE nvidia-smi for tests\n{body}\n")
    exe.chmod(0o755)


def test_parse_compute_apps() -> None:
    apps = parse_compute_apps(SMI_OUTPUT.format(own=7) + "No running processes found\n\n")
    assert apps == {
        7: "python3, 812 MiB GPU memory",
        4242: "python, 70321 MiB GPU memory",
        99: "[Not Found], [N/A] GPU memory",
    }
    assert parse_compute_apps("") == {}


def test_nvidia_smi_probe_through_a_fake_executable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    output = SMI_OUTPUT.format(own=os.getpid())
    fake_nvidia_smi(tmp_path / "bin", f"printf '%s' '{output}'")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    probe = probe_for("cuda", LockSettings())  # NVML cannot start here, so nvidia-smi is used
    assert isinstance(probe, NvidiaSmiProbe)
    seen = probe.sample()
    assert sorted(seen.foreign) == [99, 4242]  # our own process is not foreign
    assert seen.foreign[4242] == "python, 70321 MiB GPU memory"


def test_nvidia_smi_failure_is_reported(tmp_path: Path) -> None:
    msg = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."
    fake_nvidia_smi(tmp_path, f'echo "{msg}"; exit 9')
    probe = NvidiaSmiProbe(str(tmp_path / "nvidia-smi"))
    with pytest.raises(ProbeUnavailableError, match="exited 9: NVIDIA-SMI has failed"):
        probe.sample()
    monitor = ContentionMonitor(probe, interval=5)
    monitor.start()
    report = monitor.stop()
    assert report.contended and report.samples == 1 and report.foreign_pids == []
    assert "NVIDIA-SMI has failed" in report.detail  # an unchecked window is never called clean


def test_no_nvml_and_no_nvidia_smi_is_said_clearly(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ProbeUnavailableError) as info:
        probe_for("cuda", LockSettings())
    text = str(info.value)
    assert text.startswith("no way to see CUDA GPU users: NVML")
    assert "nvidia-smi is not on PATH" in text


def test_probe_for_each_backend(tmp_path: Path) -> None:
    assert isinstance(probe_for("rocm", LockSettings(kfd_proc=str(tmp_path))), KfdProbe)
    cpu = probe_for("metal", LockSettings(cpu_busy_threshold=33))
    assert isinstance(cpu, CpuQuietProbe) and cpu.threshold == 33
    assert isinstance(probe_for("cpu", LockSettings()), CpuQuietProbe)
    with pytest.raises(ProbeUnavailableError, match=f"KFD process list {tmp_path}/none"):
        probe_for("rocm", LockSettings(kfd_proc=str(tmp_path / "none")))
    with pytest.raises(ValueError, match="unknown backend"):
        probe_for("vulkan", LockSettings())


def test_every_backend_has_one_registered_probe() -> None:
    assert sorted(PROBES) == ["cpu", "cuda", "metal", "rocm"]
    with pytest.raises(ValueError, match="'cuda' has a probe already"):
        backend_probe("cuda")(lambda settings, gpu: CpuQuietProbe())
    assert sorted(PROBES) == ["cpu", "cuda", "metal", "rocm"]  # the refused one left the registry as it was


# The runner's lock section, on a real tiny qmm job. MLX runs on the CPU here; the fingerprint's
# backend is set to `rocm` only so that the runner picks the KFD probe over the test's directory.


def _kfd_job(tmp_path: Path, kfd: Path, **lock: float) -> tuple[JobSpec, HostFingerprint]:
    settings = LockSettings(path=str(tmp_path / "gpu.lock"), kfd_proc=str(kfd), max_attempts=2, **lock)  # type: ignore[arg-type]
    job = JobSpec(
        run_id="r", sweep="t", job_key="k", case="qmm", case_name="qmm", params={"tokens": 1, "n": 32, "k": 64},
        arms=["native", "affine"], device="cpu", repetitions=2, warmup=1, lock=settings,
    )  # fmt: skip
    return job, host_fingerprint().model_copy(update={"backend": "rocm"})


def _start_lock_holder(lock: str) -> subprocess.Popen[str]:
    helper = str(Path(__file__).with_name("lock_helper.py"))
    holder = subprocess.Popen([sys.executable, helper, "hold", lock, "0"], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().startswith("held")
    return holder


def _facts(table: pa.Table) -> set[tuple[object, ...]]:
    cols = ["status", "contended", "lock_attempts", "foreign_pids"]
    return {tuple(tuple(v) if isinstance(v, list) else v for v in (r[c] for c in cols)) for r in table.to_pylist()}


def test_runner_measures_a_contended_job_again_and_flags_its_rows(tmp_path: Path, foreign_sleeper: int) -> None:
    kfd = tmp_path / "kfd"
    kfd.mkdir()
    (kfd / str(foreign_sleeper)).mkdir()
    job, fp = _kfd_job(tmp_path, kfd)
    table = run_job(job, fp)
    assert _facts(table) == {("ok", True, 2, (foreign_sleeper,))}
    assert min(table.column("contention_samples").to_pylist()) >= 1
    assert not lock_status(job.lock.path).busy


def test_runner_clean_job_records_its_lock_wait(tmp_path: Path) -> None:
    kfd = tmp_path / "kfd"
    kfd.mkdir()
    job, fp = _kfd_job(tmp_path, kfd, max_wait=20)
    holder = _start_lock_holder(job.lock.path)
    threading.Timer(0.5, holder.kill).start()
    table = run_job(job, fp)
    holder.wait()
    assert _facts(table) == {("ok", False, 1, ())}
    waits = set(table.column("lock_wait_s").to_pylist())
    assert len(waits) == 1 and 0.4 <= waits.pop() < 5


def test_runner_fails_the_job_when_the_waits_run_out(tmp_path: Path, foreign_sleeper: int) -> None:
    kfd = tmp_path / "kfd"
    kfd.mkdir()
    (kfd / str(foreign_sleeper)).mkdir()
    job, fp = _kfd_job(tmp_path, kfd, max_wait=0.5, idle_secs=0.2)
    table = run_job(job, fp)
    assert set(table.column("status").to_pylist()) == {"failed"}
    assert "gave up waiting for an idle device" in table.column("error")[0].as_py()
    assert footer_status(table) is Status.FAILED and footer_error_kind(table) is ErrorKind.LOCK_BUSY
    holder = _start_lock_holder(job.lock.path)  # now the lock itself stays busy (another process)
    try:
        table = run_job(job.model_copy(update={"lock": job.lock.model_copy(update={"idle_secs": 0.0})}), fp)
    finally:
        holder.kill()
        holder.wait()
    assert set(table.column("status").to_pylist()) == {"failed"}
    assert f"gave up waiting for GPU lock {job.lock.path}" in table.column("error")[0].as_py()
    assert footer_error_kind(table) is ErrorKind.LOCK_BUSY  # what `orchestrate run` exits 3 on


CONTENDING_BENCH = """#!/bin/sh
# The command a job runs. It records the nesting variable it was given; on its first run a foreign
# GPU user appears for 1.5 s (a KFD entry for a process outside our tree), as when someone else
# starts a job on a shared GPU in the middle of ours.
echo "${ROCM_GPU_GUARD_LOCK_HELD:-unset}" >> "$GUARD_LOG"
if [ ! -e "$KFD_MARK" ]; then
  touch "$KFD_MARK"; mkdir "$KFD_DIR/$FOREIGN_PID"; sleep 1.5; rmdir "$KFD_DIR/$FOREIGN_PID"
fi
echo '[engine-bench] {"decode_tok_s": 10.0}'
"""


def test_runner_measures_again_after_a_foreign_user_leaves(
    tmp_path: Path, foreign_sleeper: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = tmp_path / "engine"
    repo.mkdir()
    (repo / "bench.sh").write_text(CONTENDING_BENCH)
    (repo / "bench.sh").chmod(0o755)
    git_env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@e", "GIT_COMMITTER_NAME": "t",
               "GIT_COMMITTER_EMAIL": "t@e"}  # fmt: skip
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "bench"]):
        subprocess.run(["git", *args], cwd=repo, env=git_env, check=True, capture_output=True)
    kfd = tmp_path / "kfd"
    kfd.mkdir()
    guard_log = tmp_path / "guard.log"
    for name, value in {"GUARD_LOG": guard_log, "KFD_MARK": tmp_path / "mark", "KFD_DIR": kfd,
                        "FOREIGN_PID": foreign_sleeper}.items():  # fmt: skip
        monkeypatch.setenv(name, str(value))
    settings = LockSettings(path=str(tmp_path / "gpu.lock"), kfd_proc=str(kfd), max_attempts=3, idle_secs=0.2)
    monkeypatch.setenv("ROCM_GPU_GUARD_LOCK", settings.path)  # our lock is the shell guard's: the command nests in it
    job = JobSpec(
        run_id="r", sweep="t", job_key="k", case="command", case_name="bench", params={"prompt_tokens": 1},
        arms=["a"], device="cpu", repetitions=1, warmup=0, lock=settings,
        options={"repo": str(repo), "ref": "main", "build": "true", "run": "./bench.sh", "parse": "engine-bench",
                 "timeout": 30, "cache_dir": str(tmp_path / "cache")},
    )  # fmt: skip
    table = run_job(job, host_fingerprint().model_copy(update={"backend": "rocm"}))
    assert _facts(table) == {("ok", False, 2, ())}  # attempt 1 was contended, attempt 2 clean and kept
    runs = guard_log.read_text().split()
    assert len(runs) == 2 and set(runs) == {str(os.getpid())}  # the job's command ran nested in our lock


def test_a_caught_process_is_described_on_one_line() -> None:
    """A foreign process's command line may hold newlines (`python -c` with a script): the job's
    line must stay one line, so its description collapses them."""
    script = "import time\ntime.sleep(30)"
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        time.sleep(0.2)  # exec done: the command line is the script's
        described = command_of(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert "\n" not in described and described.endswith("-c import time time.sleep(30)"), described
