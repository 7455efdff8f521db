#!/usr/bin/env bash
# Several GPUs of one host (two, four or eight NVIDIA GPUs), through the real CLI
# with embedded Ray: the nvfp4-prefill qmm case (4096 tokens, its six arms) and the moe-gather
# case (its six arms) as sweeps of identical jobs, first on GPU 0 alone (an inventory with
# `gpus = [0]`), then on every GPU (`gpus = "all"`); then a sweep of N + 1 qmm jobs during which
# one job's Ray worker process and another GPU's whole Ray node are killed. The summary says the
# throughput ratio (all GPUs / one GPU) against 0.9 x N, each arm's medians per GPU with their
# intervals and ratios to GPU 0's, and where the lost jobs finished (benchmarks/multigpu.py).
#
#   bash benchmarks/device_multigpu.sh OUT [SECONDS]
#
# Installing on the host: docs/gpu-hosts.md. Resumable like device_e2e.sh: each call runs until its
# time budget (SECONDS, default 540) is spent and the next call resumes; each finished step leaves a
# marker under /tmp/orchestrate-mg. Call it again until it prints "all steps complete".
#
# Writes under OUT: multigpu.log (every command and its output), summary.txt, and results.tar.xz.
# PER_GPU (default 2) jobs per GPU on all GPUs, ONE_GPU (default 2) jobs on GPU 0 alone.
# MG_CPU_DRY_RUN=1 (a machine without GPUs; GPUS fake ones, default 2, through the test-only
# ORCHESTRATE_TEST_FAKE_GPUS): tiny CPU shapes, to try the script's logic; its numbers are CPU ones.
set -u
out=${1:?usage: device_multigpu.sh OUT_DIR [SECONDS]}
budget=${2:-540}
state=${MG_STATE:-/tmp/orchestrate-mg}
mkdir -p "$out" "$state"
export ORCHESTRATE_RESULTS=$state/results ORCHESTRATE_SPOOL=$state/spool PYTHONUNBUFFERED=1
# No collective runs here, but keep NVLink multicast off for anything that starts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
log=$out/multigpu.log
deadline=$((SECONDS + budget))
note() { echo "== $*" | tee -a "$log"; }

tiny=()
if [[ ${MG_CPU_DRY_RUN:-0} == 1 ]]; then
  n=${GPUS:-2}
  export ORCHESTRATE_TEST_FAKE_GPUS=$n
  tiny=(--tiny)
  note "CPU DRY RUN: $n fake GPUs, tiny shapes: no number here is a GPU's"
else
  n=${GPUS:-$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)}
fi
if ((n < 2)); then
  note "this host has $n GPUs; the benchmark needs 2 or more"
  exit 2
fi
note "$(date -u +%FT%TZ) $n GPUs: $(nvidia-smi --query-gpu=index,name,uuid,driver_version --format=csv,noheader 2>/dev/null | tr '\n' ';')"
python3 -m benchmarks.multigpu sweeps "$state/sweeps" --gpus "$n" --per-gpu "${PER_GPU:-2}" --one-gpu "${ONE_GPU:-2}" \
  "${tiny[@]}" >>"$log"
for which in 1 N; do
  gpus='"all"'
  [[ $which == 1 ]] && gpus='[0]'
  printf '[[hosts]]\nname = "local"\ndevice = "auto"\nbackend = "auto"\nlock = "%s"\ngpus = %s\n' \
    "$state/gpu.lock" "$gpus" >"$state/inv-$which.toml"
done

complete=1
step() {  # step NAME INVENTORY: one `orchestrate run`, skipped once done
  local sweep=$1 inv=$2 left rc
  [[ -e $state/done-$sweep ]] && return 0
  left=$((deadline - SECONDS - 30))
  if ((left < 60)); then
    note "no time left for $sweep in this call: run the script again"
    complete=0
    return 1
  fi
  note "orchestrate run --inventory $inv --sweep $sweep (budget ${left}s)"
  timeout -s TERM -k 30 "$left" orchestrate run --inventory "$state/inv-$inv.toml" \
    --sweep "$state/sweeps/$sweep.toml" >"$state/run.out" 2>&1 &
  local pid=$!
  if [[ $sweep == mg-loss && ! -e $state/killed.json ]]; then
    # the extra GPU nodes descend from `timeout`'s `orchestrate run`
    python3 -m benchmarks.multigpu lose "$state/gpu.lock" "$pid" >"$state/killed.json" 2>>"$log" ||
      note "lose failed: $(tail -1 "$log")"
    note "killed: $(cat "$state/killed.json")"
  fi
  wait "$pid"
  rc=$?
  cat "$state/run.out" >>"$log"
  grep -E '^\[|^Run |^sweep |^interrupted|not complete|Nothing to do' "$state/run.out" | cut -c1-200
  note "exit $rc"
  if ((rc == 0)); then
    touch "$state/done-$sweep"
    return 0
  fi
  complete=0
  ((rc == 143 || rc == 124)) && return 1  # stopped by the budget: resumes in the next call
  return 0                                # a failure or contention: recorded; the next call runs it again
}

step mg1-qmm 1 && step mgN-qmm N && step mg1-moe 1 && step mgN-moe N && step mg-loss N

python3 -m benchmarks.multigpu summary "$state/results" --gpus "$n" --killed "$state/killed.json" \
  >"$out/summary.txt" 2>>"$log"
cat "$out/summary.txt"
tar -C "$state" -cJf "$out/results.tar.xz" results 2>>"$log"
note "packed $(find "$state/results" -name 'part-*.parquet' | wc -l) fragments ($(du -h "$out/results.tar.xz" | cut -f1))"
((complete)) && note "all steps complete" || note "not complete: run the script again while the machine is up"
