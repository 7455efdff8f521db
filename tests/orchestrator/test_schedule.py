"""Nightly schedules against a crontab file and unit dir under the test's temp dir (never the machine's)."""

from __future__ import annotations

import datetime as dt
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from orchestrator.errors import InputError
from orchestrator.run.nightly import ScheduleBusyError, overlap_guard, run_now
from orchestrator.run.schedules import (
    Crontab,
    Schedule,
    SystemdTimers,
    add_schedule,
    cron_expression,
    list_schedules,
    on_calendar,
    remove_schedule,
)
from orchestrator.store.dataset import read_rows
from orchestrator.store.fragments import ResultStore
from tests.orchestrator.bench_repo import bench_script, git

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cfg = tmp_path / "config"
    monkeypatch.setenv("ORCHESTRATE_CONFIG_DIR", str(cfg))
    return cfg


def sched(name: str, at: str = "02:00", **kw: object) -> Schedule:
    return Schedule(name=name, sweep="/sweeps/s.toml", inventory=None, results="/r", at=at, cron=cron_expression(at),
                    **kw)  # type: ignore[arg-type]  # fmt: skip


def test_times_and_cron_expressions() -> None:
    assert cron_expression("02:00") == "0 2 * * *"
    assert cron_expression("23:59") == "59 23 * * *"
    assert cron_expression("30 2 * * 1-5") == "30 2 * * 1-5"
    assert cron_expression("*/15 * * * *") == "*/15 * * * *"
    for bad in ("24:00", "2am", "* * *", "1 2 3 4 5 6", "0 2 * * mon;rm"):
        with pytest.raises(InputError, match="--at"):
            cron_expression(bad)
    assert on_calendar("0 2 * * *") == "*-*-* 2:0:00"
    assert on_calendar("30 2 * * 1-5") == "Mon..Fri *-*-* 2:30:00"
    assert on_calendar("*/15 * 1,15 * 0") == "Sun *-*-1,15 *:0/15:00"


def test_add_list_remove_in_a_crontab_file(tmp_path: Path, config: Path) -> None:
    cronfile = tmp_path / "crontab"
    cronfile.write_text("MAILTO=me@example.com\n15 3 * * * /usr/bin/backup  # someone else's line\n")
    cron = Crontab(cronfile)
    line = add_schedule(sched("nightly"), cron)
    add_schedule(sched("weekly", "0 4 * * 0"), cron)
    lines = cronfile.read_text().splitlines()
    assert lines[:2] == ["MAILTO=me@example.com", "15 3 * * * /usr/bin/backup  # someone else's line"]
    assert lines[2] == line
    assert line.startswith("0 2 * * * ORCHESTRATE_CONFIG_DIR=")
    assert f"{sys.executable} -m orchestrator.cli schedule run-now nightly >> {config}/logs/nightly.log 2>&1" in line
    assert line.endswith("# orchestrate:nightly")
    assert lines[3].startswith("0 4 * * 0 ") and lines[3].endswith("# orchestrate:weekly")
    assert set(cron.installed()) == {"nightly", "weekly"}
    assert [s.name for s in list_schedules()] == ["nightly", "weekly"]
    add_schedule(sched("nightly", "01:30"), cron)  # re-adding replaces, never duplicates
    assert sum("orchestrate:nightly" in x for x in cronfile.read_text().splitlines()) == 1
    assert "30 1 * * *" in cron.installed()["nightly"]
    remove_schedule("nightly", cron)
    assert set(cron.installed()) == {"weekly"}
    assert [s.name for s in list_schedules()] == ["weekly"]
    assert cronfile.read_text().startswith("MAILTO=me@example.com\n15 3 * * * /usr/bin/backup")
    with pytest.raises(InputError, match="no schedule named 'nightly'"):
        remove_schedule("nightly", cron)
    with pytest.raises(InputError, match="schedule name"):
        add_schedule(sched("bad name"), cron)


def test_crontab_command_through_a_fake_crontab_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    store = tmp_path / "fake-crontab-store"
    fake = bindir / "crontab"  # FAKE crontab(1): `-l` prints and `-` replaces a temp file
    fake.write_text(
        "#!/bin/sh\n# fake crontab for tests: edits $FAKE_CRONTAB_STORE, never a real crontab\n"
        'if [ "$1" = "-l" ]; then [ -f "$FAKE_CRONTAB_STORE" ] || { echo "no crontab for test" >&2; exit 1; }\n'
        '  cat "$FAKE_CRONTAB_STORE"; elif [ "$1" = "-" ]; then cat > "$FAKE_CRONTAB_STORE"; else exit 2; fi\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_CRONTAB_STORE", str(store))
    cron = Crontab()
    assert cron.installed() == {}
    add_schedule(sched("nightly"), cron)
    assert store.read_text().count("# orchestrate:nightly") == 1
    remove_schedule("nightly", cron)
    assert store.read_text() == ""


def test_systemd_user_timer_units(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = tmp_path / "systemctl.calls"
    fake = tmp_path / "fake-systemctl"  # FAKE systemctl: records its arguments (no systemd here)
    fake.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    fake.chmod(0o755)
    units = tmp_path / "units"
    timers = SystemdTimers(units, systemctl=str(fake))
    add_schedule(sched("nightly", "30 2 * * 1-5"), timers)
    timer = (units / "orchestrate-nightly.timer").read_text()
    service = (units / "orchestrate-nightly.service").read_text()
    assert "OnCalendar=Mon..Fri *-*-* 2:30:00\nPersistent=true" in timer
    assert "Type=oneshot" in service and "schedule run-now nightly" in service
    assert calls.read_text().splitlines() == ["--user daemon-reload", "--user enable --now orchestrate-nightly.timer"]
    assert timers.installed() == {"nightly": str(units / "orchestrate-nightly.timer")}
    remove_schedule("nightly", timers)
    assert not list(units.iterdir())
    assert calls.read_text().splitlines()[2:] == ["--user disable --now orchestrate-nightly.timer",
                                                  "--user daemon-reload"]  # fmt: skip


def test_second_start_while_one_runs_exits_at_once(tmp_path: Path, config: Path) -> None:
    add_schedule(sched("nightly"), Crontab(tmp_path / "crontab"))
    with overlap_guard("nightly"):
        t0 = time.monotonic()
        with pytest.raises(
            ScheduleBusyError, match=rf"schedule 'nightly' is already running \(pid {os.getpid()} since"
        ):
            run_now("nightly")
        assert time.monotonic() - t0 < 2
        # and through the CLI, as cron would start it: exit 75 with one line on stderr
        env = {**os.environ, "ORCHESTRATE_CONFIG_DIR": str(config)}
        proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", "schedule", "run-now", "nightly"],
                              capture_output=True, text=True, env=env, cwd=REPO, timeout=120)  # fmt: skip
        assert proc.returncode == 75, proc.stderr
        assert "is already running" in proc.stderr and "this start exits" in proc.stderr
    with overlap_guard("nightly"):  # released when the holder is done
        pass


@pytest.mark.parametrize("name", ["nightly\n", "night ly", "../nightly", "a/b", ".hidden", "\tnightly"])
def test_a_name_that_is_not_a_name_is_refused_before_anything_is_written(
    name: str, tmp_path: Path, config: Path, orchestrate_bin: str
) -> None:
    cronfile = tmp_path / "crontab"
    cronfile.write_text("15 3 * * * /usr/bin/backup\n")
    env = {**os.environ, "ORCHESTRATE_CONFIG_DIR": str(config)}
    proc = subprocess.run(
        [orchestrate_bin, "schedule", "add", name, "--sweep", "smoke", "--crontab-file", str(cronfile)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == f"orchestrate: error: schedule name {name!r} must be letters, digits, '.', '_' or " \
        "'-' (starting with a letter or digit)"  # fmt: skip
    assert cronfile.read_text() == "15 3 * * * /usr/bin/backup\n"  # the crontab line was never split or written
    assert not config.exists()
    with pytest.raises(InputError, match="schedule name"):
        add_schedule(sched(name), Crontab(cronfile))


@pytest.mark.parametrize("name", ["../../victim", "../schedules/x", "{tmp}/victim"])
def test_remove_never_touches_a_file_outside_the_schedules(
    name: str, tmp_path: Path, config: Path, orchestrate_bin: str
) -> None:
    name = name.format(tmp=tmp_path)
    (config / "schedules").mkdir(parents=True)
    victim = (config / "schedules" / f"{name}.json").resolve()  # where the record of that "name" would be
    victim.parent.mkdir(parents=True, exist_ok=True)
    victim.write_text("precious")
    try:
        proc = subprocess.run(
            [orchestrate_bin, "schedule", "remove", name, "--crontab-file", str(tmp_path / "crontab")],
            capture_output=True, text=True, env={**os.environ, "ORCHESTRATE_CONFIG_DIR": str(config)}, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert f"schedule name {name!r} must be" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
        assert victim.read_text() == "precious"
        with pytest.raises(InputError, match="schedule name"):
            remove_schedule(name, Crontab(tmp_path / "crontab"))
        assert victim.read_text() == "precious"
    finally:
        victim.unlink()


BENCH = bench_script(0.01)
OLD_NIGHTS = dt.datetime.now(dt.UTC).date() - dt.timedelta(days=5)


def earlier_nights(results: Path, sweep: str, nights: int) -> None:
    """Copies of the one stored night as `nights` more stable nights, each a run of its own a
    second later, +-0.4 %: the history the detector needs (it judges a series from its 8th night)
    without running the sweep that many more times. They are stored five days back (their rows
    keep their times), so the next scheduled run compacts that partition."""
    store = ResultStore(results)
    table = read_rows(store, sweep=sweep)
    (run_id,) = set(table["run_id"].to_pylist())
    for i in range(1, nights + 1):
        copy = table
        for name, values in (
            ("run_id", pa.array([f"{run_id}-{i:02d}"] * table.num_rows)),
            ("started_at", pc.add(table["started_at"], pa.scalar(dt.timedelta(seconds=i)))),
            ("value", pc.multiply(table["value"], 1 + 0.004 * (-1) ** i)),
        ):
            copy = copy.set_column(copy.schema.get_field_index(name), copy.schema.field(name), values)
        store.write(copy, sweep=sweep, date=OLD_NIGHTS, device="cpu", run_id=f"{run_id}-{i:02d}", job_key=f"h{i}")


@pytest.mark.slow
def test_scheduled_runs_over_commits_flag_the_slow_commit(tmp_path: Path, config: Path) -> None:
    """The whole path as cron runs it: `schedule add`, then `run-now` each night on real Ray."""
    repo = tmp_path / "engine"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    (repo / "bench.sh").write_text(BENCH)
    (repo / "bench.sh").chmod(0o755)
    sweep = tmp_path / "nightly.toml"
    sweep.write_text(
        'name = "nightly-engine"\nrepetitions = 3\nwarmup = 0\n\n[[cases]]\ncase = "command"\nname = "engine"\n'
        'repo = "engine"\nref = "main"\nrun = "./bench.sh"\nparse = "engine-bench"\ntimeout = 60\n'
        'arms = ["native"]\nparams = { prompt_tokens = 512 }\n'
    )
    inventory = tmp_path / "local.toml"
    inventory.write_text(f'[[hosts]]\nname = "local"\ndevice = "cpu"\nbackend = "cpu"\nlock = "{tmp_path}/gpu.lock"\n')
    cronfile, results, png = tmp_path / "crontab", tmp_path / "results", tmp_path / "trend.png"
    env = {**os.environ, "ORCHESTRATE_CONFIG_DIR": str(config), "COUNTER": str(tmp_path / "counter")}
    # Embedded Ray writes its token under HOME (a temp dir here); a RAY_AUTH_TOKEN_PATH naming a file
    # that does not exist yet makes ray.init refuse to start.
    env.pop("RAY_AUTH_TOKEN_PATH", None)

    def cli(*args: str, cwd: Path = tmp_path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], capture_output=True, text=True,
                              env=env, cwd=cwd, timeout=300)  # fmt: skip

    add = cli("schedule", "add", "nightly", "--sweep", str(sweep), "--inventory", str(inventory), "--at", "02:00",
              "--results", str(results), "--crontab-file", str(cronfile))  # fmt: skip
    assert add.returncode == 0, add.stderr
    listed = cli("schedule", "list", "--crontab-file", str(cronfile))
    assert any(line.split()[1:8] == ["nightly", "│", "0", "2", "*", "*", "*"] for line in listed.stdout.splitlines())
    assert "installed" in listed.stdout and "NOT installed" not in listed.stdout
    codes, commits, outputs = [], [], []
    for night, speed in enumerate([100.0, 100.0, 80.0]):
        (repo / "speed.txt").write_text(f"{speed}\n")
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "--allow-empty", "-m", f"night {night}")
        commits.append(git(repo, "rev-parse", "HEAD"))
        for _attempt in range(6):  # exit 4: only contended samples (this machine is shared); run again
            proc = cli("schedule", "run-now", "nightly", cwd=Path(os.environ["HOME"]))  # as cron: not in workdir
            if proc.returncode != 4:
                break
            assert "NOT JUDGED" in proc.stdout
        else:
            pytest.skip("the host never got quiet: every run was contended by foreign CPU users (exit 4, not judged)")
        codes.append(proc.returncode)
        outputs.append(proc.stdout)
        assert proc.returncode in (0, 1), proc.stderr
        if night == 0:
            earlier_nights(results, "nightly-engine", 6)
    assert codes == [0, 0, 1], "\n=====\n".join(outputs)
    # the copied nights' partition was compacted after the second night's run (atomically, once)
    assert "compacted 1 partitions of sweep nightly-engine dated 2 or more days ago (6 fragments" in outputs[1]
    old = results / "sweep=nightly-engine" / f"date={OLD_NIGHTS.isoformat()}" / "device=cpu"
    assert [p.name.split("-")[0] for p in old.iterdir()] == ["compact"] and "compacted" not in outputs[2]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("| regression |"))
    assert "| engine | native | prompt_tokens=512 | decode_tok_s |" in line and commits[2][:12] in line
    reports = sorted((config / "reports" / "nightly").glob("*.md"))
    judged = [r.read_text() for r in reports if "Not judged" not in r.read_text()]
    assert len(judged) == 3 and "regression" not in judged[1].split("\n")[2]
    hist = cli("history", "engine", "--results", str(results), "--png", str(png))
    assert hist.returncode == 0, hist.stderr
    flagged = re.search(rf"regression {commits[2][:10]} x([\d.]+)", hist.stdout)
    assert flagged is not None and float(flagged.group(1)) == pytest.approx(0.8, abs=0.03), hist.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    removed = cli("schedule", "remove", "nightly", "--crontab-file", str(cronfile))
    assert removed.returncode == 0 and "orchestrate:nightly" not in cronfile.read_text()
