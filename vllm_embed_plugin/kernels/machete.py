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
from ..formats.machete import BLOCK_COLS, BLOCK_ROWS, MacheteLayout


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
    return ops.machete_prepack_B(
        words.t(), fmt.scale_dtype, _scalar_type(fmt.bits), fmt.scale_dtype
    )


def _scalar_type(bits: int):
    return scalar_types.uint4b8 if bits == 4 else scalar_types.uint8b128


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
        b_type=_scalar_type(fmt.bits),
        b_group_scales=scales,
        b_group_size=fmt.group_size,
        schedule=_schedule(fmt, x2.shape[0], words.shape[1], cols),
    )
    if out.shape[1] != rows:  # rows padded to Machete's block
        out = out[:, :rows].contiguous()
    return out.to(x.dtype).view(*x.shape[:-1], rows)


#: Machete's own heuristic (vLLM's csrc/quantization/machete/generate.py, tuned on H100) gives
#: M = 33..128 tiles 128 rows wide, unless K >= 16,384 / 8,192 and N >= 12,288, where it takes
#: 256. On vocabulary-sized heads, tiles 256 rows wide are faster there at any K, with
#: the same bits (H200, 262,144 x 2,560 and 151,936 x 4,096): int4 by 3-20% on both, int8 by
#: 5-12% at 2,560 columns; int8 at 4,096 went from 1% faster to 11% slower, so it keeps
#: Machete's choice there, as does every size outside 33..128.
WIDE_HEAD_ROWS = 32768
WIDE_HEAD_INT8_MAX_COLS = 2560
WIDE_HEAD_SCHEDULES = (
    (64, "256x64_2x1x1_TmaMI__TmaCoop_streamK"),
    (128, "256x128_2x1x1_TmaMI__TmaCoop_streamK"),
)


def _schedule(fmt: MacheteLayout, m: int, rows: int, cols: int) -> str | None:
    """The Machete schedule for m tokens on a rows x cols table, or None for Machete's own."""
    if rows < WIDE_HEAD_ROWS or m <= 32 or (fmt.bits == 8 and cols > WIDE_HEAD_INT8_MAX_COLS):
        return None
    for most, schedule in WIDE_HEAD_SCHEDULES:
        if m <= most and schedule in _supported_schedules(fmt.bits, fmt.scale_dtype):
            return schedule
    return None


@functools.cache
def _supported_schedules(bits: int, scale_dtype: torch.dtype) -> frozenset[str]:
    return frozenset(ops.machete_supported_schedules(scale_dtype, _scalar_type(bits), scale_dtype))


def lookup(
    fmt: MacheteLayout, table: PackedRows, ids: torch.Tensor, cols: int, dtype: torch.dtype
) -> torch.Tensor:
    """Rows `ids` dequantized to `dtype`, read from Machete's layout (same values as
    `fmt.dequantize_rows`, the torch reference)."""
    words, scales = fmt.machete_operands(table)
    if words.numel() >= 2**31:  # the kernel's offsets are int32
        raise ValueError(f"a Machete table of {words.numel()} words is too large to look up")
    flat = ids.reshape(-1)
    out = torch.empty((flat.numel(), cols), dtype=dtype, device=ids.device)
    if flat.numel() == 0:
        return out.view(*ids.shape, cols)
    block_cols = max(fmt.group_size, min(triton.next_power_of_2(cols), LOOKUP_COLS))
    grid = (triton.cdiv(flat.numel(), LOOKUP_TOKENS), triton.cdiv(cols, block_cols))
    _lookup_kernel[grid](
        flat,
        words,
        scales,
        out,
        flat.numel(),
        cols,
        words.shape[1],
        GROUP=fmt.group_size,
        BITS=fmt.bits,
        BT=LOOKUP_TOKENS,
        BK=block_cols,
        num_warps=LOOKUP_WARPS,
    )
    return out.view(*ids.shape, cols)


#: Tokens per lookup program and its warps: one octet per thread (measured best on an H200,
#: against 1-8 tokens, 1-8 warps and 256-1,024 columns).
LOOKUP_TOKENS = 2
LOOKUP_WARPS = 2
#: Columns per lookup program, at most.
LOOKUP_COLS = 256
# The layout's constants as Triton compile-time values (a kernel reads no other globals).
_ROWS = tl.constexpr(BLOCK_ROWS)
_COLS = tl.constexpr(BLOCK_COLS)


@triton.jit
def _lookup_kernel(
    ids_ptr,
    words_ptr,
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
    """BT tokens x BK columns, in octets of 8 adjacent columns: an octet's codes lie in 4
    int32 words of its row's 128-code run, two codes per word, so a thread loads 4 words,
    computes int32 offsets (checked by the launcher) once per octet, and stores 8 values."""
    NG: tl.constexpr = BK // GROUP
    OCTETS: tl.constexpr = GROUP // 8
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    token = (t < n_ids)[:, None, None]
    n = tl.load(ids_ptr + t, mask=t < n_ids, other=0).to(tl.int32)[:, None, None]  # [BT, 1, 1]
    g = (tl.program_id(1) * NG + tl.arange(0, NG))[None, :, None]  # group, [1, NG, 1]
    k = g * GROUP + 8 * tl.arange(0, OCTETS)[None, None, :]  # the octet's first column
    mask = token & (k < cols)
    # formats.machete.element_offset, per octet: the block; the run of 128 codes of rows n
    # and n ^ 8 in it; q = column bits 3..5, fixed in the octet; bits 1, 2 pick the word
    # (`word_step` apart) and bit 0 the code in the word (`odd_shift` apart).
    r = n % _ROWS
    q = (k % _COLS) >> 3
    block = (k // _COLS) * (padded // _ROWS) + n // _ROWS
    run = (r & 7) | ((r >> 4) << 3)
    r3 = (r >> 3) & 1
    if BITS == 4:  # a word: row bit 3, column bits 3, 0; the run: column bits 4, 5, 1, 2
        first = q >> 1
        shift = 4 * (r3 + 2 * (q & 1))
        word_step: tl.constexpr = 4
        odd_shift: tl.constexpr = 16
    else:  # a word: column bit 0, row bit 3; the run: column bits 3, 4, 5, 1, 2
        first = q
        shift = 16 * r3
        word_step: tl.constexpr = 8
        odd_shift: tl.constexpr = 8
    base = words_ptr + block * (256 * BITS) + run * (4 * BITS) + first
    scale = tl.load(scales_ptr + g * padded + n, mask=token & (g * GROUP < cols), other=0.0)
    scale = scale.to(tl.float32)
    w0 = tl.load(base, mask=mask, other=0)
    w1 = tl.load(base + word_step, mask=mask, other=0)
    w2 = tl.load(base + 2 * word_step, mask=mask, other=0)
    w3 = tl.load(base + 3 * word_step, mask=mask, other=0)
    # Columns 8q + 2a + b: word a, code b.
    v0 = _level(w0, shift, BITS, scale)
    v1 = _level(w0, shift + odd_shift, BITS, scale)
    v2 = _level(w1, shift, BITS, scale)
    v3 = _level(w1, shift + odd_shift, BITS, scale)
    v4 = _level(w2, shift, BITS, scale)
    v5 = _level(w2, shift + odd_shift, BITS, scale)
    v6 = _level(w3, shift, BITS, scale)
    v7 = _level(w3, shift + odd_shift, BITS, scale)
    # join(a, b) adds a minor axis of 2: leaves in bit-reversed order come out as v0..v7.
    values = tl.join(
        tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7))
    )
    values = tl.reshape(values, [BT, BK])
    col = tl.program_id(1) * BK + tl.arange(0, BK)
    offsets = t.to(tl.int64)[:, None] * cols + col[None, :]
    out_mask = (t < n_ids)[:, None] & (col < cols)[None, :]
    tl.store(out_ptr + offsets, values.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _level(word, shift, BITS: tl.constexpr, scale):
    """The biased code at `shift` in `word`, as a signed level times `scale` (float32)."""
    half: tl.constexpr = 1 << (BITS - 1)
    return (((word >> shift) & (2 * half - 1)) - half).to(tl.float32) * scale
