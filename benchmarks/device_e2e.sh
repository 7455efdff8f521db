#!/usr/bin/env bash
# The product end to end on one GPU host, the way the README runs it: the real CLI with the
# embedded default (no inventory: `device = "auto"`), for the built-in sweeps smoke, moe-gather and
# nvfp4-prefill (every case and point), then compare, check, phases and the HTML report, and the
# results packed for `orchestrate import` on another machine. Installing on a host with no package
# index (a wheelhouse): docs/gpu-hosts.md.
#
#   bash benchmarks/device_e2e.sh OUT [SECONDS]
#
# SECONDS (default 540) bounds one call, for hosts that limit how long a command may run: the
# script stops `orchestrate run` with SIGTERM in time (it stores what finished and says
# "interrupted: ...; rerun to resume"), and the next call resumes where it stopped (the results and
# spool live under /tmp/orchestrate-e2e on the host). Call it again until it prints "all sweeps
# complete".
#
# Writes under OUT: e2e.log (every command and its output), summary-<sweep>.txt (compare, check,
# phases), report-<sweep>.html, and results.tar.xz (the Parquet fragments: unpack and
# `orchestrate import` them, or point --results at the unpacked tree). SWEEPS overrides the list.
# With BEFORE=DIR (a results tree from an earlier run, e.g. docs/h200-results), the first call
# copies DIR's sweeps into the store, and each summary also compares the commits side by side
# (`compare --by commit`, the earlier code the baseline): a change's effect on the medians, in one
# store.
set -u
out=${1:?usage: device_e2e.sh OUT_DIR [SECONDS]}
budget=${2:-540}
state=/tmp/orchestrate-e2e
mkdir -p "$out" "$state"
export ORCHESTRATE_RESULTS=$state/results ORCHESTRATE_SPOOL=$state/spool PYTHONUNBUFFERED=1
log=$out/e2e.log
deadline=$((SECONDS + budget))
note() { echo "== $*" | tee -a "$log"; }

if [[ -n "${BEFORE:-}" && ! -e $state/before-copied ]]; then
  mkdir -p "$state/results"
  cp -r "$BEFORE"/sweep=* "$state/results/" && touch "$state/before-copied"
  note "copied the earlier results of $BEFORE: $(find "$state/results" -name '*.parquet' | wc -l) Parquet files"
fi
note "$(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
note "python3 -m workers device: $(python3 -m workers device 2>&1 | tail -1)"
complete=1
for sweep in ${SWEEPS:-smoke moe-gather nvfp4-prefill}; do
  left=$((deadline - SECONDS - 45))  # keep time for the reports and the pack
  if ((left < 60)); then
    note "no time left for $sweep in this call: run the script again"
    complete=0
    break
  fi
  note "orchestrate run --sweep $sweep (budget ${left}s)"
  timeout -s TERM -k 30 "$left" orchestrate run --sweep "$sweep" >"$state/run.out" 2>&1
  rc=$?
  cat "$state/run.out" >>"$log"
  grep -E '^\[|^Run |^sweep |^slowest|^interrupted|not complete|Nothing to do|^[A-Z]+ +' "$state/run.out" | cut -c1-200
  note "exit $rc"
  if ((rc == 143 || rc == 124)); then  # stopped by the budget: resumes in the next call
    complete=0
    break
  fi
  if ((rc == 5)); then  # contended points: measured again by the next call
    complete=0
  fi
done

for sweep in ${SWEEPS:-smoke moe-gather nvfp4-prefill}; do  # one summary file per sweep
  {
    echo "== orchestrate compare --sweep $sweep"
    orchestrate compare --sweep "$sweep" 2>&1
    echo "== orchestrate check --sweep $sweep"
    orchestrate check --sweep "$sweep" 2>&1
    echo "exit $?"
    echo "== orchestrate phases --sweep $sweep"
    COLUMNS=320 orchestrate phases --sweep "$sweep" 2>&1  # one column per phase: wide
    if [[ -e $state/before-copied ]]; then
      echo "== orchestrate compare --sweep $sweep --by commit (the earlier code is the baseline)"
      COLUMNS=240 orchestrate compare --sweep "$sweep" --by commit 2>&1
    fi
  } >"$out/summary-$sweep.txt"
done
for sweep in ${SWEEPS:-smoke moe-gather nvfp4-prefill}; do  # the report takes one sweep
  orchestrate report --sweep "$sweep" --html "$out/report-$sweep.html" >>"$log" 2>&1 \
    || note "report of $sweep failed: $(tail -1 "$log")"
done
tar -C "$state" -cJf "$out/results.tar.xz" results 2>>"$log"
note "packed $(find "$state/results" -name '*.parquet' | wc -l) Parquet files ($(du -h "$out/results.tar.xz" | cut -f1))"
((complete)) && note "all sweeps complete" || note "not complete: run the script again while the machine is up"
