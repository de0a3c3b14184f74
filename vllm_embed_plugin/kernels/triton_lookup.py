"""One fused Triton kernel for the lookup: token id -> packed row -> unpack -> dequantize -> out.

A row is read in *chunks* of eight values, which is `bits` bytes for the integer formats and
eight bytes for fp8 -- the unit the storage layout repeats in. Each chunk is loaded as
`bits / unit_bytes` integer units (unit_bytes = gcd(bits, 8): int8 and fp8 read one 8-byte
word per chunk, 4-bit one 4-byte word, 3- and 7-bit single bytes), glued into one word, and
split into its eight values with compile-time shifts. 5- and 6-bit rows are two planes
(`formats.integer.high_bits`): a chunk is one 4-byte word of low nibbles and a 1- or 2-byte
field of high bits, each read whole. The eight pieces are interleaved back into column order
with `tl.join`, so a thread ends up holding contiguous columns and writes them with wide
stores.

Everything that varies between formats -- bits, group size (or one scale per row), signed or
affine, fp8, the scale and output dtypes -- is a compile-time constant, so every format gets
its own specialised code from this one source. The launch reads only device tensors and
allocates only the output (its shape depends on the number of tokens, never on their
values): CUDA graphs capture it.

The arithmetic is the reference's (`fmt.dequantize`): level (or fp8 value) in float32, times
the float32 scale, plus the float32 minimum, rounded once to the output dtype; fused
multiply-add is switched off for affine formats, so the output is bit-identical.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..formats import Fp8Format, IntFormat, PackedRows, TableFormat
from ..formats.integer import high_bits

# -- the shared unpack/dequantize step (also used by the tied-head GEMM) --------------------


@triton.jit
def _piece(
    w,
    h,
    V: tl.constexpr,
    BITS: tl.constexpr,
    HIGH: tl.constexpr,
    SIGNED: tl.constexpr,
    FP8: tl.constexpr,
    scale,
    mn,
    APPLY_SCALE: tl.constexpr,
    HAS_MIN: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
):
    """Value V (0..7) of every chunk word `w`, dequantized to OUT_DTYPE. HIGH: `w` holds the
    chunk's low nibbles and `h` its HIGH-bit high parts."""
    if FP8:
        q = ((w >> (8 * V)) & 0xFF).to(tl.uint8)
        v = q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        if HIGH:
            q = ((w >> (4 * V)) & 15) | (((h >> (HIGH * V)) & ((1 << HIGH) - 1)) << 4)
        else:
            q = (w >> (V * BITS)) & ((1 << BITS) - 1)
        q = q.to(tl.int32)
        if SIGNED:
            q = (q ^ (1 << (BITS - 1))) - (1 << (BITS - 1))
        v = q.to(tl.float32)
    if APPLY_SCALE:
        v = v * scale
        if HAS_MIN:
            v = v + mn
    return v.to(OUT_DTYPE)


@triton.jit
def _gather(base, mask, N: tl.constexpr, UNIT_BITS: tl.constexpr, WIDE: tl.constexpr):
    """N consecutive units of UNIT_BITS bits from `base`, glued little-endian into one uint64
    (WIDE) or uint32 word."""
    wt: tl.constexpr = tl.uint64 if WIDE else tl.uint32
    w = tl.load(base, mask=mask, other=0).to(wt)
    for j in tl.static_range(1, N):
        w = w | (tl.load(base + j, mask=mask, other=0).to(wt) << (UNIT_BITS * j))
    return w


@triton.jit
def dequant_chunks(
    units_ptr,
    row_off,
    high_ptr,
    high_off,
    chunk,
    mask,
    scale,
    mn,
    BITS: tl.constexpr,
    HIGH: tl.constexpr,
    U: tl.constexpr,
    UNIT_BITS: tl.constexpr,
    HU: tl.constexpr,
    SIGNED: tl.constexpr,
    FP8: tl.constexpr,
    APPLY_SCALE: tl.constexpr,
    HAS_MIN: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
):
    """Chunks `chunk` [1, NK] of the rows starting at unit offset `row_off` [R, 1]:
    returns [R, NK * 8] values in column order. `units_ptr` points at unsigned units of
    UNIT_BITS bits, U of them per chunk (HIGH: the low-nibble plane, 32 bits a chunk), and
    for HIGH > 0 `high_ptr` at the high plane's units, HU of them per chunk, from unit offset
    `high_off` [R, 1]; `scale`/`mn` broadcast against [R, NK]."""
    w = _gather(units_ptr + row_off + chunk * U, mask, U, UNIT_BITS, not HIGH)
    h = w
    if HIGH:
        h = _gather(high_ptr + high_off + chunk * HU, mask, HU, (8 * HIGH) // HU, False)
    p0 = _piece(w, h, 0, BITS, HIGH, SIGNED, FP8, scale, mn, APPLY_SCALE, HAS_MIN, OUT_DTYPE)
    p1 = _piece(w, h, 1, BITS, HIGH, SIGNED, FP8, scale, mn, APPLY_SCALE, HAS_MIN, OUT_DTYPE)
    p2 = _piece(w, h, 2, BITS, HIGH, SIGNED, FP8, scale, mn, APPLY_SCALE, HAS_MIN, OUT_DTYPE)
    p3 = _piece(w, h, 3, BITS, HIGH, SIGNED, FP8, scale, mn, APPLY_SCALE, HAS_MIN, OUT_DTYPE)
    p4 = _piece(w, h, 4, BITS, HIGH, SIGNED, FP8, scale, mn, APPLY_SCALE, HAS_MIN, OUT_DTYPE)
    p5 = _piece(w, h, 5, BITS, HIGH, SIGNED, FP8, scale, mn, APPLY_SCALE, HAS_MIN, OUT_DTYPE)
    p6 = _piece(w, h, 6, BITS, HIGH, SIGNED, FP8, scale, mn, APPLY_SCALE, HAS_MIN, OUT_DTYPE)
    p7 = _piece(w, h, 7, BITS, HIGH, SIGNED, FP8, scale, mn, APPLY_SCALE, HAS_MIN, OUT_DTYPE)
    # join(a, b) adds a minor axis of 2; three levels give flat index 4p + 2q + r, so the
    # leaves go in bit-reversed order to come out as p0..p7.
    t = tl.join(
        tl.join(tl.join(p0, p4), tl.join(p2, p6)), tl.join(tl.join(p1, p5), tl.join(p3, p7))
    )
    R: tl.constexpr = t.shape[0]
    NK: tl.constexpr = t.shape[1]
    return tl.reshape(t, [R, NK * 8])


# -- the lookup kernel -----------------------------------------------------------------------


@triton.jit
def _lookup_kernel(
    ids_ptr,
    units_ptr,
    high_ptr,
    scales_ptr,
    mins_ptr,
    out_ptr,
    n,
    cols,
    nchunk,
    code_stride,
    high_stride,
    high_start,
    scale_stride,
    out_stride,
    BT: tl.constexpr,
    NK: tl.constexpr,
    BITS: tl.constexpr,
    HIGH: tl.constexpr,
    U: tl.constexpr,
    UNIT_BITS: tl.constexpr,
    HU: tl.constexpr,
    GROUP: tl.constexpr,
    SIGNED: tl.constexpr,
    FP8: tl.constexpr,
    HAS_MIN: tl.constexpr,
    EVEN: tl.constexpr,
    STREAM: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    tok = pid_t * BT + tl.arange(0, BT)
    tmask = tok < n
    row = tl.load(ids_ptr + tok, mask=tmask, other=0).to(tl.int64)
    chunk = pid_c * NK + tl.arange(0, NK)
    if EVEN:  # every column block is full: the mask is constant along a row, loads vectorise
        mask = tmask[:, None] & (chunk >= 0)[None, :]
    else:
        mask = tmask[:, None] & (chunk < nchunk)[None, :]
    if GROUP == 0:  # one scale (and minimum) per row
        scale = tl.load(scales_ptr + row * scale_stride, mask=tmask, other=0).to(tl.float32)[
            :, None
        ]
        if HAS_MIN:
            mn = tl.load(mins_ptr + row * scale_stride, mask=tmask, other=0).to(tl.float32)[:, None]
        else:
            mn = scale
    else:  # GROUP is a multiple of 8, so each chunk lies in one group
        soff = row[:, None] * scale_stride + ((chunk * 8) // GROUP)[None, :]
        scale = tl.load(scales_ptr + soff, mask=mask, other=0).to(tl.float32)
        if HAS_MIN:
            mn = tl.load(mins_ptr + soff, mask=mask, other=0).to(tl.float32)
        else:
            mn = scale
    vals = dequant_chunks(
        units_ptr,
        row[:, None] * code_stride,
        high_ptr,
        row[:, None] * high_stride + high_start,
        chunk[None, :],
        mask,
        scale,
        mn,
        BITS,
        HIGH,
        U,
        UNIT_BITS,
        HU,
        SIGNED,
        FP8,
        True,
        HAS_MIN,
        out_ptr.dtype.element_ty,
    )
    col = pid_c * (NK * 8) + tl.arange(0, NK * 8)
    optr = out_ptr + tok.to(tl.int64)[:, None] * out_stride + col[None, :]
    if EVEN:
        omask = tmask[:, None] & (col >= 0)[None, :]
    else:
        omask = tmask[:, None] & (col < cols)[None, :]
    if STREAM:  # streaming store: the output is read once, by the next layer
        tl.store(optr, vals, mask=omask, cache_modifier=".cs")
    else:
        tl.store(optr, vals, mask=omask)


# -- host side -------------------------------------------------------------------------------

_UNIT_DTYPES = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.uint64}


@dataclass(frozen=True)
class Spec:
    """What the kernels need to know about a format, all compile-time constants."""

    bits: int  # bits per value (8 for fp8)
    high: int  # bits per value in the high plane (formats.integer.high_bits), 0 for one plane
    group: int  # columns per scale, 0 = one scale per row
    signed: bool
    fp8: bool
    has_min: bool


def spec_of(fmt: TableFormat, cols: int) -> Spec | None:
    """The kernel spec for `fmt`, or None when the kernels don't handle it (torch path)."""
    if isinstance(fmt, IntFormat):
        bits, group, signed, fp8 = fmt.bits, fmt.group_size, fmt.symmetric, False
    elif isinstance(fmt, Fp8Format):
        bits, group, signed, fp8 = 8, fmt.group_size, True, True
    else:
        return None
    if group is not None and group % 8:
        return None
    if group is not None and fmt.num_groups(cols) == 1:
        group = None  # one group: index the scale per row
    return Spec(bits, high_bits(bits), group or 0, signed, fp8, not fp8 and not signed)


def planes_of(codes: torch.Tensor, spec: Spec) -> tuple[tuple, tuple]:
    """The kernels' view of a table's codes: ((units, units per chunk, unit bits), (high
    plane's units, its units per chunk, unit offset where it starts in a row)). One-plane
    formats get the units twice and no high plane (0 units a chunk)."""
    if not spec.high:
        units = units_of(codes, spec.bits)
        return units, (units[0], 0, 0)
    nibbles = units_of(codes, 4)  # a plane of 4-bit codes, then the high bits
    high, per_chunk, unit_bits = units_of(codes, spec.high)
    start = codes.shape[1] // spec.bits * 32 // unit_bits  # a chunk: 8 nibbles, then its high bits
    return nibbles, (high, per_chunk, start)


def units_of(codes: torch.Tensor, bits: int) -> tuple[torch.Tensor, int, int]:
    """`codes` reinterpreted as unsigned units of gcd(bits, 8) bytes (bytes if that view is
    not possible): (units, units per chunk, unit bits). No copy, no device work. `view`
    checks the offset and strides itself; allocators align every storage to far more."""
    width = math.gcd(bits, 8)
    if width > 1:
        try:
            return codes.view(_UNIT_DTYPES[width]), bits // width, 8 * width
        except RuntimeError:
            pass
    return codes, bits, 8


def _pow2_floor(x: int) -> int:
    return 1 << max(0, int(x).bit_length() - 1)


def lookup_config(n: int, cols: int, spec: Spec) -> tuple[int, int, int, bool]:
    """(tokens per program, chunks per program, warps, streaming stores), from a sweep on an
    H200 (bench/bench_kernels.py --sweep): 1024-column blocks (fewer when that wastes over
    1/4 of a block), two chunks per thread, and for narrow rows several tokens per program."""
    nchunk = math.ceil(cols / 8)
    nk = 8
    for cand in (128, 64, 32, 16, 8):
        blocks = math.ceil(nchunk / cand)
        if (blocks * cand - nchunk) * 4 <= blocks * cand:
            nk = cand
            break
    if n >= 2048:
        target = 128 if nchunk >= 512 else 256
        bt = max(1, min(16, target // nk))
        warps = max(1, min(8, bt * nk // 128))
    else:
        bt = max(1, min(16, 128 // nk))
        warps = max(1, min(8, bt * nk // 64))
    return bt, nk, warps, False


def lookup(
    fmt: TableFormat,
    table: PackedRows,
    ids: torch.Tensor,
    cols: int,
    dtype: torch.dtype,
    config: tuple | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Fused lookup (into `out` [n, cols] if given); None if `fmt` is not one the kernel
    handles."""
    spec = spec_of(fmt, cols)
    if spec is None:
        return None
    flat = ids.reshape(-1)
    n = flat.numel()
    if out is None:
        out = torch.empty((n, cols), dtype=dtype, device=flat.device)
    if n == 0:
        return out.view(*ids.shape, cols)
    (units, per_chunk, unit_bits), (high, high_per_chunk, high_start) = planes_of(table.codes, spec)
    scales = table.scales
    mins = table.mins if table.mins is not None else scales
    bt, nk, warps, stream = (
        (tuple(config) + (False,))[:4] if config else lookup_config(n, cols, spec)
    )
    nchunk = math.ceil(cols / 8)
    grid = (triton.cdiv(n, bt), triton.cdiv(nchunk, nk))
    _lookup_kernel[grid](
        flat,
        units,
        high,
        scales,
        mins,
        out,
        n,
        cols,
        nchunk,
        units.stride(0),
        high.stride(0),
        high_start,
        scales.stride(0),
        out.stride(0),
        BT=bt,
        NK=nk,
        BITS=spec.bits,
        HIGH=spec.high,
        U=per_chunk,
        UNIT_BITS=unit_bits,
        HU=high_per_chunk,
        GROUP=spec.group,
        SIGNED=spec.signed,
        FP8=spec.fp8,
        HAS_MIN=spec.has_min,
        EVEN=cols % (nk * 8) == 0,
        STREAM=stream,
        num_warps=warps,
        enable_fp_fusion=False,
    )
    return out.view(*ids.shape, cols)
