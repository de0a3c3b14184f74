"""Joint rounding of one group of columns on CUDA (GPTQ's inner loop), one launch per group.

Each program holds a [rows, group] tile in registers and rounds its columns in order, moving
each column's error into the columns after it, exactly as `round_group_jointly_torch` does
operation for operation (levels may still differ where the compiler fuses a multiply-add).
The torch loop costs several launches per column, which made a 248320 x 5120 table take
minutes; this takes one per group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_quantize import _rint, _safe_recip


@triton.jit
def _round_group_kernel(
    values_ptr,
    values_stride,
    step_ptr,
    low_ptr,
    step_stride,
    factor_ptr,
    factor_stride,
    levels_ptr,
    carried_ptr,
    out_stride,
    rows,
    width,
    QMIN: tl.constexpr,
    QMAX: tl.constexpr,
    BR: tl.constexpr,
    G: tl.constexpr,
):
    r = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    c = tl.arange(0, G)
    rmask = r < rows
    cmask = c < width
    mask = rmask[:, None] & cmask[None, :]
    tile = tl.load(values_ptr + r[:, None] * values_stride + c[None, :], mask=mask, other=0.0)
    levels = tl.zeros([BR, G], dtype=tl.float32)
    carried = tl.zeros([BR, G], dtype=tl.float32)
    for j in range(0, width):
        here = (c == j)[None, :]
        value = tl.sum(tl.where(here, tile, 0.0), axis=1)
        # Each column has its own group's scale: the columns of a block may mix groups.
        step = tl.load(step_ptr + r * step_stride + j, mask=rmask, other=0.0)
        low = tl.load(low_ptr + r * step_stride + j, mask=rmask, other=0.0)
        inv = _safe_recip(step)
        level = tl.minimum(tl.maximum(_rint((value - low) * inv), QMIN), QMAX)
        back = level * step
        back = back + low
        error = tl.math.div_rn(value - back, tl.load(factor_ptr + j * factor_stride + j))
        later = tl.load(factor_ptr + j * factor_stride + c, mask=(c > j) & cmask, other=0.0)
        tile = tile - error[:, None] * later[None, :]
        levels = tl.where(here, level[:, None], levels)
        carried = tl.where(here, error[:, None], carried)
    out = r[:, None] * out_stride + c[None, :]
    tl.store(levels_ptr + out, levels, mask=mask)
    tl.store(carried_ptr + out, carried, mask=mask)


def round_group_jointly(
    values: torch.Tensor,
    step: torch.Tensor,
    low: torch.Tensor,
    factor: torch.Tensor,
    bits: int,
    symmetric: bool,
):
    """(levels, carried errors) [rows, width] float32 for step and low [rows, width]; None if
    the group is too wide."""
    rows, width = values.shape
    if width > 256 or values.dtype != torch.float32 or values.stride(1) != 1:
        return None
    qmin, qmax = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if symmetric else (0, 2**bits - 1)
    group = triton.next_power_of_2(width)
    block_rows = max(1, 2048 // group)
    levels = torch.empty(rows, width, device=values.device, dtype=torch.float32)
    carried = torch.empty_like(levels)
    factor = factor.contiguous()
    step = step.float().contiguous()
    low = low.float().contiguous()
    grid = (triton.cdiv(rows, block_rows),)
    _round_group_kernel[grid](
        values,
        values.stride(0),
        step,
        low,
        step.stride(0),
        factor,
        factor.stride(0),
        levels,
        carried,
        width,
        rows,
        width,
        QMIN=float(qmin),
        QMAX=float(qmax),
        BR=block_rows,
        G=group,
        num_warps=4,
    )
    return levels, carried
