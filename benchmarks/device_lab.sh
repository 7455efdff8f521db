#!/usr/bin/env bash
# The kernel and method measurements on one NVIDIA GPU host, in one call (installing there:
# docs/gpu-hosts.md):
#
#   bash benchmarks/device_lab.sh OUT [OLD_TREE]
#
# 1. benchmarks.gemm_lab: the NVFP4 prefill GEMM's variants checked and timed beside dense, native,
#    affine and dequant-gemm at M = 512..16384; its last line is the variant rule to
#    export as ORCHESTRATE_GEMM_VARIANT.
# 2. benchmarks.before_after: the same seed-shape qmm and moe-gather jobs by an older worker
#    (OLD_TREE: its `workers/` and `kernels/`, e.g. `git archive <commit> workers kernels`) and by
#    this one, in this one call: ROUNDS rounds per job (default 2) in ABBA order (round r: old then
#    new when r is even, new then old when r is odd), each worker process into its own file
#    ($jobs/old-JOB-r.parquet, $jobs/new-JOB-r.parquet); the medians' table of all of them, each
#    side's files pooled and its intervals from a bootstrap of processes, then samples.
# Writes OUT/gemm_lab/ (gemm_lab.txt, gemm_lab.json, wgmma_rs/, wgmma/, wgmma_ws/) and OUT/before_after.md.
# GEMM_LAB=0 skips step 1 (the before/after alone: about 90 s a round where the MLX JIT cache is filled).
# ONLY=name,name and MS=512,...,16384 narrow step 1 to those variants and rows (the lab's --only, --m);
# LAB_ROUNDS=R times every path of an M R times, every other round in the reverse order (--rounds);
# TWIN=1 first runs benchmarks.gemm_twin_check (every r variant against its twin at tails, NaN-poisoned;
# OUT/gemm_twin_check.txt);
# NCU=name,name then profiles each of those variants' kernel once under Nsight Compute at M = 4096
# (OUT/gemm_lab_ncu/ncu_NAME_m4096.txt; where the machine's ncu reads no counters it says so there).
# PROFILE=1,512 (token counts) profiles the built-in nvfp4-prefill sweep's qmm jobs at those counts,
# each twice in a fresh `python -m workers run` under cProfile, and a fresh process's device start
# (benchmarks.job_profile; OUT/profile/: qmm-T-PASS.prof, .txt and .log, driver.txt).
set -u
out=${1:?usage: device_lab.sh OUT [OLD_TREE]}
old=${2:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
step() { echo "== $*"; "$@" || echo "!! failed ($?): $*"; }
if [[ ${TWIN:-0} == 1 ]]; then
  step timeout 180 python3 -m benchmarks.gemm_twin_check 2>&1 | tee "$out/gemm_twin_check.txt"
fi
if [[ ${GEMM_LAB:-1} != 0 ]]; then
  narrow=()
  [[ -n ${ONLY:-} ]] && narrow+=(--only "$ONLY")
  [[ -n ${MS:-} ]] && narrow+=(--m "$MS")
  [[ -n ${LAB_ROUNDS:-} ]] && narrow+=(--rounds "$LAB_ROUNDS")
  step timeout $((330 * ${LAB_ROUNDS:-1})) python3 -m benchmarks.gemm_lab --out "$out/gemm_lab" "${narrow[@]}"
  tail -25 "$out/gemm_lab/gemm_lab.txt" 2>/dev/null
fi
ncu_names=${NCU:-}
for name in ${ncu_names//,/ }; do
  step timeout 150 python3 -m benchmarks.gemm_lab --out "$out/gemm_lab_ncu" --ncu "$name" --m 4096
done
if [[ -n ${PROFILE:-} ]]; then
  plan=/tmp/profile-plan
  rm -rf "$plan" && mkdir -p "$out/profile"
  orchestrate plan -s nvfp4-prefill --device profile --out "$plan" --lock /tmp/orchestrate-profile.lock >/dev/null
  python3 -m benchmarks.job_profile driver > "$out/profile/driver.txt" 2>&1
  cat "$out/profile/driver.txt"
  for tokens in ${PROFILE//,/ }; do
    job=$(grep -l "\"tokens\": $tokens[,}]" "$plan"/qmm-*.json | head -1)
    for pass in 1 2; do
      name="$out/profile/qmm-$tokens-$pass"
      step timeout ${PROFILE_TIMEOUT:-150} python3 -m cProfile -o "$name.prof" -m workers run "$job" --out "/tmp/profile-$tokens-$pass.parquet" > "$name.log" 2>&1
      python3 -m benchmarks.job_profile show "$name.prof" "/tmp/profile-$tokens-$pass.parquet" > "$name.txt" 2>&1
      head -1 "$name.txt"
    done
  done
fi
if [[ -n $old ]]; then
  jobs=/tmp/before-after
  mkdir -p "$jobs"
  rm -f "$jobs"/old-*.parquet "$jobs"/new-*.parquet  # an earlier call's files would join the comparison
  python3 -m benchmarks.before_after write "$jobs" >/dev/null
  oldpath="$(cd "$old" && pwd):/tmp/site"  # the older workers/ and kernels/ first, not this checkout
  run_old() {
    (cd "$jobs" && step env PYTHONPATH="$oldpath" timeout 240 \
      python3 -m workers run "$jobs/$1.json" --out "$jobs/old-$1-$2.parquet")
  }
  run_new() { step timeout 240 python3 -m workers run "$jobs/$1.json" --out "$jobs/new-$1-$2.parquet"; }
  rounds=${ROUNDS:-2}
  for job in qmm-2048 moe-512; do
    for ((r = 0; r < rounds; r++)); do
      if ((r % 2 == 0)); then
        run_old "$job" "$r"; run_new "$job" "$r"
      else
        run_new "$job" "$r"; run_old "$job" "$r"
      fi
    done
  done
  python3 -m benchmarks.before_after compare --old "$jobs"/old-*.parquet --new "$jobs"/new-*.parquet \
    | tee "$out/before_after.md"
fi
