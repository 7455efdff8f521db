"""The custom NVFP4 kernels (issue 7) on a machine without a GPU, and on one with CUDA.

Without CUDA, the kernels' logic is checked three ways: the bit tricks of `nvfp4_mma.cuh`
(E2M1 -> bf16 * 2^-126, E4M3 -> bf16 * 2^64) exhaustively against the NVFP4 reference, through
NumPy mirrors of those lines; a lane-by-lane NumPy emulation of the GEMV kernel body (fragment
layouts of mma.m16n8k16, the k permutation, the scale halves, the split-K sum and the epilogue)
against the float64 reference; and the MLX twins (the fallback) against the float64 reference.
With CUDA (MLX's CUDA backend), the kernels themselves against their twins; those tests are
skipped, with the reason, elsewhere. Where nvcc is installed, the kernels as MLX assembles them
must compile for sm_90.
"""

from __future__ import annotations

import itertools
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kernels import dispatch, moe, nvfp4, qmm
from kernels.cuda import cuda_backend_available, fatbin, nvrtc, precompiled_source, read_source
from kernels.gemv_nvfp4 import (
    GEMV_SOURCE,
    KSPLIT_SOURCE,
    STREAM_CONFIG,
    TOLERANCE,
    GemvConfig,
    gemv_nvfp4,
    gemv_nvfp4_cuda,
    gemv_nvfp4_twin,
    kernel_supports,
    route,
    stream_constants,
)
from kernels.moe_nvfp4 import MOE_SOURCE, moe_gather_nvfp4, moe_gather_nvfp4_twin

needs_cuda = pytest.mark.skipif(not cuda_backend_available(), reason="needs MLX's CUDA backend (an NVIDIA GPU)")

# ----------------------------------------------------------------------------- NumPy mirrors


def e2m1_pair_raw(t: np.ndarray) -> np.ndarray:
    """Mirror of nvfp4::e2m1_pair_raw."""
    t = t.astype(np.uint32)
    return (t & np.uint32(0x80008000)) | ((t >> np.uint32(6)) & np.uint32(0x01C001C0))


def e4m3_scale_splat(b: np.ndarray) -> np.ndarray:
    """Mirror of nvfp4::e4m3_scale_splat."""
    b = b.astype(np.uint32)
    mag = b & np.uint32(0x7F)
    e = mag >> np.uint32(3)
    normal = (mag << np.uint32(4)) + np.uint32(184 << 7)
    sub_f = (mag & np.uint32(7)).astype(np.float32) * np.float32(36028797018963968.0)
    sub = sub_f.view(np.uint32) >> np.uint32(16)
    bits = np.where(e != 0, normal, sub) | ((b & np.uint32(0x80)) << np.uint32(8))
    return bits | (bits << np.uint32(16))


def bf16_halves(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A bf16x2 word's low and high halves as float64 (bf16 -> fp32 is a 16-bit shift, exact)."""
    v = v.astype(np.uint32)
    lo = (v << np.uint32(16)).view(np.float32).astype(np.float64)
    hi = (v & np.uint32(0xFFFF0000)).view(np.float32).astype(np.float64)
    return lo, hi


def bf16_pair(word: int) -> tuple[float, float]:
    """One bf16x2 word's (low, high) values."""
    lo, hi = bf16_halves(np.array([word], dtype=np.uint32))
    return float(lo[0]), float(hi[0])


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float64 values exactly representable in bf16 -> their bf16 bits (uint32, low half)."""
    f = x.astype(np.float32)
    assert np.array_equal(f.astype(np.float64), x), "not representable"
    return f.view(np.uint32) >> np.uint32(16)


def byte_perm(x: int, y: int, s: int) -> int:
    """Mirror of CUDA's __byte_perm for the selectors used (no sign-replicate bits)."""
    src = (y << 32) | x
    out = 0
    for i in range(4):
        sel = (s >> (4 * i)) & 0x7
        out |= ((src >> (8 * sel)) & 0xFF) << (8 * i)
    return out


def test_the_mirrored_lines_are_the_header_s() -> None:
    header = read_source("nvfp4_mma.cuh")
    assert "return (t & 0x80008000u) | ((t >> 6) & 0x01C001C0u);" in header
    assert "const uint32_t normal = (mag << 4) + (184u << 7);" in header
    assert "static_cast<float>(mag & 7u) * 36028797018963968.0f) >> 16;" in header
    assert "#define NVFP4_EPILOGUE_SCALE 4611686018427387904.0f" in header
    assert 4611686018427387904.0 == 2.0**62 and 36028797018963968.0 == 2.0**55


def test_e2m1_decode_is_exact_for_every_code_at_every_nibble() -> None:
    words = np.arange(1 << 16, dtype=np.uint32)
    words = words | (words[::-1] << np.uint32(16))  # every nibble pattern in both halves
    codes = nvfp4.unpack_codes(words[:, None])  # [W, 8]
    for j in range(4):
        lo, hi = bf16_halves(e2m1_pair_raw(words << np.uint32(12 - 4 * j)))
        np.testing.assert_array_equal(lo * 2.0**126, nvfp4.E2M1_VALUES[codes[:, j]].astype(np.float64))
        np.testing.assert_array_equal(hi * 2.0**126, nvfp4.E2M1_VALUES[codes[:, j + 4]].astype(np.float64))


def test_e4m3_scale_splat_is_exact_for_every_finite_scale() -> None:
    bits = np.array([b for b in range(256) if b & 0x7F != 0x7F], dtype=np.uint8)
    lo, hi = bf16_halves(e4m3_scale_splat(bits))
    expected = nvfp4.decode_e4m3(bits).astype(np.float64) * 2.0**64
    np.testing.assert_array_equal(lo, expected)
    np.testing.assert_array_equal(hi, expected)


def test_decoded_weight_times_scale_is_exact_in_bf16() -> None:
    # E2M1 (2 significant bits) x E4M3 (4) * 2^-62 fits bf16's 8 bits, far from its limits
    vals = nvfp4.E2M1_VALUES.astype(np.float64)[:, None] * nvfp4.decode_e4m3(np.arange(127)).astype(np.float64)
    prod = vals * 2.0**-62
    assert np.array_equal(prod.astype(np.float32).astype(np.float64), prod)
    np.testing.assert_array_equal(to_bf16_bits(prod).astype(np.float32), to_bf16_bits(prod).astype(np.float32))


# ------------------------------------------------------------ emulation of gemv_nvfp4.cu


def mma_m16n8k16(c: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """mma.sync.m16n8k16.row.col bf16 -> f32 on a warp's registers (PTX ISA fragment layouts).

    c: [32, 4] float64 accumulators; a: [32, 4] bf16x2 words; b: [32, 2] bf16x2 words.
    """
    am = np.zeros((16, 16))
    bm = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for reg, (row, col) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
            am[row, col], am[row, col + 1] = bf16_pair(int(a[lane, reg]))
        for reg, krow in enumerate([2 * t, 2 * t + 8]):
            bm[krow, g], bm[krow + 1, g] = bf16_pair(int(b[lane, reg]))
    cm = am @ bm
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        c[lane] += [cm[g, 2 * t], cm[g, 2 * t + 1], cm[g + 8, 2 * t], cm[g + 8, 2 * t + 1]]


def emulate_gemv(x_bf16: np.ndarray, packed: np.ndarray, scales: np.ndarray, warps: int, unroll: int) -> np.ndarray:
    """gemv_nvfp4.cu, line by line, for bf16 activations (x given as float64 bf16 values)."""
    m, k = x_bf16.shape
    n = packed.shape[0]
    steps = (k + 127) // 128
    xbits = np.zeros((8, k), dtype=np.uint32)
    xbits[:m] = to_bf16_bits(x_bf16)
    xwords = xbits[:, 0::2] | (xbits[:, 1::2] << np.uint32(16))  # bf16 pairs as loaded
    y = np.zeros((m, n))
    for block in range(n // 16):
        acc = np.zeros((warps, 32, 4))
        for warp in range(warps):
            for s0 in range(warp, steps, warps * unroll):
                for u in range(unroll):
                    step = s0 + u * warps
                    if step >= steps:
                        break
                    a_regs = np.zeros((8, 32, 8), dtype=np.uint32)  # [word i][lane][a0..a7]
                    x_regs = np.zeros((4, 32, 4), dtype=np.uint32)
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        row = block * 16 + g
                        k0 = step * 128 + t * 32
                        if k0 >= k:
                            continue  # zero codes, zero scales, zero activations
                        qa, qb = packed[row, k0 // 8 : k0 // 8 + 4], packed[row + 8, k0 // 8 : k0 // 8 + 4]
                        sa = e4m3_scale_splat(scales[row, k0 // 16 : k0 // 16 + 2])
                        sb = e4m3_scale_splat(scales[row + 8, k0 // 16 : k0 // 16 + 2])
                        for i in range(4):
                            s_a, s_b = (sa[0], sb[0]) if i < 2 else (sa[1], sb[1])
                            for j in range(4):
                                for half, (word, s) in enumerate([(qa[i], s_a), (qb[i], s_b)]):
                                    raw = e2m1_pair_raw(np.array([word << np.uint32(12 - 4 * j)], dtype=np.uint32))
                                    lo, hi = bf16_halves(raw)
                                    slo, _ = bf16_halves(np.array([s]))
                                    prod = np.array([lo[0] * slo[0], hi[0] * slo[0]])  # exact (see test above)
                                    bits = to_bf16_bits(prod)
                                    a_regs[i, lane, 2 * j + half] = bits[0] | (bits[1] << np.uint32(16))
                            if g < m:
                                x_regs[i, lane] = xwords[g, (k0 + 8 * i) // 2 : (k0 + 8 * i) // 2 + 4]
                    for i in range(4):
                        for first in (0, 4):  # the two MMAs of mma_word
                            a = a_regs[i][:, first : first + 4]
                            xw = x_regs[i]
                            pair = (0, 2) if first == 0 else (1, 3)
                            b = np.array(
                                [
                                    [byte_perm(int(w[pair[0]]), int(w[pair[1]]), 0x5410),
                                     byte_perm(int(w[pair[0]]), int(w[pair[1]]), 0x7632)]
                                    for w in xw
                                ],
                                dtype=np.uint32,
                            )  # fmt: skip
                            mma_m16n8k16(acc[warp], a, b)
        total = acc.sum(axis=0) * 2.0**62
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            row = block * 16 + g
            for c, (mm, rr) in enumerate([(2 * t, row), (2 * t + 1, row), (2 * t, row + 8), (2 * t + 1, row + 8)]):
                if mm < m:
                    y[mm, rr] = total[lane, c]
    return y


@pytest.mark.parametrize(("m", "k", "warps", "unroll"), [(3, 256, 2, 1), (8, 160, 1, 2), (1, 384, 3, 1)])
def test_emulated_gemv_kernel_matches_the_float64_reference(m: int, k: int, warps: int, unroll: int) -> None:
    rng = np.random.default_rng(m * 1000 + k)
    n = 32
    codes, scales = nvfp4.quantize(rng.standard_normal((n, k)).astype(np.float32))
    x = rng.standard_normal((m, k)).astype(np.float32).astype(mx.bfloat16.__class__ and np.float32)
    x_bf16 = np.array(mx.array(x).astype(mx.bfloat16).astype(mx.float32)).astype(np.float64)
    got = emulate_gemv(x_bf16, nvfp4.pack_codes(codes), scales, warps, unroll)
    ref = x_bf16 @ nvfp4.dequantize(codes, scales).T
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12 * np.abs(ref).max())


# ---------------------------------------------------------------------------- the MLX twins


def _nvfp4_mlx(w: np.ndarray, global_scale: float | None) -> tuple[mx.array, mx.array, np.ndarray]:
    codes, scales = nvfp4.quantize(w, global_scale)
    return mx.array(nvfp4.pack_codes(codes)), mx.array(scales), nvfp4.dequantize(codes, scales, global_scale)


def _rel(got: mx.array, ref: np.ndarray) -> float:
    g = np.array(got.astype(mx.float32)).astype(np.float64)
    return float(np.linalg.norm(g - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize(
    ("dtype", "global_scale", "tol"),
    [(mx.float32, None, 1e-5), (mx.float32, 7.5, 1e-5), (mx.bfloat16, None, 1e-2), (mx.float16, 3.0, 2e-3)],
)
def test_gemv_twin_matches_the_float64_reference(dtype: mx.Dtype, global_scale: float | None, tol: float) -> None:
    rng = np.random.default_rng(1)
    wq, sc, w64 = _nvfp4_mlx(rng.standard_normal((48, 96)).astype(np.float32), global_scale)
    x = mx.array(rng.standard_normal((5, 96)).astype(np.float32)).astype(dtype)
    ref = np.array(x.astype(mx.float32)).astype(np.float64) @ w64.T
    y = gemv_nvfp4_twin(x, wq, sc, global_scale)
    assert y.dtype == dtype and y.shape == (5, 48)
    assert _rel(y, ref) < tol
    assert _rel(gemv_nvfp4(x, wq, sc, global_scale), ref) < tol  # the public entry point, here the twin


def test_a_modelopt_decode_scale_passed_as_global_scale_is_wrong() -> None:
    rng = np.random.default_rng(2)
    w = rng.standard_normal((16, 64)).astype(np.float32)
    gs = float(nvfp4.natural_global_scale(w))
    wq, sc, w64 = _nvfp4_mlx(w, gs)
    x = mx.array(rng.standard_normal((2, 64)).astype(np.float32))
    ref = np.array(x).astype(np.float64) @ w64.T
    assert _rel(gemv_nvfp4_twin(x, wq, sc, gs), ref) < 1e-5
    assert _rel(gemv_nvfp4_twin(x, wq, sc, gs / 2688.0), ref) > 0.9


def test_kernel_limits() -> None:
    assert kernel_supports(8, 21504, 5376) is None
    assert "M=9" in (kernel_supports(9, 64, 64) or "")
    assert "N=" in (kernel_supports(1, 40, 64) or "")
    assert "K=" in (kernel_supports(1, 64, 48) or "")


def _moe_case(
    rng: np.random.Generator, e: int, n: int, k: int, tokens: int, top_k: int, with_gs: bool
) -> tuple[mx.array, mx.array, mx.array, mx.array | None, list[np.ndarray], np.ndarray, np.ndarray]:
    w_codes, w_scales, w64, gss = [], [], [], []
    for _ in range(e):
        w = (rng.standard_normal((n, k)) * 10.0 ** rng.uniform(-1, 1)).astype(np.float32)
        gs = float(nvfp4.natural_global_scale(w)) if with_gs else None
        codes, scales = nvfp4.quantize(w, gs)
        w_codes.append(nvfp4.pack_codes(codes))
        w_scales.append(scales)
        w64.append(nvfp4.dequantize(codes, scales, gs))
        gss.append(gs or 0.0)
    idx = np.argsort(rng.random((tokens, e)), axis=1)[:, :top_k].reshape(-1).astype(np.uint32)
    order = np.argsort(idx, kind="stable")
    lhs, rhs = (order // top_k).astype(np.uint32), idx[order]
    gs_arr = mx.array(np.array(gss, dtype=np.float32)) if with_gs else None
    return mx.array(np.stack(w_codes)), mx.array(np.stack(w_scales)), mx.array(lhs), gs_arr, w64, lhs, rhs


@pytest.mark.parametrize("with_gs", [True, False])
def test_moe_twin_matches_the_float64_reference_and_zeroes_rows_past_the_last_expert(with_gs: bool) -> None:
    rng = np.random.default_rng(3)
    e, n, k, tokens, top_k = 6, 32, 64, 10, 2
    wq, sc, lhs_mx, gs, w64, lhs, rhs = _moe_case(rng, e, n, k, tokens, top_k, with_gs)
    rhs = rhs.copy()
    rhs[-3:] = e  # routed past the last expert (padding rows)
    x = mx.array(rng.standard_normal((tokens, k)).astype(np.float32))
    x64 = np.array(x).astype(np.float64)
    ref = np.zeros((rhs.size, n))
    for r in range(rhs.size - 3):
        ref[r] = x64[lhs[r]] @ w64[rhs[r]].T
    y = moe_gather_nvfp4_twin(x, wq, sc, gs, lhs_mx, mx.array(rhs))
    got = np.array(y).astype(np.float64)
    assert np.all(got[-3:] == 0.0)
    assert float(np.linalg.norm(got - ref) / np.linalg.norm(ref)) < 1e-5
    y2 = moe_gather_nvfp4(x, wq, sc, gs, lhs_mx, mx.array(rhs))
    assert np.array_equal(np.array(y2), got)


def test_moe_twin_applies_each_expert_s_own_global_scale() -> None:
    rng = np.random.default_rng(4)
    wq, sc, lhs_mx, gs, w64, lhs, rhs = _moe_case(rng, 4, 16, 32, 6, 2, True)
    assert gs is not None
    x = mx.array(rng.standard_normal((6, 32)).astype(np.float32))
    right = moe_gather_nvfp4_twin(x, wq, sc, gs, lhs_mx, mx.array(rhs))
    wrong = moe_gather_nvfp4_twin(x, wq, sc, gs[::-1], lhs_mx, mx.array(rhs))
    ref = np.stack([np.array(x).astype(np.float64)[lhs[r]] @ w64[rhs[r]].T for r in range(rhs.size)])
    assert _rel(right, ref) < 1e-5
    assert _rel(wrong, ref) > 0.1


# ------------------------------------------------------------------- compile and run on CUDA


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit) for the offline compile check")
@pytest.mark.parametrize(("dtype", "cvt_scales"), [("bfloat16", False), ("bfloat16", True), ("float32", False)])
def test_kernels_compile_for_sm90_as_mlx_assembles_them(dtype: str, cvt_scales: bool, tmp_path: Path) -> None:
    split = dtype != "bfloat16"
    sig = ({"x": dtype, "w": "uint32", "scales": "uint8", "gsv": "float32"}, {"y": dtype})
    ksplit = {"T": dtype, "N": 21504, "K": 5376, "M": 8, "WARPS": 2, "UNROLL": 3, "SPLIT": split}
    ksplit["CVT_SCALES"] = cvt_scales
    sources = {
        "gemv_ksplit.cu": KSPLIT_SOURCE.standalone_source(*sig, ksplit),
        "moe.cu": MOE_SOURCE.standalone_source(
            {"x": dtype, "lhs": "uint32", "rhs": "uint32", "w": "uint32", "scales": "uint8", "gsv": "float32"},
            {"y": dtype},
            {"T": dtype, "N": 1856, "K": 2688, "E": 128, "R": 3072, "WARPS": 4, "UNROLL": 2, "NT": 4, "SPLIT": split},
        ),
    }
    if dtype != "float32":  # the stream kernel: bfloat16 (and float16) activations, at its shipped shape
        for m, cfg in itertools.product((1, 8), (STREAM_CONFIG, GemvConfig(chunk=2))):
            consts, _ = stream_constants(m, 21504, 5376, cfg, 132, False)
            sources[f"gemv_stream_m{m}_c{cfg.chunk}.cu"] = GEMV_SOURCE.standalone_source(*sig, {"T": dtype, **consts})
    for name, text in sources.items():
        src = tmp_path / name
        src.write_text(text)
        res = subprocess.run(
            ["nvcc", "-arch=sm_90", "-std=c++17", "-c", "-Xptxas", "-v", str(src), "-o", str(src.with_suffix(".o"))],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr
        assert "0 bytes spill stores" in res.stderr, res.stderr  # no register spills


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (the CUDA toolkit) for the offline compile check")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_gemv_kernels_compile_as_our_nvrtc_builds_them(dtype: str, tmp_path: Path) -> None:
    """What `nvrtc.build` hands NVRTC on a GPU host (the whole `extern "C"` unit with NVRTC's
    prelude, no MLX around it): it compiles for sm_90 without spills, for each kernel and shape."""
    sig = ({"x": dtype, "w": "uint32", "scales": "uint8", "gsv": "float32"}, {"y": dtype})
    ksplit = {"T": dtype, "N": 21504, "K": 5376, "M": 8, "WARPS": 2, "UNROLL": 3, "SPLIT": dtype != "bfloat16"}
    units = {"ksplit": precompiled_source(KSPLIT_SOURCE, *sig, {**ksplit, "CVT_SCALES": False}, "k", nvrtc.PRELUDE)}
    if dtype != "float32":
        for m in (1, 8):
            consts, _ = stream_constants(m, 21504, 5376, STREAM_CONFIG, 132, False)
            units[f"stream_m{m}"] = precompiled_source(GEMV_SOURCE, *sig, {"T": dtype, **consts}, "k", nvrtc.PRELUDE)
    for name, text in units.items():
        src = tmp_path / f"{name}.cu"
        src.write_text(text)
        cubin = str(src.with_suffix(".cubin"))
        res = subprocess.run(
            ["nvcc", "-arch=sm_90", "-std=c++17", "-cubin", "-Xptxas", "-v", str(src), "-o", cubin],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr[-3000:]
        assert "0 bytes spill stores" in res.stderr, res.stderr


@pytest.mark.skipif(
    nvrtc.library() is None or fatbin.library() is None,
    reason=f"needs NVRTC and nvFatbin libraries (none found; {nvrtc.NVRTC_ENV} and {fatbin.FATBIN_ENV} name them)",
)
def test_a_built_kernel_is_a_compressed_fatbin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MLX hashes the module image at every launch: `nvrtc.build` hands it the compressed fatbin."""
    monkeypatch.setenv("ORCHESTRATE_KERNEL_CACHE", str(tmp_path / "cache"))
    consts, _ = stream_constants(1, 21504, 5376, STREAM_CONFIG, 132, False)
    sig = ((("x", "bfloat16"), ("w", "uint32"), ("scales", "uint8"), ("gsv", "float32")), (("y", "bfloat16"),))
    fn, image = nvrtc.build(GEMV_SOURCE, *sig, (("T", "bfloat16"), *consts.items()), "sm_90")
    unit = precompiled_source(GEMV_SOURCE, *map(dict, sig), {"T": "bfloat16", **consts}, fn, nvrtc.PRELUDE)
    cubin = nvrtc.compile_cubin(unit, "sm_90")
    assert cubin[:4] == b"\x7fELF" and image[:4] == bytes.fromhex("50ed55ba")  # ELF in, fatbin out
    assert len(image) < len(cubin) / 2
    assert fatbin.compress(cubin, "sm_90") == image  # from the disk cache: the same bytes


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 5, 8])
def test_gemv_kernel_matches_its_twin_on_cuda(m: int) -> None:
    rng = np.random.default_rng(m)
    wq, sc, w_ref = _nvfp4_mlx(rng.standard_normal((256, 640)).astype(np.float32), 12.0)
    for dtype in (mx.bfloat16, mx.float32):
        x = mx.array(rng.standard_normal((m, 640)).astype(np.float32)).astype(dtype)
        got = gemv_nvfp4(x, wq, sc, 12.0)
        if dtype == mx.bfloat16:  # the stream kernel; the twin rounds x the same way
            want = gemv_nvfp4_twin(x, wq, sc, 12.0)
            assert _rel(got, np.array(want.astype(mx.float32)).astype(np.float64)) < 1e-3
        else:  # the K-split kernel's hi + lo split, against float64: on CUDA the twin's float32
            # matmul may run on TF32 tensor cores (about 2e-4 off), so it is not the yardstick here
            ref = np.array(x.astype(mx.float32)).astype(np.float64) @ w_ref.T
            assert _rel(got, ref) < TOLERANCE["float32"]


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize(
    ("m", "n", "k", "dtype", "x_scale"),
    [
        (1, 256, 640, mx.bfloat16, 1.0),  # K = 5 steps: a partial last chunk
        (3, 1000, 384, mx.bfloat16, 1.0),  # N % 16 == 8: 8-row half tiles; blocks < multiprocessors
        (8, 4096, 4096, mx.bfloat16, 1.0),
        (5, 2048, 1024, mx.float16, 1.0),
        (2, 512, 512, mx.bfloat16, 1e30),  # bfloat16 far outside f16's range, both ways
        (2, 512, 512, mx.bfloat16, 1e-30),
        (2, 512, 512, mx.bfloat16, 1e-37),  # max |x| < 2^-112: the scale exponent capped at 127
    ],
)
@pytest.mark.parametrize("cfg", [STREAM_CONFIG, GemvConfig(chunk=2)], ids=str)
def test_stream_kernel_matches_its_twin_on_cuda(
    m: int, n: int, k: int, dtype: mx.Dtype, x_scale: float, cfg: GemvConfig
) -> None:
    rng = np.random.default_rng(m * 7 + n)
    wq, sc, _ = _nvfp4_mlx(rng.standard_normal((n, k)).astype(np.float32), 12.0)
    x = (mx.array(rng.standard_normal((m, k)).astype(np.float32)) * x_scale).astype(dtype)
    assert route(m, n, k, str(dtype).removeprefix("mlx.core.")) == _our_build("gemv_nvfp4_stream")
    got = gemv_nvfp4_cuda(x, wq, sc, 12.0, cfg)
    want = gemv_nvfp4_twin(x, wq, sc, 12.0)
    g = np.array(got.astype(mx.float32)).astype(np.float64)
    assert np.isfinite(g).all()
    assert _rel(got, np.array(want.astype(mx.float32)).astype(np.float64)) < 2e-3


@needs_cuda
@pytest.mark.cuda
def test_moe_kernel_matches_its_twin_on_cuda() -> None:
    rng = np.random.default_rng(9)
    wq, sc, lhs_mx, gs, _, _, rhs = _moe_case(rng, 8, 64, 160, 40, 3, True)
    rhs = rhs.copy()
    rhs[-5:] = 8
    x = mx.array(rng.standard_normal((40, 160)).astype(np.float32)).astype(mx.bfloat16)
    got = moe_gather_nvfp4(x, wq, sc, gs, lhs_mx, mx.array(rhs))
    want = moe_gather_nvfp4_twin(x, wq, sc, gs, lhs_mx, mx.array(rhs))
    assert np.all(np.array(got.astype(mx.float32))[-5:] == 0.0)
    assert _rel(got, np.array(want.astype(mx.float32)).astype(np.float64)) < 1e-2


# ------------------------------------------------------------------- dispatch and case arms


def _our_build(kernel: str) -> str:
    """A kernel's route on this host: our NVRTC build where a device and NVRTC are here (kept in the
    disk cache), else MLX's JIT."""
    arch = nvrtc.device_arch()
    return f"{'precompiled ' + arch if arch else 'cuda_kernel'}({kernel})"


@pytest.mark.parametrize("tokens", [2, 12])
def test_qmm_custom_and_auto_arms_are_within_tolerance_and_say_what_ran(tokens: int) -> None:
    rng = np.random.default_rng(tokens)
    wl = qmm.build({"tokens": tokens, "n": 32, "k": 96, "dtype": "float32"}, ["native", "custom", "auto"], rng)
    assert list(wl.arms) == ["native", "custom", "auto"] and not wl.unsupported
    (x,) = wl.make_inputs(rng)
    for arm, path in wl.arms.items():
        got = np.array(path.run(x)).astype(np.float64)
        err = float(np.linalg.norm(got - wl.reference(arm, x)) / np.linalg.norm(wl.reference(arm, x)))
        assert err <= path.tolerance, (arm, err)
    route = wl.arms["custom"].route
    if tokens <= 8:
        assert route in (_our_build("gemv_nvfp4_stream"), "mlx-twin(dequantize_exact @ x)")
    else:  # float32: the GEMM twin here; on CUDA the one-expert MoE kernel (the GEMM takes 16-bit x)
        assert route in ("mlx-twin(x @ dequantize_exact)", _our_build("moe_nvfp4_expert_batched") + "[one expert]")
    auto = wl.arms["auto"].auto
    assert auto is not None and dispatch.resolve_standalone(auto).route.startswith("auto:")
    assert wl.arms["custom"].build_seconds > 0


def test_moe_custom_sorted_and_auto_sorted_arms_match_the_reference() -> None:
    rng = np.random.default_rng(5)
    params = {"experts": 4, "top_k": 2, "tokens": 5, "hidden": 64, "expert_width": 32, "dtype": "float32"}
    wl = moe.build(params, ["native-sorted", "custom-sorted", "auto-sorted"], rng)
    x, idx = wl.make_inputs(rng)
    for arm, path in wl.arms.items():
        ref = wl.reference(arm, x, idx)
        got = np.array(path.run(x, idx)).astype(np.float64)
        assert got.shape == ref.shape == (5, 2, 32)
        assert float(np.linalg.norm(got - ref) / np.linalg.norm(ref)) <= path.tolerance, arm
    assert wl.arms["custom-sorted"].route.endswith(",sorted")
    auto = wl.arms["auto-sorted"].auto
    assert auto is not None and dispatch.resolve_standalone(auto).route.startswith("auto:")
    assert wl.arms["custom-sorted"].build_seconds > 0


@needs_cuda
@pytest.mark.cuda
def test_gemv_hardware_scale_conversion_matches_the_bit_trick_on_cuda() -> None:
    rng = np.random.default_rng(11)
    wq, sc, _ = _nvfp4_mlx(rng.standard_normal((128, 512)).astype(np.float32), None)
    x = mx.array(rng.standard_normal((3, 512)).astype(np.float32)).astype(mx.bfloat16)
    a = gemv_nvfp4_cuda(x, wq, sc, None, GemvConfig("ksplit", warps=2, unroll=2, cvt_scales=False))
    b = gemv_nvfp4_cuda(x, wq, sc, None, GemvConfig("ksplit", warps=2, unroll=2, cvt_scales=True))
    assert np.array_equal(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)))
