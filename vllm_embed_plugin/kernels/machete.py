"""A table in Machete's layout (`formats.machete`) on the GPU: vLLM's `machete_prepack_B` builds
it, vLLM's `machete_mm` computes the tied head's logits from it, and a Triton kernel serves
the lookup from the same bytes. CUDA with vLLM's `_C` (Hopper) only; imported lazily.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from vllm import _custom_ops as ops
from vllm.scalar_type import scalar_types

from ..formats import ConversionError, IntFormat, PackedRows
from ..formats.machete import BLOCK_COLS, BLOCK_ELEMENTS, BLOCK_ROWS, MacheteLayout


def repack(fmt: MacheteLayout, packed: PackedRows) -> PackedRows:
    """A row-major CUDA table of `fmt.row_format` in Machete's layout, built by vLLM's own
    `machete_prepack_B`, once vLLM's layout is checked to be the one the lookup reads.
    Consumes `packed`: where no row padding is needed its codes are biased in place, so the
    conversion holds one packed copy beside vLLM's output, not two."""
    check_layout(fmt.bits, fmt.scale_dtype, packed.codes.device)
    padded = fmt.padded_rows(packed.num_rows)
    return fmt.wrap(
        _prepack(fmt, packed, padded), fmt.padded_scales(packed.scales, padded), packed.num_rows
    )


def _prepack(fmt: MacheteLayout, packed: PackedRows, padded: int) -> torch.Tensor:
    """vLLM's prepacked words [cols * bits / 32, padded] of a row-major table (consumed)."""
    codes = packed.codes.view(torch.int32)  # [rows, cols * bits / 32]: GPTQ's words, per row
    if packed.num_rows == padded:
        words = codes
    else:
        words = torch.zeros(padded, codes.shape[1], dtype=torch.int32, device=codes.device)
        words[: packed.num_rows] = codes
    words.bitwise_xor_(fmt.bias_word)  # padding rows become level 0
    # vLLM takes [cols * bits / 32, rows] words with the rows innermost: ours, transposed.
    return ops.machete_prepack_B(words.t(), fmt.scale_dtype, _scalar_type(fmt), fmt.scale_dtype)


def _scalar_type(fmt: MacheteLayout):
    return scalar_types.uint4b8 if fmt.bits == 4 else scalar_types.uint8b128


@functools.cache
def check_layout(bits: int, scale_dtype: torch.dtype, device: torch.device) -> None:
    """Prepack a small random table with vLLM's op and with the reference (`from_rows`): they
    must agree bit for bit, or the lookup would misread another vLLM's layout."""
    fmt = MacheteLayout(IntFormat(f"int{bits}", bits=bits, group_size=64), scale_dtype)
    rows, cols = 2 * BLOCK_ROWS + 8, 2 * BLOCK_COLS  # a padded block row, two column blocks
    generator = torch.Generator(device=device).manual_seed(0)
    packed = fmt.row_format.quantize(torch.randn(rows, cols, device=device, generator=generator))
    expected, _ = fmt.machete_operands(fmt.from_rows(packed, cols))
    if not torch.equal(_prepack(fmt, packed, fmt.padded_rows(rows)), expected):
        raise ConversionError(
            f"vLLM's machete_prepack_B lays out int{bits} codes differently from what this "
            f"plugin's lookup reads (checked on a {rows} x {cols} table); set "
            "VLLM_EMBED_HEAD_KERNEL=plugin"
        )


def linear(fmt: MacheteLayout, table: PackedRows, x: torch.Tensor, cols: int) -> torch.Tensor:
    """Tied-head logits x [..., cols] @ table^T on vLLM's `machete_mm`."""
    words, scales = fmt.machete_operands(table)
    rows = table.num_rows
    x2 = x.reshape(-1, cols)
    if x2.shape[0] == 0:
        return x.new_empty((*x.shape[:-1], rows))
    out = ops.machete_mm(
        a=x2.to(fmt.scale_dtype).contiguous(),
        b_q=words,
        b_type=_scalar_type(fmt),
        b_group_scales=scales,
        b_group_size=fmt.group_size,
    )
    if out.shape[1] != rows:  # rows padded to Machete's block
        out = out[:, :rows].contiguous()
    return out.to(x.dtype).view(*x.shape[:-1], rows)


def lookup(
    fmt: MacheteLayout, table: PackedRows, ids: torch.Tensor, cols: int, dtype: torch.dtype
) -> torch.Tensor:
    """Rows `ids` dequantized to `dtype`, read from Machete's layout (same values as
    `fmt.dequantize_rows`, the torch reference)."""
    words, scales = fmt.machete_operands(table)
    flat = ids.reshape(-1)
    out = torch.empty((flat.numel(), cols), dtype=dtype, device=ids.device)
    if flat.numel() == 0:
        return out.view(*ids.shape, cols)
    block_cols = min(triton.next_power_of_2(cols), 256)
    grid = (triton.cdiv(flat.numel(), LOOKUP_TOKENS), triton.cdiv(cols, block_cols))
    _lookup_kernel[grid](
        flat,
        words.view(torch.uint8),
        scales,
        out,
        flat.numel(),
        cols,
        words.shape[1],
        GROUP=fmt.group_size,
        BITS=fmt.bits,
        BT=LOOKUP_TOKENS,
        BK=block_cols,
        num_warps=4,
    )
    return out.view(*ids.shape, cols)


#: Tokens per lookup program.
LOOKUP_TOKENS = 8
# The layout's constants as Triton compile-time values (a kernel reads no other globals).
_ROWS = tl.constexpr(BLOCK_ROWS)
_COLS = tl.constexpr(BLOCK_COLS)
_ELEMENTS = tl.constexpr(BLOCK_ELEMENTS)


@triton.jit
def _lookup_kernel(
    ids_ptr,
    bytes_ptr,
    scales_ptr,
    out_ptr,
    n_ids,
    cols,
    padded,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    k = tl.program_id(1) * BK + tl.arange(0, BK)
    mask = (t < n_ids)[:, None] & (k < cols)[None, :]
    n = tl.load(ids_ptr + t, mask=t < n_ids, other=0).to(tl.int64)
    # The element offset of (n, k): formats.machete.element_offset, written out for Triton.
    r = n % _ROWS
    c = k % _COLS
    block = (k // _COLS).to(tl.int64)[None, :] * (padded // _ROWS) + (n // _ROWS)[:, None]
    inner = (((r & 7) | ((r >> 4) << 3)) << 7)[:, None] + (
        (((c >> 4) & 3) << 3) | (((c >> 1) & 3) << 5)
    )[None, :]
    r3 = ((r >> 3) & 1)[:, None]
    c0 = (c & 1)[None, :]
    c3 = ((c >> 3) & 1)[None, :]
    if BITS == 4:
        low = r3 | (c3 << 1) | (c0 << 2)
    else:
        low = c0 | (r3 << 1) | (c3 << 2)
    element = block * _ELEMENTS + inner + low
    if BITS == 4:
        byte = tl.load(bytes_ptr + element // 2, mask=mask, other=0).to(tl.int32)
        level = ((byte >> ((element & 1) * 4).to(tl.int32)) & 15) - 8
    else:
        level = tl.load(bytes_ptr + element, mask=mask, other=0).to(tl.int32) - 128
    scale = tl.load(scales_ptr + (k // GROUP)[None, :] * padded + n[:, None], mask=mask, other=0.0)
    value = level.to(tl.float32) * scale.to(tl.float32)
    offsets = t.to(tl.int64)[:, None] * cols + k[None, :]
    tl.store(out_ptr + offsets, value.to(out_ptr.dtype.element_ty), mask=mask)
