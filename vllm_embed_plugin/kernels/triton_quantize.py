"""One-pass GPU conversion for the 8-bit formats without scale search (int8 symmetric or
affine, any group size or per row; fp8 e4m3).

Each program reads a [rows, groups, group_cols] tile of the float table once, finds each
group's scale (and minimum), rounds, and writes codes and scales: the only memory it needs
beyond the output is one flag byte per row for non-finite values. It follows the torch path
on the GPU operation for operation (`x / k` for a Python scalar k is `x * (1/k)` there,
`1.0 / t` a correctly rounded reciprocal, rounding half to even), so its output is
bit-identical to `fmt.quantize` run on the same device.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import triton
import triton.language as tl

from ..formats import ConversionError, Fp8Format, IntFormat, PackedRows, TableFormat
from ..formats.fp8 import E4M3_MAX


@triton.jit
def _rint(y):
    """Round half to even (torch.round), exact for |y| <= 2^22: adding 1.5 * 2^23 leaves no
    fraction bits, so the float32 add rounds. Larger values are clamped first; every caller
    clamps the result to at most 255 anyway."""
    y = tl.minimum(tl.maximum(y, -4194304.0), 4194304.0)
    return (y + 12582912.0) - 12582912.0


@triton.jit
def _safe_recip(scale):
    """Correctly rounded 1/scale, 0 where scale is 0 (fp8 scales are never negative)."""
    ok = scale != 0
    one = tl.full(scale.shape, 1.0, tl.float32)
    return tl.where(ok, tl.math.div_rn(one, tl.where(ok, scale, 1.0)), 0.0)


@triton.jit
def _quantize_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    mins_ptr,
    bad_ptr,
    rows,
    cols,
    code_cols,
    groups,
    x_stride,
    code_stride,
    scale_stride,
    BR: tl.constexpr,
    NG: tl.constexpr,
    GP2: tl.constexpr,
    GROUP: tl.constexpr,
    MODE: tl.constexpr,
    QMIN: tl.constexpr,
    QMAX: tl.constexpr,
    RECIP: tl.constexpr,
):
    """MODE 0: symmetric int (absmax -> QMAX, llama.cpp's Q8_0), 1: affine int, 2: fp8 (absmax -> 448)."""
    pid_r = tl.program_id(0)
    pid_g = tl.program_id(1)
    r = (pid_r * BR + tl.arange(0, BR)).to(tl.int64)
    g = pid_g * NG + tl.arange(0, NG)
    j = tl.arange(0, GP2)
    if GROUP == 0:
        gcols = cols
    else:
        gcols = GROUP
    c = g[None, :, None] * gcols + j[None, None, :]
    rmask = r < rows
    valid = rmask[:, None, None] & (j < gcols)[None, None, :] & (c < cols)
    x = tl.load(x_ptr + r[:, None, None] * x_stride + c, mask=valid, other=0).to(tl.float32)

    finite = (x == x) & (tl.abs(x) < float("inf"))
    bad = tl.max(tl.max((valid & ~finite).to(tl.int32), axis=2), axis=1)
    tl.store(bad_ptr + r, bad.to(tl.int8), mask=rmask & (bad > 0))

    sdt = scales_ptr.dtype.element_ty
    if MODE == 2:
        amax = tl.max(tl.abs(x), axis=2)
        scale = (amax * RECIP).to(sdt).to(tl.float32)
        inv = _safe_recip(scale)
        y = tl.minimum(tl.maximum(x * inv[:, :, None], -QMAX), QMAX)
        codes = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    elif MODE == 0:
        amax = tl.max(tl.abs(x), axis=2)
        scale = (amax * RECIP).to(sdt).to(tl.float32)
        inv = _safe_recip(scale)
        lev = _rint(x * inv[:, :, None])
        lev = tl.minimum(tl.maximum(lev, QMIN), QMAX)
        codes = lev.to(tl.int32).to(tl.int8).to(tl.uint8, bitcast=True)
    else:
        big = 3.4028234663852886e38
        xmin = tl.min(tl.where(valid, x, big), axis=2)
        xmax = tl.max(tl.where(valid, x, -big), axis=2)
        span = tl.maximum(xmax - xmin, 0.0)
        scale = (span * RECIP).to(sdt).to(tl.float32)
        mins = xmin.to(sdt).to(tl.float32)
        inv = _safe_recip(scale)
        lev = _rint((x - mins[:, :, None]) * inv[:, :, None])
        lev = tl.minimum(tl.maximum(lev, QMIN), QMAX)
        codes = lev.to(tl.int32).to(tl.uint8)
    # Columns past `cols` up to the packed row's end (a multiple of 8) hold zero codes.
    codes = tl.where(valid, codes, 0)
    cmask = rmask[:, None, None] & (c < code_cols) & ((j < gcols)[None, None, :] | (c >= cols))
    tl.store(codes_ptr + r[:, None, None] * code_stride + c, codes, mask=cmask)
    smask = rmask[:, None] & (g < groups)[None, :]
    soff = r[:, None] * scale_stride + g[None, :]
    tl.store(scales_ptr + soff, scale.to(sdt), mask=smask)
    if MODE == 1:
        tl.store(mins_ptr + soff, mins.to(sdt), mask=smask)


def _device_view(out: PackedRows, device: torch.device) -> PackedRows | None:
    """`out` as tensors the kernel can write on `device`: itself, or CUDA views of pinned
    host storage; None if neither (e.g. pageable host memory, strided last dimension)."""
    from .host import cuda_view_of_pinned

    tensors = {}
    for name, t in out.tensors().items():
        if t.stride(-1) != 1:
            return None
        if t.device == device:
            tensors[name] = t
        elif t.device.type == "cpu" and t.is_pinned() and device.type == "cuda":
            tensors[name] = cuda_view_of_pinned(t, device)
        else:
            return None
    return PackedRows(**tensors)


def _recip(k: float) -> float:
    """float32(1) / float32(k), as torch's CUDA division by a Python scalar computes it."""
    return float(np.float32(1.0) / np.float32(k))


def quantize_rows_fast(
    fmt: TableFormat, rows: torch.Tensor, out: PackedRows | None = None
) -> PackedRows | None:
    """Quantize a whole [n, cols] CUDA table in one pass, or None when `fmt` or the input is
    not one this kernel handles (the caller then uses the torch path). Raises ConversionError
    if a row holds NaN or Inf.

    `out`: storage to fill (default: fresh storage on the table's device). Pinned host
    storage is written directly through CUDA views of it (kernels.host), without a copy."""
    on_device = rows.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    if not on_device or rows.dim() != 2 or rows.stride(-1) != 1 or not rows.is_floating_point():
        return None
    if isinstance(fmt, IntFormat) and fmt.bits == 8 and fmt.search == 0:
        mode = 0 if fmt.symmetric else 1
        qmin, qmax = (-127.0, 127.0) if fmt.symmetric else (0.0, 255.0)
        recip = _recip(127.0 if fmt.symmetric else 255.0)
    elif isinstance(fmt, Fp8Format):
        mode, qmin, qmax, recip = 2, -E4M3_MAX, E4M3_MAX, _recip(E4M3_MAX)
    else:
        return None
    n, cols = rows.shape
    if out is None:
        out = fmt.empty(n, cols, rows.device)
        dst = out
    else:
        dst = _device_view(out, rows.device)
        if dst is None:
            return None
    if n == 0:
        return out
    gcols = cols if fmt.group_size is None else fmt.group_size
    groups = fmt.num_groups(cols)
    gp2 = max(8, triton.next_power_of_2(gcols))
    ng = max(1, min(triton.next_power_of_2(groups), 4096 // gp2))
    br = max(1, min(8, 4096 // (gp2 * ng)))
    warps = max(1, min(8, br * ng * gp2 // 512))
    bad = torch.zeros(n, dtype=torch.int8, device=rows.device)
    mins = dst.mins if dst.mins is not None else dst.scales
    grid = (triton.cdiv(n, br), triton.cdiv(groups, ng))
    _quantize_kernel[grid](
        rows,
        dst.codes,
        dst.scales,
        mins,
        bad,
        n,
        cols,
        dst.codes.shape[1],
        groups,
        rows.stride(0),
        dst.codes.stride(0),
        dst.scales.stride(0),
        BR=br,
        NG=ng,
        GP2=gp2,
        GROUP=0 if fmt.group_size is None else gcols,
        MODE=mode,
        QMIN=qmin,
        QMAX=qmax,
        RECIP=recip,
        num_warps=warps,
        enable_fp_fusion=False,
    )
    flagged = torch.nonzero(bad)
    if flagged.numel():
        raise ConversionError(f"row {int(flagged[0, 0])} of the table holds NaN or Inf")
    return out
