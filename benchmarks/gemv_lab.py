"""Kernel lab for the NVFP4 decode GEMV: many variants built, checked and timed in one nvcc program.

    python3 -m benchmarks.gemv_lab --out DIR [--m 1,4,8] [--only NAME,...] [--ncu NAME,...]

Runs on a machine with `nvcc` and an NVIDIA GPU (the lent H200), without MLX: the kernel bodies of
`kernels/cuda/` are instantiated exactly as `mx.fast.cuda_kernel` would (the signature MLX writes,
the template constants as `constexpr`), several launch shapes side by side, under a small C++
harness that

* fills the inputs on the GPU from a hash (random E2M1 codes, every E4M3 scale pattern but NaN,
  bf16 activations over several octaves), never zeros;
* checks each variant against a float32 reference kernel (exact dequantisation, fp32 sums) with the
  output poisoned to NaN first: relative L2 error, and a count of outputs left unwritten (NaN);
* times each variant as the median of REPS batches of L back-to-back launches between CUDA events,
  rotating over NCOPY weight copies (8 x 65 MB against the 60 MB L2), so every launch reads its
  weights from device memory;
* measures the ceilings in the same process: a 1 GiB device-to-device copy (bytes read + written)
  and a pure read of the same 65 MB weight copies by a simple vectorised kernel.

It writes `DIR/gemv_lab.json` (every number) and `DIR/gemv_lab.txt` (the table it prints), and
with `--ncu` profiles the named variants under Nsight Compute (`DIR/ncu_<name>.txt`).
This is a development tool: the numbers BENCHMARKS.md reports for the shipped kernel come from
`benchmarks.gpu_kernels`, through MLX.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from kernels.cuda import CudaKernelSource, TemplateValue

N, K = 21504, 5376
SIGNATURE_DTYPES = ({"x": "bfloat16", "w": "uint32", "scales": "uint8", "gsv": "float32"}, {"y": "bfloat16"})


@dataclass(frozen=True)
class Variant:
    """One kernel body at one launch shape."""

    name: str
    body: str
    consts: dict[str, TemplateValue] = field(default_factory=dict)
    warps: int = 1  # warps per block
    rows_per_block: int = 16  # the grid is ceil(N / rows_per_block) blocks
    # text replacements in the body: probes that leave a stage out (their results are wrong by design)
    patches: tuple[tuple[str, str], ...] = ()

    def source(self, m: int, first: bool) -> str:
        kernel = CudaKernelSource(body_file=self.body, inputs=("x", "w", "scales", "gsv"), outputs=("y",))
        template: dict[str, TemplateValue] = {"T": "bfloat16", "N": N, "K": K, "M": m, **self.consts}
        text = kernel.standalone_source(*SIGNATURE_DTYPES, template, function_name=self.fn(m), prelude=first)
        for old, new in self.patches:
            if old not in text:
                raise ValueError(f"{self.name}: patch target not in {self.body}: {old!r}")
            text = text.replace(old, new)
        return text

    def fn(self, m: int) -> str:
        return f"{self.name.replace('-', '_')}_m{m}"

    @property
    def blocks(self) -> int:
        if "BLOCKS" in self.consts:
            return int(self.consts["BLOCKS"])
        return -(-N // self.rows_per_block)

    def smem(self, m: int) -> int:
        """Dynamic shared memory bytes (the persistent kernel's x stage, rings and partial sums)."""
        if "BLOCKS" not in self.consts:
            return 0
        return persist_smem_bytes(m, K, self.warps, int(self.consts["CHUNK"]), int(self.consts["STAGES"]))


def persist_smem_bytes(m: int, k: int, warps: int, chunk: int, stages: int) -> int:
    xrs = ((k // 8 + 7) // 8 * 8 + 2) * 16
    slot = 16 * chunk * 64 + 16 * (48 if chunk == 4 else 16)
    return m * xrs + warps * stages * slot + warps * 2 * 128 * 4


def variants() -> list[Variant]:
    """The variants of this lab run: the shipped K-split kernel and the warp-per-tile pipelines."""
    out: list[Variant] = []
    for warps, unroll in ((2, 3),):
        consts: dict[str, TemplateValue] = {"WARPS": warps, "UNROLL": unroll, "SPLIT": False, "CVT_SCALES": False}
        out.append(Variant(f"ksplit-w{warps}u{unroll}", "gemv_nvfp4.cu", consts, warps, 16))
    for warps, chunk, stages in ((12, 4, 2),):
        consts = {"WARPS": warps, "BLOCKS": 132, "CHUNK": chunk, "STAGES": stages, "CVT_SCALES": True}
        out.append(Variant(f"persist-w{warps}c{chunk}s{stages}", "gemv_nvfp4_persist.cu", consts, warps))
    l2 = (("nvfp4::cp_async_16(slot + RPI * i * ROWB + cdst", "nvfp4::cp_async_16_l2(slot + RPI * i * ROWB + cdst"),)
    for warps, blocks, chunk, stages in ((12, 132, 4, 2), (10, 132, 4, 2), (8, 132, 4, 2), (8, 132, 4, 3), (6, 264, 4, 2), (8, 132, 2, 2)):
        consts = {"WARPS": warps, "BLOCKS": blocks, "CHUNK": chunk, "STAGES": stages, "XF16": False}
        out.append(Variant(f"f16-w{warps}b{blocks}c{chunk}s{stages}", "gemv_nvfp4_f16.cu", consts, warps))
    del l2
    return out


HARNESS = r"""
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <cuda_runtime.h>

#define CK(call) do { cudaError_t e_ = (call); if (e_ != cudaSuccess) { \
  fprintf(stderr, "CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); exit(3); } } while (0)
"""

HARNESS_BODY = r"""
__device__ __forceinline__ uint32_t mix(uint64_t v) {
  v ^= v >> 33; v *= 0xff51afd7ed558ccdULL; v ^= v >> 33; v *= 0xc4ceb9fe1a85ec53ULL; v ^= v >> 33;
  return static_cast<uint32_t>(v);
}
__global__ void fill_codes(uint32_t* w, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
    w[i] = mix(seed * 0x9E3779B97F4A7C15ULL + i);
}
__global__ void fill_scales(uint8_t* s, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t b = mix(seed * 0x9E3779B97F4A7C15ULL + i) & 0xFFu;
    if ((b & 0x7Fu) == 0x7Fu) b ^= 0x01u;  // no NaN scales; every other pattern, subnormals and signs included
    s[i] = static_cast<uint8_t>(b);
  }
}
__global__ void fill_x(__nv_bfloat16* x, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = mix(seed * 0x9E3779B97F4A7C15ULL + i);
    float u = (static_cast<float>(h & 0xFFFFFu) / 1048576.0f) * 2.0f - 1.0f;
    x[i] = __float2bfloat16(ldexpf(u, static_cast<int>((h >> 20) % 5u) - 2));
  }
}
__device__ float e2m1(uint32_t c) {
  const float mag[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  return (c & 8u) ? -mag[c & 7u] : mag[c & 7u];
}
__device__ float e4m3(uint32_t b) {
  const uint32_t e = (b >> 3) & 15u, m = b & 7u;
  const float v = e == 0 ? ldexpf(static_cast<float>(m), -9) : ldexpf(1.0f + m / 8.0f, static_cast<int>(e) - 7);
  return (b & 0x80u) ? -v : v;
}
__global__ void reference(const __nv_bfloat16* x, const uint32_t* w, const uint8_t* s, float gsv, float* y, int m, int n, int k) {
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= n) return;
  for (int r = 0; r < m; ++r) {
    float acc = 0.f;
    for (int kk = 0; kk < k; ++kk) {
      const uint32_t code = (w[(size_t)row * (k / 8) + kk / 8] >> (4 * (kk % 8))) & 15u;
      acc += __bfloat162float(x[(size_t)r * k + kk]) * e2m1(code) * e4m3(s[(size_t)row * (k / 16) + kk / 16]);
    }
    y[(size_t)r * n + row] = acc * gsv;
  }
}
__global__ void read_probe(const uint4* p, size_t n, uint32_t* sink) {
  uint32_t a = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint4 v = __ldcs(p + i);  // streaming, like the weights
    a ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (a == 0x9E3779B9u) sink[0] = a;  // keeps the loads; practically never taken
}

// The GEMV's weight stream without arithmetic: one warp per 16-row tile reads all of the tile's
// codes, each load instruction covering 32 / LPR rows x LPR * 16 contiguous bytes (LPR = 4 is the
// 64 bytes per row per step of a lane-per-16-bytes MMA mapping; 32 is a whole 512-byte segment).
template <int LPR>
__global__ void pattern_probe(const uint32_t* w, uint32_t* sink) {
  constexpr int ROW_BYTES = K / 2, SEG = LPR * 16, RPI = 32 / LPR, UNR = 8;
  const int lane = threadIdx.x & 31;
  const int tile = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
  if (tile * 16 >= N) return;
  const uint8_t* base = reinterpret_cast<const uint8_t*>(w) + (size_t)tile * 16 * ROW_BYTES;
  const int r0 = lane / LPR, c0 = (lane % LPR) * 16;
  uint32_t a = 0;
  constexpr int ITEMS = (ROW_BYTES / SEG) * (16 / RPI);  // (segment, row group) pairs
  for (int i0 = 0; i0 < ITEMS; i0 += UNR) {
    uint4 v[UNR];
#pragma unroll
    for (int u = 0; u < UNR; ++u) {
      const int i = i0 + u;
      const int seg = i / (16 / RPI), rg = i % (16 / RPI);
      v[u] = i < ITEMS ? __ldcs(reinterpret_cast<const uint4*>(base + (size_t)(rg * RPI + r0) * ROW_BYTES + seg * SEG + c0))
                       : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < UNR; ++u) a ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (a == 0x9E3779B9u) sink[0] = a;
}

typedef void (*Kern)(const __nv_bfloat16*, const uint32_t*, const uint8_t*, const float*, __nv_bfloat16*);
struct V { const char* name; int m; Kern fn; int blocks; int threads; int smem; };

static float median(std::vector<float> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }

int main(int argc, char** argv) {
  const int NCOPY = 8, L = 48, REPS = 11;
  const size_t wn = (size_t)N * K / 8, sn = (size_t)N * K / 16;
  std::vector<uint32_t*> W(NCOPY); std::vector<uint8_t*> S(NCOPY);
  for (int c = 0; c < NCOPY; ++c) {
    CK(cudaMalloc(&W[c], wn * 4)); CK(cudaMalloc(&S[c], sn));
    fill_codes<<<1024, 256>>>(W[c], wn, 17 + c); fill_scales<<<1024, 256>>>(S[c], sn, 1017 + c);
  }
  __nv_bfloat16 *x, *y; float *gsv, *yref; uint32_t* sink;
  CK(cudaMalloc(&x, 8 * K * 2)); CK(cudaMalloc(&y, 8 * (size_t)N * 2)); CK(cudaMalloc(&gsv, 4));
  CK(cudaMalloc(&yref, 8 * (size_t)N * 4)); CK(cudaMalloc(&sink, 4));
  fill_x<<<64, 256>>>(x, 8 * K, 5);
  const float gsv_h = 0.37f;
  CK(cudaMemcpy(gsv, &gsv_h, 4, cudaMemcpyHostToDevice));
  CK(cudaDeviceSynchronize());
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  int sms = 0; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop; CK(cudaGetDeviceProperties(&prop, 0));
  printf("{\"kind\": \"device\", \"name\": \"%s\", \"sms\": %d, \"l2_bytes\": %d}\n", prop.name, sms, prop.l2CacheSize);

  {  // copy ceiling: 1 GiB device-to-device, bytes read + written
    const size_t bytes = (size_t)1 << 30; void *a, *b; CK(cudaMalloc(&a, bytes)); CK(cudaMalloc(&b, bytes));
    CK(cudaMemset(a, 1, bytes));
    std::vector<float> t;
    for (int r = 0; r < 7; ++r) {
      CK(cudaEventRecord(e0)); for (int i = 0; i < 4; ++i) CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
      CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1)); float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); t.push_back(ms / 4);
    }
    printf("{\"kind\": \"copy\", \"gb_s\": %.1f}\n", 2.0 * bytes / (median(t) * 1e-3) / 1e9);
    CK(cudaFree(a)); CK(cudaFree(b));
  }
  {  // pure read of the weight copies (codes only, 16-byte streaming loads)
    std::vector<float> t;
    for (int r = 0; r < REPS; ++r) {
      CK(cudaEventRecord(e0));
      for (int i = 0; i < L; ++i) read_probe<<<sms * 8, 512>>>((const uint4*)W[i % NCOPY], wn / 4, sink);
      CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1)); float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); t.push_back(ms / L);
    }
    CK(cudaGetLastError());
    printf("{\"kind\": \"read\", \"bytes\": %zu, \"us\": %.2f, \"gb_s\": %.1f}\n", wn * 4, median(t) * 1e3, wn * 4 / (median(t) * 1e-3) / 1e9);
  }
  {  // the weight stream's access pattern alone, at three segment widths per row
    const std::pair<int, void (*)(const uint32_t*, uint32_t*)> probes[] = {
        {4, pattern_probe<4>}, {16, pattern_probe<16>}, {32, pattern_probe<32>}};
    for (auto& p : probes) {
      std::vector<float> t;
      for (int r = 0; r < REPS; ++r) {
        CK(cudaEventRecord(e0));
        for (int i = 0; i < L; ++i) p.second<<<N / 16 / 4, 128>>>(W[i % NCOPY], sink);
        CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1)); float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); t.push_back(ms / L);
      }
      CK(cudaGetLastError());
      printf("{\"kind\": \"pattern\", \"row_bytes_per_load\": %d, \"us\": %.2f, \"gb_s\": %.1f}\n", p.first * 16,
             median(t) * 1e3, wn * 4 / (median(t) * 1e-3) / 1e9);
    }
  }
  const std::vector<V> vs = {VARIANTS};
  std::vector<float> ref(8 * (size_t)N); std::vector<uint16_t> out(8 * (size_t)N);
  int last_m = -1;
  for (const V& v : vs) {
    if (v.smem > 0) CK(cudaFuncSetAttribute(v.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, v.smem));
  }
  for (const V& v : vs) {
    cudaFuncAttributes fa; CK(cudaFuncGetAttributes(&fa, v.fn));
    if (fa.numRegs * v.threads > 65536) {  // the launch would fail: too many registers for the block
      printf("{\"kind\": \"skipped\", \"name\": \"%s\", \"m\": %d, \"registers\": %d}\n", v.name, v.m, fa.numRegs);
      continue;
    }
    if (v.m != last_m) {
      reference<<<(N + 127) / 128, 128>>>(x, W[0], S[0], gsv_h, yref, v.m, N, K);
      CK(cudaGetLastError()); CK(cudaDeviceSynchronize());
      CK(cudaMemcpy(ref.data(), yref, (size_t)v.m * N * 4, cudaMemcpyDeviceToHost));
      last_m = v.m;
    }
    CK(cudaMemset(y, 0xFF, 8 * (size_t)N * 2));  // NaN poison
    v.fn<<<v.blocks, v.threads, v.smem>>>(x, W[0], S[0], gsv, y);
    CK(cudaGetLastError()); CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(out.data(), y, (size_t)v.m * N * 2, cudaMemcpyDeviceToHost));
    double num = 0, den = 0; long nan = 0;
    for (size_t i = 0; i < (size_t)v.m * N; ++i) {
      uint32_t bits = (uint32_t)out[i] << 16; float f; memcpy(&f, &bits, 4);
      if (std::isnan(f)) { ++nan; continue; }
      num += (double)(f - ref[i]) * (f - ref[i]); den += (double)ref[i] * ref[i];
    }
    std::vector<float> t;
    for (int i = 0; i < 2 * NCOPY; ++i) v.fn<<<v.blocks, v.threads, v.smem>>>(x, W[i % NCOPY], S[i % NCOPY], gsv, y);
    for (int r = 0; r < REPS; ++r) {
      CK(cudaEventRecord(e0));
      for (int i = 0; i < L; ++i) v.fn<<<v.blocks, v.threads, v.smem>>>(x, W[i % NCOPY], S[i % NCOPY], gsv, y);
      CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1)); float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); t.push_back(ms / L);
    }
    CK(cudaGetLastError());
    std::sort(t.begin(), t.end());
    const double bytes = (double)wn * 4 + sn + (double)v.m * K * 2 + (double)v.m * N * 2;
    printf("{\"kind\": \"variant\", \"name\": \"%s\", \"m\": %d, \"blocks\": %d, \"threads\": %d, \"us\": %.2f, "
           "\"us_min\": %.2f, \"us_max\": %.2f, \"gb_s\": %.1f, \"rel_err\": %.3e, \"unwritten\": %ld}\n",
           v.name, v.m, v.blocks, v.threads, t[t.size() / 2] * 1e3, t.front() * 1e3, t.back() * 1e3,
           bytes / (t[t.size() / 2] * 1e-3) / 1e9, std::sqrt(num / den), nan);
    fflush(stdout);
  }
  return 0;
}
"""


MAX_SMEM = 232448  # bytes of shared memory one block may have on sm_90 (227 KB)


def translation_unit(chosen: list[Variant], ms: list[int]) -> str:
    parts: list[str] = []
    first = True
    combos = [(v, m) for m in ms for v in chosen if v.smem(m) <= MAX_SMEM]
    for v, m in sorted(combos, key=lambda c: (c[0].name, c[1])):
        parts.append(v.source(m, first))
        first = False
    table = ",\n    ".join(
        f'{{"{v.name}", {m}, mlx::core::cu::{v.fn(m)}, {v.blocks}, {32 * v.warps}, {v.smem(m)}}}' for v, m in combos
    )
    head = HARNESS
    consts = f"constexpr int N = {N};\nconstexpr int K = {K};\n"
    return head + "\n".join(parts) + "\n" + consts + HARNESS_BODY.replace("{VARIANTS}", "{\n    " + table + "\n  }")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--m", default="1,4,8", help="activation rows, comma-separated")
    parser.add_argument("--only", default="", help="variant names, comma-separated (default: all)")
    parser.add_argument("--ncu", default="", help="variant names to profile at the first M")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--build-only", action="store_true", help="compile, print register use, run nothing")
    args = parser.parse_args(argv)
    ms = [int(v) for v in args.m.split(",")]
    chosen = [v for v in variants() if not args.only or v.name in args.only.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gemv_lab_"))
    src = work / "lab.cu"
    src.write_text(translation_unit(chosen, ms))
    exe = work / "lab"
    build = subprocess.run(
        ["nvcc", "-O3", f"-arch={args.arch}", "-std=c++17", "-Xptxas", "-v", "-o", str(exe), str(src)],
        capture_output=True,
        text=True,
    )
    (args.out / "build.log").write_text(build.stdout + build.stderr)
    if build.returncode != 0:
        print(build.stderr[-4000:], file=sys.stderr)
        return 2
    regs = [line.strip() for line in build.stderr.splitlines() if "registers" in line or "Compiling entry" in line]
    print("\n".join(regs[-2 * len(chosen) * len(ms) :]))
    if args.build_only:
        return 0
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    (args.out / "lab.stdout").write_text(run.stdout + run.stderr)
    # printf writes a NaN/inf error as nan/inf, which JSON lacks
    fixed = run.stdout.replace(": nan", ": NaN").replace(": -nan", ": NaN").replace(": inf", ": Infinity")
    records = [json.loads(line) for line in fixed.splitlines() if line.startswith("{")]
    (args.out / "gemv_lab.json").write_text(json.dumps(records, indent=1))
    if run.returncode != 0:
        print(run.stdout[-2000:], run.stderr[-2000:], file=sys.stderr)
        return 3
    copy = next(r["gb_s"] for r in records if r["kind"] == "copy")
    lines = [f"{r}" for r in records if r["kind"] != "variant"]
    lines.append(f"{'variant':<16} {'M':>2} {'us':>7} {'min':>7} {'max':>7} {'GB/s':>7} {'of copy':>7} {'rel err':>9} unwr")
    for r in records:
        if r["kind"] == "variant":
            lines.append(
                f"{r['name']:<16} {r['m']:>2} {r['us']:>7.2f} {r['us_min']:>7.2f} {r['us_max']:>7.2f} "
                f"{r['gb_s']:>7.0f} {r['gb_s'] / copy:>7.1%} {r['rel_err']:>9.2e} {r['unwritten']}"
            )
    text = "\n".join(lines)
    (args.out / "gemv_lab.txt").write_text(text + "\n")
    print(text)
    for name in [n for n in args.ncu.split(",") if n]:
        fn = next(v for v in chosen if v.name == name).fn(ms[0])
        log = args.out / f"ncu_{name}.txt"
        cmd = ["ncu", "--clock-control", "none", "-k", f"regex:{fn}", "--launch-skip", "20", "--launch-count", "1"]
        metrics = r"regex:(smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio|sm__inst_executed_pipe_.*)$"
        cmd += ["--set", "full", "--metrics", metrics, str(exe)]
        prof = subprocess.run(cmd, capture_output=True, text=True)
        log.write_text(prof.stdout[-200000:] + prof.stderr[-20000:])
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
