"""The NVFP4 weight format in NumPy: the reference every kernel path is checked against.

NVFP4 stores each weight as a 4-bit E2M1 code (sign, 2 exponent bits, 1 mantissa bit: the 16
values ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}), one FP8 E4M3 scale per 16 consecutive weights along the
reduction axis, and an optional FP32 per-tensor global scale. A weight decodes as

    w = E2M1[code] * E4M3[scale]                              (no global scale)
    w = E2M1[code] * E4M3[scale] * global_scale / 2688        (MLX's global-scale convention)

2688 = 6 x 448, the largest E2M1 value times the largest E4M3 value, so MLX's `global_scale` is
about the tensor's absolute maximum. ModelOpt checkpoints store the *decode* scale instead
(`weight_scale_2` = amax / 2688); `global_scale_from_modelopt` converts it. Passing the decode
scale straight to MLX is a classic bug (relative error ~1.0), which the tests pin down.

Rounding follows MLX 0.32.4 (`mx.quantize(w, mode="nvfp4")`), so the codes and scales are equal
bit for bit: the block scale is amax/6 (times 2688/global_scale) rounded to nearest-even E4M3
with saturation to 448; each weight divided by its block scale (times 2688/global_scale) rounds
to the nearest E2M1 value. MLX's backends differ in the details, and `like` picks one:
"mlx-gpu" (Metal and CUDA kernels, and the format's definition: float32 arithmetic, multiply by
the reciprocal scale, ties to even, the sign kept on zero, code 8) or "mlx-cpu" (the CPU backend:
arithmetic in the weights' dtype, a true division, ties toward zero, +0). They differ only at
exact ties, which random float32 weights almost never hit but bfloat16 weights do (a few per
thousand); the sign of zero never changes a value. A block whose E4M3 scale rounds to zero
(amax / 6, times 2688 / global_scale, at most 2^-10: half E4M3's smallest subnormal) decodes to
zeros whatever its codes: the reference writes code 0 there, as MLX's CPU and Metal kernels do;
MLX's CUDA kernel writes ±6 (it multiplies by 1/0). Checked bit for bit against MLX 0.32.4 on
its CPU backend and on CUDA (Hopper) for float32, bfloat16 and float16 weights, with and without
a global scale.

`pack_codes` / `unpack_codes` convert between one code per uint8 and MLX's layout (eight codes per
uint32, element 0 in the lowest 4 bits), so an arm can be built from the reference's own codes.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import numpy.typing as npt

GROUP_SIZE = 16  # weights per E4M3 scale
E2M1_MAX = 6.0
E4M3_MAX = 448.0
MLX_GLOBAL_SCALE_DIVISOR = E2M1_MAX * E4M3_MAX  # 2688: MLX dequantizes raw * global_scale / 2688

# Code point -> value. Bit 3 is the sign; codes 0..7 are +{0, .5, 1, 1.5, 2, 3, 4, 6}.
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)

FloatArray = npt.NDArray[np.floating]
Codes = npt.NDArray[np.uint8]
Quantizer = Literal["mlx-gpu", "mlx-cpu"]
Precision = Literal["float32", "bfloat16", "float16"]
GlobalScale = float | np.floating[Any]


def global_scale_from_modelopt(weight_scale_2: GlobalScale) -> np.float32:
    """MLX's `global_scale` from a ModelOpt checkpoint's `weight_scale_2` (its decode scale).

    ModelOpt decodes `raw * weight_scale_2`; MLX decodes `raw * global_scale / 2688`, so
    `global_scale = 2688 * weight_scale_2`.
    """
    return np.float32(np.float32(weight_scale_2) * np.float32(MLX_GLOBAL_SCALE_DIVISOR))


def natural_global_scale(w: FloatArray) -> np.float32:
    """The global scale that uses the whole E4M3 x E2M1 range: the tensor's absolute maximum."""
    return np.float32(np.max(np.abs(np.asarray(w, dtype=np.float32))))


def encode_e4m3(x: FloatArray) -> Codes:
    """Round float32 values to FP8 E4M3 (fn: no infinities) bits, nearest-even, saturating at 448.

    Mirrors MLX's (and PyTorch's) conversion: magnitudes at or above 464 (the midpoint past 448),
    infinities and NaN saturate to 448 (0x7E) with their sign.
    """
    f = np.ascontiguousarray(x, dtype=np.float32)
    bits = f.view(np.uint32)
    sign = bits & np.uint32(0x80000000)
    mag = bits ^ sign
    out = np.zeros(f.shape, dtype=np.uint32)

    saturate = mag >= np.uint32(543 << 21)  # 464.0
    subnormal = mag < np.uint32(121 << 23)  # below 2^-6, the smallest normal E4M3
    normal = ~saturate & ~subnormal

    # Subnormals: adding 0.5 (as float) aligns the mantissa so float rounding does the RNE.
    denorm_mask = np.uint32(141 << 23)
    sub_f = mag[subnormal].view(np.float32) + denorm_mask.view(np.float32)
    out[subnormal] = sub_f.view(np.uint32) - denorm_mask
    # Normals: rebias the exponent (127 -> 7) and round the 23-bit mantissa to 3 bits, ties to even.
    m = mag[normal]
    mant_odd = (m >> np.uint32(20)) & np.uint32(1)
    m = m + np.uint32(((7 - 127) << 23) & 0xFFFFFFFF) + np.uint32(0x7FFFF) + mant_odd
    out[normal] = m >> np.uint32(20)
    out[saturate] = 0x7E
    return ((out & np.uint32(0xFF)) | (sign >> np.uint32(24))).astype(np.uint8)


def decode_e4m3(bits: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """FP8 E4M3 bits -> float32 (exact). 0x7F / 0xFF are NaN; there are no infinities."""
    b = np.asarray(bits, dtype=np.uint8).astype(np.int32)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp = (b >> 3) & 0xF
    mant = b & 0x7
    normal = (1.0 + mant / 8.0) * np.exp2(exp - 7.0)
    subnormal = (mant / 8.0) * 2.0**-6
    val = sign * np.where(exp == 0, subnormal, normal)
    val = np.where((b & 0x7F) == 0x7F, np.nan, val)
    return val.astype(np.float32)


# Midpoints between neighbouring E2M1 magnitudes; a magnitude above the i-th one codes as i+1 or more.
_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)
# Nearest-even sends the ties at 0.75, 1.75 and 3.5 up (to the even mantissa): compare against the
# float32 just below them.
_MIDPOINTS_EVEN = np.where(
    np.isin(_MIDPOINTS, [0.75, 1.75, 3.5]), np.nextafter(_MIDPOINTS, np.float32(0)), _MIDPOINTS
).astype(np.float32)


def encode_e2m1(x: FloatArray, like: Quantizer = "mlx-gpu") -> Codes:
    """Round float32 values to E2M1 code points, saturating at ±6 (NaN -> 6).

    Args:
        x: values already divided by their block scale.
        like: "mlx-gpu" rounds to nearest, ties to even, and a value that rounds to zero keeps its
            sign (code 8): the format's definition (NVIDIA's `cvt.rn.satfinite.e2m1`) and MLX's
            Metal and CUDA kernels. "mlx-cpu" is MLX 0.32.4's CPU backend: exact ties go toward
            zero, and zero is always code 0.
    """
    f = np.asarray(x, dtype=np.float32)
    if like == "mlx-gpu":
        midpoints = _MIDPOINTS_EVEN
    elif like == "mlx-cpu":
        midpoints = _MIDPOINTS
    else:
        raise ValueError(f"unknown quantizer {like!r}")
    nan = np.isnan(f)
    a = np.abs(f)
    code = np.zeros(f.shape, dtype=np.uint8)
    for m in midpoints:  # seven vector compares: several times faster than searchsorted
        code += a > m
    np.copyto(code, np.uint8(7), where=nan)
    negative = np.signbit(f) & ~nan
    if like == "mlx-cpu":
        negative &= code != 0
    code |= negative.view(np.uint8) << np.uint8(3)
    return code


def _check_groups(w: np.ndarray) -> None:
    if w.ndim < 1 or w.shape[-1] % GROUP_SIZE:
        raise ValueError(f"NVFP4 needs the last axis divisible by {GROUP_SIZE}, got shape {w.shape}")


def round_to_precision(x: FloatArray, precision: Precision) -> npt.NDArray[np.float32]:
    """Round float32 values to bfloat16 or float16 (nearest-even) and back; float32 is a no-op."""
    f = np.ascontiguousarray(x, dtype=np.float32)
    if precision == "float32":
        return f
    if precision == "float16":
        with np.errstate(over="ignore"):
            return f.astype(np.float16).astype(np.float32)
    if precision == "bfloat16":
        bits = f.view(np.uint32)
        lsb = (bits >> np.uint32(16)) & np.uint32(1)
        rounded = (bits + np.uint32(0x7FFF) + lsb) & np.uint32(0xFFFF0000)
        return np.where(np.isnan(f), f, rounded.view(np.float32))
    raise ValueError(f"unknown precision {precision!r}")


def quantize(
    w: npt.ArrayLike,
    global_scale: GlobalScale | None = None,
    like: Quantizer = "mlx-gpu",
    precision: Precision = "float32",
) -> tuple[Codes, Codes]:
    """Quantize weights to NVFP4 along the last axis, exactly as `mx.quantize(..., mode="nvfp4")`.

    Args:
        w: weights [..., K], K divisible by 16 (values are taken as float32).
        global_scale: MLX-convention global scale (about amax |w|), or None for none.
        like: whose arithmetic to reproduce bit for bit. "mlx-gpu" (the default; MLX's Metal and
            CUDA kernels and the format's definition): float32 throughout, each weight times the
            float32 reciprocal `(2688 / global_scale) / scale`, nearest-even. "mlx-cpu" (MLX's CPU
            backend): `w / scale` rounded to `precision`, then times `2688 / global_scale`, ties
            toward zero (see `encode_e2m1`).
        precision: with "mlx-cpu", the dtype MLX's CPU backend works in: the weights' own
            (the block scale amax / 6 and w / scale are rounded to it). Ignored by "mlx-gpu".

    Returns:
        (codes, scales): E2M1 code points 0..15 as uint8 [..., K] and E4M3 scale bits as uint8
        [..., K/16].
    """
    wf = np.asarray(w, dtype=np.float32)
    _check_groups(wf)
    if like == "mlx-gpu":
        precision = "float32"
    groups = wf.reshape(*wf.shape[:-1], wf.shape[-1] // GROUP_SIZE, GROUP_SIZE)
    scale_enc = np.float32(1.0)
    if global_scale is not None:
        scale_enc = np.float32(MLX_GLOBAL_SCALE_DIVISOR) / np.float32(global_scale)
    amax = np.max(np.abs(groups), axis=-1)
    block_scale = round_to_precision(amax / np.float32(E2M1_MAX), precision) * scale_enc
    scales = encode_e4m3(block_scale)
    decoded = decode_e4m3(scales)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        if like == "mlx-gpu":
            scaled = groups * np.where(decoded == 0, np.float32(0.0), scale_enc / decoded)
        else:
            scaled = round_to_precision(groups / decoded, precision) * scale_enc
    scaled = np.where(decoded == 0, np.float32(0.0), scaled)
    codes = encode_e2m1(scaled, like)
    return codes.reshape(wf.shape), scales


def dequantize(
    codes: npt.ArrayLike,
    scales: npt.ArrayLike,
    global_scale: GlobalScale | None = None,
    dtype: npt.DTypeLike = np.float64,
) -> FloatArray:
    """Decode NVFP4: `E2M1[code] * E4M3[scale]` (times `global_scale / 2688` when given).

    Args:
        codes: E2M1 code points 0..15, uint8 [..., K].
        scales: E4M3 scale bits, uint8 [..., K/16].
        global_scale: MLX-convention global scale, or None.
        dtype: the result's dtype (computed in float32 as MLX does, then cast).

    Returns:
        The weights [..., K].
    """
    c = np.asarray(codes, dtype=np.uint8)
    s = np.asarray(scales, dtype=np.uint8)
    _check_groups(c)
    if s.shape != (*c.shape[:-1], c.shape[-1] // GROUP_SIZE):
        raise ValueError(f"scales shape {s.shape} does not match codes shape {c.shape}")
    # MLX's order of float32 operations, so that the values are equal bit for bit:
    # E2M1 * (E4M3 * (global_scale / 2688)). Without a global scale the product is exact.
    values = E2M1_VALUES[c & 0xF]
    per_group = decode_e4m3(s)
    if global_scale is not None:
        per_group = per_group * (np.float32(global_scale) / np.float32(MLX_GLOBAL_SCALE_DIVISOR))
    out = values.reshape(*s.shape, GROUP_SIZE) * per_group[..., None]
    return out.reshape(c.shape).astype(dtype)


# A byte of MLX's packed words holds two codes (element 2j in its low nibble, 2j+1 in its high one),
# and a group's 16 codes are 8 bytes under one E4M3 scale. Tabulated from the definitions above:
# byte -> its two E2M1 values, E4M3 bits -> value, and (scale, byte) -> the two weights in float64
# (1 MiB; E2M1 x E4M3 is exact in float32, so these are `dequantize`'s values bit for bit).
_E2M1_PAIRS = np.stack([E2M1_VALUES[np.arange(256) & 0xF], E2M1_VALUES[np.arange(256) >> 4]], axis=-1)
_E4M3_TABLE = decode_e4m3(np.arange(256, dtype=np.uint8))
_WEIGHT_PAIRS = (_E4M3_TABLE[:, None, None] * _E2M1_PAIRS[None]).astype(np.float64).reshape(256 * 256, 2)


def dequantize_packed(
    packed: npt.ArrayLike,
    scales: npt.ArrayLike,
    global_scale: GlobalScale | None = None,
    dtype: npt.DTypeLike = np.float64,
) -> FloatArray:
    """`dequantize(unpack_codes(packed), scales, global_scale, dtype)`, equal bit for bit, from MLX's
    packed words by table look-ups (`np.take`, a byte's two weights at once), several times faster
    than unpacking the codes first. The float64 reference of a seeds'-shape job decodes 1024 x
    5376 weights on the host in each fresh job process.

    Args:
        packed: MLX-packed codes, uint32 [..., K/8].
        scales: E4M3 scale bits, uint8 [..., K/16].
        global_scale: MLX-convention global scale, or None.
        dtype: the result's dtype.
    """
    p = np.ascontiguousarray(packed, dtype=np.uint32)
    s = np.asarray(scales, dtype=np.uint8)
    k = p.shape[-1] * 8
    if k % GROUP_SIZE or s.shape != (*p.shape[:-1], k // GROUP_SIZE):
        raise ValueError(f"scales shape {s.shape} does not match packed codes shape {p.shape}")
    if not np.little_endian:  # the byte view below assumes the low nibble in the first byte
        return dequantize(unpack_codes(p), s, global_scale, dtype)
    groups = p.view(np.uint8).reshape(*s.shape, GROUP_SIZE // 2)  # [..., K/16, 8]: a group's bytes
    if global_scale is None and np.dtype(dtype) == np.float64:
        at = s.astype(np.intp)[..., None] * 256 + groups
        return np.take(_WEIGHT_PAIRS, at, axis=0).reshape(*s.shape[:-1], k)
    # MLX's float32 order, as `dequantize`: E2M1 * (E4M3 * (global_scale / 2688)), then the dtype
    per_group = np.take(_E4M3_TABLE, s)
    if global_scale is not None:
        per_group = per_group * (np.float32(global_scale) / np.float32(MLX_GLOBAL_SCALE_DIVISOR))
    values = np.take(_E2M1_PAIRS, groups, axis=0).reshape(*s.shape, GROUP_SIZE)
    values *= per_group[..., None]
    return values.reshape(*s.shape[:-1], k).astype(dtype, copy=False)


def pack_codes(codes: npt.ArrayLike) -> npt.NDArray[np.uint32]:
    """Pack code points [..., K] into MLX's layout: uint32 [..., K/8], element 0 in bits 0-3."""
    c = np.asarray(codes, dtype=np.uint32)
    if c.shape[-1] % 8:
        raise ValueError(f"packing needs the last axis divisible by 8, got shape {c.shape}")
    c = c.reshape(*c.shape[:-1], c.shape[-1] // 8, 8) & np.uint32(0xF)
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    return np.bitwise_or.reduce(c << shifts, axis=-1).astype(np.uint32)


def unpack_codes(packed: npt.ArrayLike) -> Codes:
    """Unpack MLX's uint32 [..., K/8] layout into one code point per uint8 [..., K]."""
    p = np.asarray(packed, dtype=np.uint32)
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    codes = (p[..., None] >> shifts) & np.uint32(0xF)
    return codes.reshape(*p.shape[:-1], p.shape[-1] * 8).astype(np.uint8)
