#!/usr/bin/env bash
# Everything the decode-GEMV work measures on an NVIDIA GPU host, in one call. Run on the GPU host
# after MLX's CUDA build is installed (docs/gpu-hosts.md):
#
#   bash benchmarks/gemv_device_run.sh OUT
#
# Writes under OUT: lab/ (plain launches: the stream kernel's launch shapes, K-split, ceilings),
# lab_graph/ (the same replayed from CUDA graphs, as MLX launches kernels), gap/
# (benchmarks.gemv_mlx_gap --mlx-only --trace: per call through MLX, and the kernels' durations,
# overlap and busy time in MLX's process from CUPTI, beside MLX's own), pytest.log (the CUDA
# tests) and gpu_kernels.json (the GEMV through MLX at M = 1..8, launch shapes tuned, and the qmm
# prefill points). Each step's
# failure is reported and the next runs. (`benchmarks.gemv_mlx_gap` without --mlx-only also runs
# the kernel through CuPy on MLX's buffers and on its own, which shows the small-buffer pool's cost.)
set -u
out=${1:?usage: gemv_device_run.sh OUT_DIR}
export PYTHONUNBUFFERED=1
step() { echo "== $*"; "$@" || echo "!! failed ($?): $*"; }
all_m=1,2,3,4,5,6,7,8
step timeout 120 python3 -m benchmarks.gemv_lab --out "$out/lab" --m 1,4,8
step env LAB_GRAPH=1 timeout 120 python3 -m benchmarks.gemv_lab --out "$out/lab_graph" --m "$all_m" --only stream-w12b132c4s2
step timeout 240 python3 -m benchmarks.gemv_mlx_gap --out "$out/gap" --m "$all_m" --mlx-only --trace --floor
step timeout 120 python3 -m pytest -q -m cuda tests/kernels -p no:cacheprovider > "$out/pytest.log" 2>&1
tail -3 "$out/pytest.log"
step timeout 240 python3 -m benchmarks.gpu_kernels --out "$out" --skip moe
# the reply carries at most 8 files: keep the JSON (the tables above went to stdout)
rm -f "$out"/lab*/build.log "$out"/lab*/lab.stdout "$out"/lab*/gemv_lab.txt
