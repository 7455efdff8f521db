#!/usr/bin/env bash
# Everything the decode-GEMV work measures on the lent GPU, in one call (the machine reaches no
# registry and device time is short). Run on the GPU machine after MLX's CUDA build is installed:
#
#   source .device/stage2/install.sh && bash benchmarks/gemv_device_run.sh "$OUT"
#
# Writes under OUT: lab/ (plain launches), lab_graph/ (the same replayed from CUDA graphs, as MLX
# launches kernels), gpu_kernels.json (through MLX), ncu.csv (kernel durations inside MLX's
# process) and pytest.log (the CUDA tests). Each step's failure is reported and the next runs.
set -u
out=${1:?usage: gemv_device_run.sh OUT_DIR}
export PYTHONUNBUFFERED=1
step() { echo "== $*"; "$@" || echo "!! failed ($?): $*"; }
step python3 -m benchmarks.gemv_lab --out "$out/lab" --m 1,4,8
step env LAB_GRAPH=1 python3 -m benchmarks.gemv_lab --out "$out/lab_graph" --m 1,8 --only stream-w12b132c4s2,ksplit-w2u3
step python3 -m pytest -q -m cuda tests/kernels -p no:cacheprovider > "$out/pytest.log" 2>&1
tail -3 "$out/pytest.log"
step python3 -m benchmarks.gpu_kernels --out "$out" --skip moe qmm
step ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum \
  --csv --log-file "$out/ncu.csv" python3 -m benchmarks.gpu_kernels --out /tmp/probe --probe
