#!/usr/bin/env bash
# Everything the decode-GEMV work measures on the lent GPU, in one call (the machine reaches no
# registry and device time is short). Run on the GPU machine after MLX's CUDA build is installed:
#
#   source .device/stage2/install.sh && bash benchmarks/gemv_device_run.sh "$OUT"
#
# Writes under OUT: lab/ (plain launches: the stream kernel's launch shapes, K-split, ceilings),
# gap/ (benchmarks.gemv_mlx_gap: the same kernel through MLX, through CuPy on MLX's buffers and on
# its own, MLX serialised one graph per launch, CUPTI kernel durations), lab_graph/ (the lab's
# launches replayed from CUDA graphs), pytest.log (the CUDA tests) and gpu_kernels.json (the GEMV
# through MLX at M = 1..8, launch shapes tuned). Each step's failure is
# reported and the next runs.
set -u
out=${1:?usage: gemv_device_run.sh OUT_DIR}
export PYTHONUNBUFFERED=1
step() { echo "== $*"; "$@" || echo "!! failed ($?): $*"; }
streams=stream-w12b132c4s2,stream-w8b132c4s2,stream-w6b264c4s2,stream-w8b264c4s2,stream-w4b396c4s2
step timeout 120 python3 -m benchmarks.gemv_lab --out "$out/lab" --m 1,8
step timeout 150 python3 -m benchmarks.gemv_mlx_gap --out "$out/gap" --m 1,8 --floor --configs w6b264c4s2,w8b264c4s2,w4b396c4s2
step env LAB_GRAPH=1 timeout 90 python3 -m benchmarks.gemv_lab --out "$out/lab_graph" --m 1,8 --only "$streams"
step timeout 60 python3 -m benchmarks.gemv_mlx_gap --out "$out/gap_trace" --m 1 --mlx-only --trace
step env MLX_MAX_OPS_PER_BUFFER=100 timeout 60 python3 -m benchmarks.gemv_mlx_gap --out "$out/gap" --m 1,8 --mlx-only
step timeout 120 python3 -m pytest -q -m cuda tests/kernels -p no:cacheprovider > "$out/pytest.log" 2>&1
tail -3 "$out/pytest.log"
step timeout 200 python3 -m benchmarks.gpu_kernels --out "$out" --skip moe qmm
