"""Kernel lab for the NVFP4 decode GEMV: many variants built, checked and timed in one nvcc program.

    python3 -m benchmarks.gemv_lab --out DIR [--m 1,4,8] [--only NAME,...] [--ncu NAME,...]

Runs on a machine with `nvcc` and an NVIDIA GPU, without MLX: the kernel bodies of
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
* measures the ceilings in the same process: a 1 GiB device-to-device copy (bytes read + written),
  a pure read of the same 65 MB weight copies by a simple vectorised kernel, and the GEMV's own
  access pattern without arithmetic at 64, 256 and 512 contiguous bytes per row per load.

`LAB_MANAGED=prefetch|touch|bounce` puts the weights in unified memory (cudaMallocManaged, as
MLX's allocator does), populated in bulk, by the fill kernel's first writes, or moved to the host
and back. `LAB_GRAPH=1` records each batch of launches into a CUDA graph and replays it, as MLX's
CUDA backend launches kernels (not yet run on the GPU: the next thing to try about the MLX gap).

It writes `DIR/gemv_lab.json` (every number) and `DIR/gemv_lab.txt` (the table it prints), and
with `--ncu` profiles the named variants under Nsight Compute (`DIR/ncu_<name>.txt`, with the warp
stall reasons and pipe counts). The C++ side is `gemv_lab_prelude.cu` and
`gemv_lab_harness.cu`. BENCHMARKS.md reports its numbers beside those of `benchmarks.gpu_kernels`
(through MLX), which differ (see there).
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
from kernels.cuda.layout import stream_smem_bytes

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

    def source(self, m: int, first: bool) -> str:
        kernel = CudaKernelSource(body_file=self.body, inputs=("x", "w", "scales", "gsv"), outputs=("y",))
        template: dict[str, TemplateValue] = {"T": "bfloat16", "N": N, "K": K, "M": m, **self.consts}
        return kernel.standalone_source(*SIGNATURE_DTYPES, template, function_name=self.fn(m), prelude=first)

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
        return stream_smem_bytes(m, K, self.warps, int(self.consts["CHUNK"]), int(self.consts["STAGES"]))


def variants() -> list[Variant]:
    """The variants of this lab run: the K-split kernel and the stream kernel at several shapes."""
    out: list[Variant] = []
    ksplit: dict[str, TemplateValue] = {"WARPS": 2, "UNROLL": 3, "SPLIT": False, "CVT_SCALES": False}
    out.append(Variant("ksplit-w2u3", "gemv_nvfp4_ksplit.cu", ksplit, 2, 16))
    for warps, blocks, chunk, stages in ((12, 132, 4, 2), (8, 132, 4, 2)):
        consts: dict[str, TemplateValue] = {"WARPS": warps, "BLOCKS": blocks, "CHUNK": chunk, "STAGES": stages}
        consts["XF16"] = False
        out.append(Variant(f"stream-w{warps}b{blocks}c{chunk}s{stages}", "gemv_nvfp4.cu", consts, warps))
    return out


HARNESS_DIR = Path(__file__).resolve().parent
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
    head = (HARNESS_DIR / "gemv_lab_prelude.cu").read_text()
    body = (HARNESS_DIR / "gemv_lab_harness.cu").read_text()
    consts = f"constexpr int N = {N};\nconstexpr int K = {K};\n"
    return head + "\n".join(parts) + "\n" + consts + body.replace("{VARIANTS}", "{\n    " + table + "\n  }")


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
    head = f"{'variant':<20} {'M':>2} {'us':>7} {'min':>7} {'max':>7} {'GB/s':>7} {'of copy':>7} {'rel err':>9}"
    lines.append(head + " unwritten")
    for r in records:
        if r["kind"] == "variant":
            lines.append(
                f"{r['name']:<20} {r['m']:>2} {r['us']:>7.2f} {r['us_min']:>7.2f} {r['us_max']:>7.2f} "
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
