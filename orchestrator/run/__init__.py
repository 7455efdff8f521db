"""Running a sweep: expand it into jobs, skip the stored ones, run the rest on Ray, store each
job's rows as it finishes and account for where the time went; also the nightly schedule. Start
with `sweep.py` (`run_sweep`, the library function behind `orchestrate run`), then `plan.py`
(a sweep as jobs) and `executor.py` (the jobs on Ray)."""
