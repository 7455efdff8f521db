"""A run is judged by the sweep it ran: the definition stored with its rows, the line that says when
the file of that name differs, the fallback for runs stored without one, and compaction keeping it."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from orchestrator.analysis.selection import choose_sweep, select_results
from orchestrator.specs.definition import definition_footer, differences, digest, stored_spec
from orchestrator.specs.sweep import builtin_sweeps, load_sweep
from orchestrator.store.compact import compact
from orchestrator.store.definitions import newest_run, run_definition
from orchestrator.store.fragments import ResultStore
from orchestrator.store.incoming import import_fragment
from tests.conftest import child_env, until_clean
from tests.orchestrator.synthetic_rows import job_table
from workers.contract import META_JOB_KEY

TINY = 'params = { experts = 8, top_k = 2, tokens = 32, hidden = 256, expert_width = 128, dtype = "float32" }'


def edited_copy(tmp_path: Path) -> Path:
    """The built-in moe-gather copied and edited as a user would: devices, shapes, repetitions."""
    text = builtin_sweeps()["moe-gather"].read_text()
    text = text.replace("devices = []", 'devices = ["cpu"]').replace("repetitions = 10", "repetitions = 5")
    text = text.replace("warmup = 3", "warmup = 1")
    lines = [TINY if line.startswith("params = { experts = 128") else line for line in text.splitlines()]
    copy = tmp_path / "mine" / "moe-gather.toml"
    copy.parent.mkdir()
    copy.write_text("\n".join(lines) + "\n")
    return copy


def orchestrate(bin_: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [bin_, *args], capture_output=True, text=True, env=child_env(COLUMNS="200"), cwd=cwd, timeout=600
    )


def test_check_by_name_judges_a_copy_by_what_it_ran(tmp_path: Path, orchestrate_bin: str) -> None:
    copy, results, work = edited_copy(tmp_path), tmp_path / "store", tmp_path / "elsewhere"
    work.mkdir()
    ran, _ = until_clean(
        lambda: orchestrate(orchestrate_bin, "run", "--sweep", str(copy), "-r", str(results), cwd=work)
    )
    assert ran.returncode in (0, 1, 4), ran.stdout + ran.stderr

    store = ResultStore(results)
    run_id = newest_run(store, "moe-gather")
    stored = run_definition(store, "moe-gather", run_id or "")
    assert stored is not None and stored.source == str(copy.resolve())
    assert stored.digest == digest(load_sweep(str(copy))) != digest(load_sweep("moe-gather"))

    # By name: the stored copy decides (its tiny point is judged, not the built-in's E=128 one).
    by_name = orchestrate(orchestrate_bin, "check", "--sweep", "moe-gather", "-r", str(results), "-f", "json", cwd=work)
    assert by_name.returncode in (0, 1, 4), by_name.stderr
    verdicts = json.loads(by_name.stdout)
    assert {v["point_outcome"] for v in verdicts} <= {"PASS", "FAIL", "AMBIGUOUS"}
    assert {json.loads(v["params"])["experts"] for v in verdicts} == {8}
    assert {v["device"] for v in verdicts} == {"cpu"}
    note = [line for line in by_name.stderr.splitlines() if "judged by" in line]
    assert len(note) == 1 and f"stored with run {run_id} (digest {stored.digest}" in note[0]
    assert "differs from the built-in moe-gather (cases[moe-gather].params, devices, repetitions, warmup)" in note[0]

    # The copy's own path: the file decides and agrees with the run, so nothing is said.
    by_path = orchestrate(orchestrate_bin, "check", "--sweep", str(copy), "-r", str(results), "-f", "json", cwd=work)
    assert by_path.returncode == by_name.returncode and "judged by" not in by_path.stderr
    assert json.loads(by_path.stdout) == verdicts

    # The built-in's path: the file decides as given, and the line says the run ran another sweep.
    builtin = str(builtin_sweeps()["moe-gather"])
    by_file = orchestrate(orchestrate_bin, "check", "--sweep", builtin, "-r", str(results), "-f", "json", cwd=work)
    assert by_file.returncode == 4 and {v["point_outcome"] for v in json.loads(by_file.stdout)} == {"MISSING"}
    assert f"judged by {builtin} as given, not by the sweep stored with run {run_id}" in by_file.stderr

    # compare and report by name take the same definition and say so once.
    compared = orchestrate(
        orchestrate_bin, "compare", "--sweep", "moe-gather", "-r", str(results), "-f", "json", cwd=work
    )
    assert compared.returncode == 0 and compared.stderr.count("judged by the sweep stored with run") == 1


def synthetic_store(root: Path, *, with_definition: bool) -> ResultStore:
    """One stored job of the built-in moe-gather's point, with or without the definition in its footer."""
    spec = load_sweep("moe-gather")
    case = spec.cases[0]
    table = job_table(
        {arm: {"prefill_tok_s": [100.0 + i for i in range(5)]} for arm in case.arm_names()},
        params={k: v for k, v in case.params.items() if not isinstance(v, list)},
        case="moe-gather",
        sweep="moe-gather",
        run_id="20260101T000000Z-0001",
    )
    meta = {**(table.schema.metadata or {}), META_JOB_KEY: b"k1"}  # a safe name, as `import` wants
    if with_definition:
        meta.update(definition_footer(spec, str(builtin_sweeps()["moe-gather"])))
    keys = pa.array(["k1"] * table.num_rows, pa.string())
    table = table.set_column(table.schema.get_field_index("job_key"), "job_key", keys).replace_schema_metadata(meta)
    store = ResultStore(root)
    store.write(
        table, sweep="moe-gather", date=dt.date(2026, 1, 1), device="cpu", run_id="20260101T000000Z-0001", job_key="k1"
    )
    return store


def test_a_run_stored_without_a_definition_is_judged_by_the_file(tmp_path: Path) -> None:
    store = synthetic_store(tmp_path / "store", with_definition=False)
    assert run_definition(store, "moe-gather", "20260101T000000Z-0001") is None
    choice = choose_sweep(store, "moe-gather")
    assert choice.spec == load_sweep("moe-gather") and choice.note == ""


def test_compaction_and_import_keep_the_definition(tmp_path: Path) -> None:
    store = synthetic_store(tmp_path / "store", with_definition=True)
    before = run_definition(store, "moe-gather", "20260101T000000Z-0001")
    assert before is not None and before.source == "built-in moe-gather"
    elsewhere = ResultStore(tmp_path / "other")
    import_fragment(elsewhere, next(f.path for f in store.files("moe-gather")))
    assert run_definition(elsewhere, "moe-gather", "20260101T000000Z-0001") == before
    report = compact(store)
    assert report.partitions == 1 and all(f.compacted for f in store.files("moe-gather"))
    after = run_definition(store, "moe-gather", "20260101T000000Z-0001")
    assert after == before
    spec = stored_spec(after.text)
    assert spec == load_sweep("moe-gather") and choose_sweep(store, "moe-gather").note == ""


def test_differences_name_the_edited_fields_once() -> None:
    builtin = load_sweep("mlxcel-prefill")
    data = builtin.model_dump(mode="json")
    data["devices"] = ["my-gpu"]
    data["command"]["repo"] = "/src/mlxcel"
    for case in data["cases"]:
        case["repo"] = "/src/mlxcel"  # what merging the edited [command] gives
    copy = type(builtin).model_validate(data)
    assert differences(copy, builtin) == ["command.repo", "devices"]
    assert digest(copy) != digest(builtin) and differences(builtin, builtin) == []


def test_an_unreadable_stored_definition_falls_back_to_the_file(tmp_path: Path) -> None:
    store = synthetic_store(tmp_path / "store", with_definition=True)
    leaf = store.partition_dir(sweep="moe-gather", date="2026-01-01", device="cpu")
    frag = next(leaf.glob("*.parquet"))
    table = pq.read_table(frag)
    meta = dict(table.schema.metadata or {})
    meta[b"orchestrate.sweep_definition"] = b'{"name": "moe-gather", "unknown_field": 1}'
    pq.write_table(pa.Table.from_batches(table.to_batches(), table.schema.with_metadata(meta)), frag)
    choice = choose_sweep(store, "moe-gather")
    assert choice.spec == load_sweep("moe-gather")
    assert "not readable by this orchestrate; judged by the built-in moe-gather" in choice.note


def test_the_copy_and_the_built_in_never_share_a_table(tmp_path: Path) -> None:
    """The built-in moe-gather ran on one device kind, then a user's copy of it on another: by name,
    the judged run's definition decides which rows a command shows, and `--run` picks the other."""
    builtin = load_sweep("moe-gather")
    copy = builtin.model_copy(update={"devices": ["cpu"]})
    store = ResultStore(tmp_path / "store")
    for n, (spec, device, source) in enumerate([(builtin, "m1-ultra", "built-in"), (copy, "cpu", "/a/copy.toml")]):
        run_id, key = f"20260101T00000{n}Z-000{n}", f"k{n}"
        case = spec.cases[0]
        table = job_table(
            {arm: {"prefill_tok_s": [100.0 + i for i in range(5)]} for arm in case.arm_names()},
            params={k: v for k, v in case.params.items() if not isinstance(v, list)},
            case="moe-gather",
            sweep="moe-gather",
            run_id=run_id,
        )
        meta = {**(table.schema.metadata or {}), META_JOB_KEY: key.encode(), **definition_footer(spec, source)}
        keys = pa.array([key] * table.num_rows, pa.string())
        table = table.set_column(table.schema.get_field_index("job_key"), "job_key", keys)
        devices = pa.array([device] * table.num_rows, pa.string())
        table = table.set_column(table.schema.get_field_index("device"), "device", devices)
        store.write(
            table.replace_schema_metadata(meta),
            sweep="moe-gather",
            date=dt.date(2026, 1, 1),
            device=device,
            run_id=run_id,
            job_key=key,
        )
    newest, _ = select_results(store, "moe-gather", None)
    assert set(newest["device"].to_pylist()) == {"cpu"}
    older, spec = select_results(store, "moe-gather", "20260101T000000Z-0000")
    assert set(older["device"].to_pylist()) == {"m1-ultra"} and spec == builtin
