"""The generic tile kernels of the head GEMM ("tiles", the fallback of every format and
width): codes read through the lookup's chunk unpacker (8-, 6-, 5- and 4-bit codes split in
registers; with WORDS, 4-, 5- and 6-bit codes read as words and decoded two per instruction
by PTX), tensor cores on the transposed product for small M, classic tiles for larger M,
and the CUDA-core GEMV for one row of x. `triton_linear` chooses between these and the word
kernels (`gemm_words`)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..formats import PackedRows, TableFormat
from ..formats.integer import high_bits
from .nibbles import nibble_asm
from .triton_lookup import dequant_chunks, planes_of


@triton.jit
def _high_pairs(codes8_ptr, row_off8, kc, BK: tl.constexpr, HIGH: tl.constexpr):
    """[BN, BK / 2] int32: the high plane's bits of the two codes of each low-nibble byte of
    the tile at chunk kc (first code's in the low HIGH bits). `row_off8`: the plane's start."""
    hb = tl.load(codes8_ptr + row_off8 + kc * HIGH + tl.arange(0, BK * HIGH // 8)[None, :])
    hb = hb.to(tl.int32)
    if HIGH == 2:  # a byte: four codes, two a nibble byte
        h = tl.interleave(hb & 15, hb >> 4)
    else:  # a byte: eight codes; bits 2s and 2s + 1 go to nibble byte s of four
        h = tl.interleave(tl.interleave(hb, hb >> 4), tl.interleave(hb >> 2, hb >> 6)) & 3
    return h


@triton.jit
def _levels(lo, hi, BITS: tl.constexpr, SIGNED: tl.constexpr, MAGIC: tl.constexpr):
    """Two [BN, K] int32 tiles of BITS-bit codes as one [BN, 2K] float32 tile of levels, `lo`'s
    first in each pair. MAGIC: the code OR-ed into the mantissa of 2^23 (and its sign bit
    flipped: two's complement + 2^(BITS-1)), then one exact float subtraction, instead of the
    int->float unit (a quarter of the integer rate on Hopper)."""
    HALF: tl.constexpr = 1 << (BITS - 1)
    if MAGIC:
        HEAD: tl.constexpr = 0x4B000000 | (HALF if SIGNED else 0)
        f = tl.interleave(lo ^ HEAD, hi ^ HEAD).to(tl.float32, bitcast=True)
        return f - (8388608.0 + (HALF if SIGNED else 0))
    if SIGNED:
        lo = (lo ^ HALF) - HALF
        hi = (hi ^ HALF) - HALF
    return tl.interleave(lo, hi).to(tl.float32)


@triton.jit
def _word_level(w, h, i: tl.constexpr, HIGH: tl.constexpr, SIGNED: tl.constexpr):
    """Level i (int32) of each word's 8 codes: its nibble of the word, its HIGH bits of h."""
    c = (w >> (4 * i)) & 15
    if HIGH:
        c = c | (((h >> (HIGH * i)) & ((1 << HIGH) - 1)) << 4)
    if SIGNED:
        HALF: tl.constexpr = 8 << HIGH
        c = (c ^ HALF) - HALF
    return c


@triton.jit
def _word_value(w, h, i: tl.constexpr, scale, mn, HIGH: tl.constexpr, SIGNED: tl.constexpr,
                HAS_MIN: tl.constexpr, SCALED: tl.constexpr, DT: tl.constexpr):
    """Weight i of each word in DT, plainly (Triton's interpreter runs no PTX)."""
    v = _word_level(w, h, i, HIGH, SIGNED).to(tl.float32)
    if SCALED:
        v = v * scale
        if HAS_MIN:
            v = v + mn
    return v.to(DT)


@triton.jit
def _pairs(h):
    """A 16-bit float tile as 32-bit words holding it twice (a packed operand of the PTX)."""
    b = h.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return b | (b << 16)


@triton.jit
def _word_tile(codes8_ptr, row_off8, nchunk, kc, scale, mn, BN: tl.constexpr,
               NKC: tl.constexpr, GROUP: tl.constexpr, HIGH: tl.constexpr, SIGNED: tl.constexpr,
               HAS_MIN: tl.constexpr, SCALED: tl.constexpr, DT: tl.constexpr,
               ASM: tl.constexpr):
    """[BN, NKC * 8] tile in DT of 4-bit codes read as 32-bit words, 8 codes (a chunk) each,
    and for 5- and 6-bit codes their high plane's 1 or 2 bytes a chunk. SCALED: times `scale`
    (plus `mn`), as [BN, 1] per row or [BN, NG, 1] per group (NG in the tile), rounded once
    as the reference rounds. ASM (`nibbles.nibble_asm`, from the host): two codes per packed
    instruction, scaled in PTX for two's complement codes, in float32 after it for affine
    ones; empty: plainly (`_word_value`)."""
    chunk = kc + tl.arange(0, NKC)
    w = tl.load(codes8_ptr.to(tl.pointer_type(tl.int32)) + row_off8 // 4 + chunk[None, :])
    h = w  # the high plane's bits of each chunk: a byte (int5) or two (int6)
    if HIGH == 1:
        h = tl.load(codes8_ptr + row_off8 + nchunk * 4 + chunk[None, :]).to(tl.int32)
    elif HIGH == 2:
        halves = codes8_ptr.to(tl.pointer_type(tl.uint16))
        h = tl.load(halves + (row_off8 + nchunk * 4) // 2 + chunk[None, :]).to(tl.int32)
    if GROUP:
        w = tl.reshape(w, [BN, NKC * 8 // GROUP, GROUP // 8])
        h = tl.reshape(h, [BN, NKC * 8 // GROUP, GROUP // 8])
    C: tl.constexpr = "=h,=h,=h,=h,=h,=h,=h,=h,r,r"  # the word, its high bits (or unused)
    if ASM == "":
        p0 = _word_value(w, h, 0, scale, mn, HIGH, SIGNED, HAS_MIN, SCALED, DT)
        p1 = _word_value(w, h, 1, scale, mn, HIGH, SIGNED, HAS_MIN, SCALED, DT)
        p2 = _word_value(w, h, 2, scale, mn, HIGH, SIGNED, HAS_MIN, SCALED, DT)
        p3 = _word_value(w, h, 3, scale, mn, HIGH, SIGNED, HAS_MIN, SCALED, DT)
        p4 = _word_value(w, h, 4, scale, mn, HIGH, SIGNED, HAS_MIN, SCALED, DT)
        p5 = _word_value(w, h, 5, scale, mn, HIGH, SIGNED, HAS_MIN, SCALED, DT)
        p6 = _word_value(w, h, 6, scale, mn, HIGH, SIGNED, HAS_MIN, SCALED, DT)
        p7 = _word_value(w, h, 7, scale, mn, HIGH, SIGNED, HAS_MIN, SCALED, DT)
    elif SCALED and SIGNED and DT == tl.bfloat16:  # the scale as s_hi + s_lo
        hi = scale.to(tl.bfloat16)
        lo = tl.broadcast_to(_pairs((scale - hi.to(tl.float32)).to(tl.bfloat16)), w.shape)
        p0, p1, p2, p3, p4, p5, p6, p7 = tl.inline_asm_elementwise(
            ASM, C + ",r,r", [w, h, tl.broadcast_to(_pairs(hi), w.shape), lo],
            (tl.bfloat16,) * 8, is_pure=True, pack=1)
    elif SCALED and SIGNED:
        s16 = tl.broadcast_to(_pairs(scale.to(tl.float16)), w.shape)
        p0, p1, p2, p3, p4, p5, p6, p7 = tl.inline_asm_elementwise(
            ASM, C + ",r", [w, h, s16], (tl.float16,) * 8, is_pure=True, pack=1)
    elif SCALED and DT == tl.bfloat16:  # affine: float32 levels, then scale and minimum
        p0, p1, p2, p3, p4, p5, p6, p7 = tl.inline_asm_elementwise(
            ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [w, h], (tl.float32,) * 8, is_pure=True, pack=1)
    elif DT == tl.bfloat16:
        p0, p1, p2, p3, p4, p5, p6, p7 = tl.inline_asm_elementwise(
            ASM, C, [w, h], (tl.bfloat16,) * 8, is_pure=True, pack=1)
    else:
        p0, p1, p2, p3, p4, p5, p6, p7 = tl.inline_asm_elementwise(
            ASM, C, [w, h], (tl.float16,) * 8, is_pure=True, pack=1)
    # Element [.., b, s, t] of the joins is code m + 4 b, m = 2 s + t (the PTX's pair is b).
    v = tl.join(tl.join(tl.join(p0, p4), tl.join(p2, p6)), tl.join(tl.join(p1, p5), tl.join(p3, p7)))
    if ASM != "" and SCALED and not SIGNED:  # affine: level * scale + minimum in float32
        v = v.to(tl.float32)
        if GROUP:
            v = v * scale[:, :, :, None, None, None] + mn[:, :, :, None, None, None]
        else:
            v = v * scale[:, :, None, None, None] + mn[:, :, None, None, None]
        v = v.to(DT)
    # The order of wgmma's operand registers, so the tile needs no trip through shared memory:
    # within every 4 words, column 8 m + 2 q + b holds code m + 4 b of word q (`word_order`).
    v = tl.permute(tl.reshape(v, [BN, NKC // 4, 4, 2, 2, 2]), (0, 1, 4, 5, 2, 3))
    return tl.reshape(v, [BN, NKC * 8])


@triton.jit
def _weight_tile(units_ptr, codes8_ptr, high_ptr, row_off, row_off8, high_off, nchunk, kc, cmask,
                 scales_ptr, mins_ptr, rn_safe, scale_stride, srow, mrow,
                 BN: tl.constexpr, NKC: tl.constexpr, FAST: tl.constexpr,
                 BITS: tl.constexpr, HIGH: tl.constexpr, U: tl.constexpr,
                 UNIT_BITS: tl.constexpr, HU: tl.constexpr,
                 GROUP: tl.constexpr, SIGNED: tl.constexpr, FP8: tl.constexpr,
                 HAS_MIN: tl.constexpr, POST_SCALE: tl.constexpr, DT: tl.constexpr,
                 MAGIC: tl.constexpr, WORDS: tl.constexpr, ASM: tl.constexpr):
    """Dequantized [BN, NKC * 8] tile of W in DT. FAST: 8-bit codes loaded as one byte per
    value, or 4-bit codes (and the low nibbles of 5- and 6-bit codes, OR-ed with their high
    plane's bits) as bytes split into nibbles, with group scales broadcast over
    [BN, groups, GROUP] (GROUP a power of two dividing the tile), levels made by `_levels`;
    otherwise the generic chunk path of the lookup."""
    BK: tl.constexpr = NKC * 8
    if FAST:
        if GROUP == 0:
            scale = srow
            mn = mrow
        else:
            NG: tl.constexpr = BK // GROUP
            g = kc * 8 // GROUP + tl.arange(0, NG)
            soff = rn_safe[:, None] * scale_stride + g[None, :]
            scale = tl.load(scales_ptr + soff).to(tl.float32)[:, :, None]
            if HAS_MIN:
                mn = tl.load(mins_ptr + soff).to(tl.float32)[:, :, None]
            else:
                mn = scale
        if BITS == 8:
            # Byte pairs split in registers: a plain byte tile would be re-laid out by Triton
            # to match the accumulator and lose its 16-byte loads.
            k = kc * 4 + tl.arange(0, BK // 2)
            pairs = codes8_ptr.to(tl.pointer_type(tl.uint16))
            raw = tl.load(pairs + row_off8 // 2 + k[None, :]).to(tl.int32)
            lo = raw & 255
            hi = raw >> 8
            if FP8:
                v = tl.interleave(lo.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32),
                                  hi.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32))
            else:
                v = _levels(lo, hi, BITS, SIGNED, MAGIC)
        elif WORDS:  # `linear_tiles`: 4-, 5- and 6-bit codes, scaled as made
            v = _word_tile(codes8_ptr, row_off8, nchunk, kc, scale, mn, BN, NKC, GROUP, HIGH,
                           SIGNED, HAS_MIN, not POST_SCALE, DT, ASM)
        else:  # 4-bit: two values per byte, low nibble first
            k = kc * 4 + tl.arange(0, BK // 2)
            raw = tl.load(codes8_ptr + row_off8 + k[None, :]).to(tl.int32)
            lo = raw & 15
            hi = raw >> 4
            if HIGH:
                h = _high_pairs(codes8_ptr, row_off8 + nchunk * 4, kc, BK, HIGH)
                lo = lo | ((h & ((1 << HIGH) - 1)) << 4)
                hi = hi | ((h >> HIGH) << 4)
            v = _levels(lo, hi, BITS, SIGNED, MAGIC)
        if POST_SCALE or WORDS:  # the words' tile comes scaled
            res = v.to(DT)
        elif GROUP == 0:
            v = v * scale
            if HAS_MIN:
                v = v + mn
            res = v.to(DT)
        else:
            v3 = tl.reshape(v, [BN, BK // GROUP, GROUP]) * scale
            if HAS_MIN:
                v3 = v3 + mn
            res = tl.reshape(v3, [BN, BK]).to(DT)
        return res
    else:
        chunk = kc + tl.arange(0, NKC)
        if GROUP == 0:
            scale = srow
            mn = mrow
        else:
            soff = rn_safe[:, None] * scale_stride + ((chunk * 8) // GROUP)[None, :]
            scale = tl.load(scales_ptr + soff, mask=cmask, other=0).to(tl.float32)
            if HAS_MIN:
                mn = tl.load(mins_ptr + soff, mask=cmask, other=0).to(tl.float32)
            else:
                mn = scale
        return dequant_chunks(units_ptr, row_off, high_ptr, high_off, chunk[None, :], cmask, scale,
                              mn, BITS, HIGH, U, UNIT_BITS, HU, SIGNED, FP8, not POST_SCALE,
                              HAS_MIN, DT)


@triton.jit
def _linear_kernel(x_ptr, units_ptr, codes8_ptr, high_ptr, scales_ptr, mins_ptr, out_ptr,
                   M, N, cols, nchunk, k_chunks_per_split, stride_xm, code_stride, code8_stride,
                   high_stride, high_start, scale_stride, stride_om, stride_split,
                   BM: tl.constexpr, BN: tl.constexpr, NKC: tl.constexpr, SWAP: tl.constexpr,
                   SPLIT: tl.constexpr, POST_SCALE: tl.constexpr, FAST: tl.constexpr,
                   BITS: tl.constexpr, HIGH: tl.constexpr, U: tl.constexpr,
                   UNIT_BITS: tl.constexpr, HU: tl.constexpr,
                   GROUP: tl.constexpr, SIGNED: tl.constexpr, FP8: tl.constexpr,
                   HAS_MIN: tl.constexpr, EVEN_K: tl.constexpr, MAGIC: tl.constexpr,
                   WORDS: tl.constexpr, ASM: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mmask = rm < M
    nmask = rn < N
    rn_safe = tl.where(nmask, rn, 0).to(tl.int64)
    row_off = rn_safe[:, None] * code_stride
    row_off8 = rn_safe[:, None] * code8_stride
    high_off = rn_safe[:, None] * high_stride + high_start
    xdt = x_ptr.dtype.element_ty
    srow = tl.zeros([BN, 1], dtype=tl.float32)
    mrow = srow
    if GROUP == 0:
        srow = tl.load(scales_ptr + rn_safe * scale_stride).to(tl.float32)[:, None]
        if HAS_MIN:
            mrow = tl.load(mins_ptr + rn_safe * scale_stride).to(tl.float32)[:, None]
    if SWAP:
        acc = tl.zeros([BN, BM], dtype=tl.float32)
    else:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
    k_begin = pid_k * k_chunks_per_split
    k_end = tl.minimum(k_begin + k_chunks_per_split, nchunk)
    for kc in range(k_begin, k_end, NKC):
        chunk = kc + tl.arange(0, NKC)
        if EVEN_K:
            cmask = (chunk >= 0)[None, :] & (rn_safe >= 0)[:, None]
        else:
            cmask = (chunk < k_end)[None, :] & (rn_safe >= 0)[:, None]
        w = _weight_tile(units_ptr, codes8_ptr, high_ptr, row_off, row_off8, high_off, nchunk, kc,
                         cmask, scales_ptr, mins_ptr, rn_safe, scale_stride, srow, mrow, BN, NKC,
                         FAST, BITS, HIGH, U, UNIT_BITS, HU, GROUP, SIGNED, FP8, HAS_MIN,
                         POST_SCALE, xdt, MAGIC, WORDS, ASM)
        kk = kc * 8 + tl.arange(0, NKC * 8)
        if EVEN_K:
            xmask = mmask[:, None] & (kk >= 0)[None, :]
        else:
            xmask = mmask[:, None] & (kk < tl.minimum(k_end * 8, cols))[None, :]
        xt = tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_xm + kk[None, :], mask=xmask, other=0)
        if SWAP:
            acc = tl.dot(w, tl.trans(xt), acc)
        else:
            acc = tl.dot(xt, tl.trans(w), acc)
    if POST_SCALE:
        if SWAP:
            acc = acc * srow
        else:
            acc = acc * tl.trans(srow)
    if SWAP:
        optr = out_ptr + rm.to(tl.int64)[None, :] * stride_om + rn[:, None]
        omask = mmask[None, :] & nmask[:, None]
    else:
        optr = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
        omask = mmask[:, None] & nmask[None, :]
    if SPLIT:  # one float32 partial per split, summed in a fixed order afterwards
        tl.store(optr + pid_k.to(tl.int64) * stride_split, acc, mask=omask)
    else:
        tl.store(optr, acc.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _gemv_step(x_ptr, units_ptr, codes8_ptr, high_ptr, row_off, row_off8, high_off, kc, rn_safe,
               scales_ptr, mins_ptr, scale_stride, srow, mrow, M, cols, nchunk, stride_xm,
               MP: tl.constexpr, BN: tl.constexpr, NKC: tl.constexpr, POST_SCALE: tl.constexpr,
               FAST: tl.constexpr, BITS: tl.constexpr, HIGH: tl.constexpr, U: tl.constexpr,
               UNIT_BITS: tl.constexpr, HU: tl.constexpr,
               GROUP: tl.constexpr, SIGNED: tl.constexpr, FP8: tl.constexpr,
               HAS_MIN: tl.constexpr, EVEN_K: tl.constexpr, MAGIC: tl.constexpr):
    """One [BN, BK] block of W times up to four rows of x, elementwise (summed later). Codes
    through the FAST bytes or the chunk path, never as words (`linear_tiles`)."""
    BK: tl.constexpr = NKC * 8
    chunk = kc + tl.arange(0, NKC)
    if EVEN_K:
        cmask = (chunk >= 0)[None, :] & (rn_safe >= 0)[:, None]
    else:
        cmask = (chunk < nchunk)[None, :] & (rn_safe >= 0)[:, None]
    w = _weight_tile(units_ptr, codes8_ptr, high_ptr, row_off, row_off8, high_off, nchunk, kc,
                     cmask, scales_ptr, mins_ptr, rn_safe, scale_stride, srow, mrow, BN, NKC, FAST,
                     BITS, HIGH, U, UNIT_BITS, HU, GROUP, SIGNED, FP8, HAS_MIN, POST_SCALE,
                     tl.float32, MAGIC, False, "")
    kk = kc * 8 + tl.arange(0, BK)
    kmask = kk < cols
    p0 = w * tl.load(x_ptr + kk, mask=kmask, other=0).to(tl.float32)[None, :]
    p1 = p0
    p2 = p0
    p3 = p0
    if MP > 1:
        p1 = w * tl.load(x_ptr + stride_xm + kk, mask=kmask & (kk * 0 + M > 1), other=0).to(tl.float32)[None, :]
    if MP > 2:
        p2 = w * tl.load(x_ptr + 2 * stride_xm + kk, mask=kmask & (kk * 0 + M > 2), other=0).to(tl.float32)[None, :]
        p3 = w * tl.load(x_ptr + 3 * stride_xm + kk, mask=kmask & (kk * 0 + M > 3), other=0).to(tl.float32)[None, :]
    return p0, p1, p2, p3


@triton.jit
def _gemv_kernel(x_ptr, units_ptr, codes8_ptr, high_ptr, scales_ptr, mins_ptr, out_ptr,
                 M, N, cols, nchunk, stride_xm, code_stride, code8_stride, high_stride, high_start,
                 scale_stride, stride_om,
                 MP: tl.constexpr, BN: tl.constexpr, NKC: tl.constexpr, POST_SCALE: tl.constexpr,
                 FAST: tl.constexpr, BITS: tl.constexpr, HIGH: tl.constexpr, U: tl.constexpr,
                 UNIT_BITS: tl.constexpr, HU: tl.constexpr,
                 GROUP: tl.constexpr, SIGNED: tl.constexpr, FP8: tl.constexpr,
                 HAS_MIN: tl.constexpr, EVEN_K: tl.constexpr, MAGIC: tl.constexpr):
    """CUDA-core GEMV for a handful of rows (M <= MP <= 4): each program streams BN whole
    rows of W in long contiguous pieces and keeps [BN, BK] float32 partial sums per row of x,
    reduced once at the end. No tensor cores, no shared-memory staging."""
    pid_n = tl.program_id(0)
    rn = pid_n * BN + tl.arange(0, BN)
    nmask = rn < N
    rn_safe = tl.where(nmask, rn, 0).to(tl.int64)
    row_off = rn_safe[:, None] * code_stride
    row_off8 = rn_safe[:, None] * code8_stride
    high_off = rn_safe[:, None] * high_stride + high_start
    srow = tl.zeros([BN, 1], dtype=tl.float32)
    mrow = srow
    if GROUP == 0:
        srow = tl.load(scales_ptr + rn_safe * scale_stride).to(tl.float32)[:, None]
        if HAS_MIN:
            mrow = tl.load(mins_ptr + rn_safe * scale_stride).to(tl.float32)[:, None]
    # The first block is peeled: the partial sums take the layout of the weight loads
    # (16-byte vectors) instead of a default one that would split the loads into bytes.
    acc0, acc1, acc2, acc3 = _gemv_step(x_ptr, units_ptr, codes8_ptr, high_ptr, row_off, row_off8,
                                        high_off, 0, rn_safe, scales_ptr, mins_ptr, scale_stride,
                                        srow, mrow, M, cols, nchunk, stride_xm, MP, BN, NKC,
                                        POST_SCALE, FAST, BITS, HIGH, U, UNIT_BITS, HU, GROUP,
                                        SIGNED, FP8, HAS_MIN, EVEN_K, MAGIC)
    for kc in range(NKC, nchunk, NKC):
        p0, p1, p2, p3 = _gemv_step(x_ptr, units_ptr, codes8_ptr, high_ptr, row_off, row_off8,
                                    high_off, kc, rn_safe, scales_ptr, mins_ptr, scale_stride,
                                    srow, mrow, M, cols, nchunk, stride_xm, MP, BN, NKC,
                                    POST_SCALE, FAST, BITS, HIGH, U, UNIT_BITS, HU, GROUP, SIGNED,
                                    FP8, HAS_MIN, EVEN_K, MAGIC)
        acc0 += p0
        if MP > 1:
            acc1 += p1
        if MP > 2:
            acc2 += p2
            acc3 += p3
    odt = out_ptr.dtype.element_ty
    scale = tl.reshape(srow, [BN]) if POST_SCALE else 1.0
    tl.store(out_ptr + rn, (tl.sum(acc0, axis=1) * scale).to(odt), mask=nmask)
    if MP > 1:
        tl.store(out_ptr + stride_om + rn, (tl.sum(acc1, axis=1) * scale).to(odt), mask=nmask & (rn * 0 + M > 1))
    if MP > 2:
        tl.store(out_ptr + 2 * stride_om + rn, (tl.sum(acc2, axis=1) * scale).to(odt), mask=nmask & (rn * 0 + M > 2))
        tl.store(out_ptr + 3 * stride_om + rn, (tl.sum(acc3, axis=1) * scale).to(odt), mask=nmask & (rn * 0 + M > 3))


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def _split_in_registers(spec) -> bool:
    """Codes the FAST tile reads as bytes and splits in registers: 8-bit, 4-bit, and 5- and
    6-bit (a nibble plane and a high plane)."""
    return spec.bits in (4, 8) or spec.high > 0


def words_tile(spec) -> bool:
    """Formats the FAST tile can read as words (`_word_tile`): 4-bit codes and the two planes
    of 5- and 6-bit codes, two's complement or with minimums."""
    return (spec.bits == 4 or spec.high > 0) and not spec.fp8 and (spec.signed or spec.has_min)


def _words_asm(spec, x2: torch.Tensor) -> str:
    """The words tile's PTX for this table and x (none on the CPU: the interpreter)."""
    if not x2.is_cuda or x2.dtype not in (torch.bfloat16, torch.float16):
        return ""
    scaled = spec.signed and spec.group > 0  # else raw levels: per-row scales or minimums
    dt = "bf16" if x2.dtype == torch.bfloat16 else "fp16"
    return nibble_asm(dt, spec.signed, scaled=scaled, high=spec.high, f32=spec.has_min and dt == "bf16")


def tiles_config(m: int, n: int, cols: int, bits: int) -> dict:
    """Kernel and tile shapes, from sweeps on an H200 (table 262144 x 2560,
    bench/bench_kernels.py --sweep gemm). One row of x: the CUDA-core GEMV. 2..16 rows: the
    transposed tensor-core tile with x padded to 16 rows (Triton 3.6 compiled M=4 to a
    kernel 2-3x slower than M=16). Formats read through strided units (3, 7 bits...)
    keep the transposed tile at every M: Triton 3.6 fails to compile them in the big one."""
    if m == 1:
        if bits == 8:
            return dict(GEMV=True, BN=16, BK=256, num_warps=4, num_stages=1)
        return dict(GEMV=True, BN=16, BK=128, num_warps=2, num_stages=1)
    if m <= 16:
        return dict(BM=16, BN=64, BK=128, SWAP=True, num_warps=4, num_stages=2 if bits == 8 else 4,
                    PAD_M=True)
    if m <= 64 or (bits not in (4, 8) and not high_bits(bits)):
        return dict(BM=64, BN=64, BK=128, SWAP=True, num_warps=4, num_stages=3)
    if bits == 8:
        return dict(BM=128, BN=256, BK=64, SWAP=False, num_warps=8, num_stages=4)
    return dict(BM=128, BN=128, BK=64, SWAP=False, num_warps=8, num_stages=3)


def _fast(spec, cfg: dict, cols: int, bk: int) -> bool:
    """Whether the FAST tile reads this table at BK = bk: whole tiles of codes split in
    registers, and groups that are powers of two dividing the tile."""
    nchunk = math.ceil(cols / 8)
    even = nchunk % (bk // 8) == 0 and cols % 8 == 0
    group_ok = spec.group == 0 or (spec.group & (spec.group - 1) == 0 and bk % spec.group == 0)
    return cfg.get("FAST", True) and even and _split_in_registers(spec) and group_ok


def word_order(x2: torch.Tensor, words: bool, rows: int) -> torch.Tensor:
    """x as the kernels read it, in one copy at most: padded with zero rows up to `rows`, and
    for tiles of codes read as words (`_word_tile`, `gemm_words._nibble_levels`) its columns
    in the order of wgmma's operand registers, in which the PTX leaves the levels: within every
    32 columns (4 words of 8 codes), column 8 m + 2 q + b takes column 8 q + 4 b + m. A dot
    does not depend on the order of its columns, so W's tile is not reordered."""
    m, cols = x2.shape
    if not words and rows == m:
        return x2
    dest = x2.new_zeros((rows, cols)) if rows > m else x2.new_empty((m, cols))
    if words:
        by_word = x2.reshape(m, cols // 32, 4, 2, 4)  # [.., q, b, m]
        dest[:m].view(m, cols // 32, 4, 4, 2).copy_(by_word.permute(0, 1, 4, 2, 3))
    else:
        dest[:m] = x2
    return dest


def linear_tiles(fmt: TableFormat, spec, table: PackedRows, x2: torch.Tensor, cols: int,
                  out: torch.Tensor, config: dict | None) -> torch.Tensor:
    """The generic tile kernels (any width, any cols): the fallback of the word kernels."""
    m, n = x2.shape[0], table.num_rows
    (units, per_chunk, unit_bits), (high, high_per_chunk, high_start) = planes_of(table.codes, spec)
    cfg = dict(tiles_config(m, n, cols, spec.bits))
    if config:
        cfg.update(config)
    while cfg["BK"] > max(32, spec.group) and cols % cfg["BK"]:  # whole steps keep FAST
        cfg["BK"] //= 2
    gemv = bool(cfg.get("GEMV")) and m <= 4
    words = (bool(cfg.get("WORDS")) and not gemv and words_tile(spec) and cfg["BK"] % 32 == 0
             and _fast(spec, cfg, cols, cfg["BK"]))  # 4 words at a time: `word_order`
    planes = dict(BITS=spec.bits, HIGH=spec.high, U=per_chunk, UNIT_BITS=unit_bits,
                  HU=high_per_chunk, MAGIC=cfg.get("MAGIC", True))
    scales = table.scales
    mins = table.mins if table.mins is not None else scales
    post = spec.group == 0 and spec.signed and not spec.fp8
    # PAD_M: the same kernel as for a full tile of rows; the extra rows are zeros, sliced off.
    rows = cfg["BM"] if cfg.get("PAD_M") and m < cfg["BM"] else m
    x2 = word_order(x2, words, rows)
    result = out
    if rows > m:
        out = torch.empty((rows, n), dtype=out.dtype, device=out.device)
    nchunk = math.ceil(cols / 8)
    if gemv and n > 0:
        nkc = cfg["BK"] // 8
        _gemv_kernel[(triton.cdiv(n, cfg["BN"]),)](
            x2, units, table.codes, high, scales, mins, out,
            rows, n, cols, nchunk, x2.stride(0), units.stride(0), table.codes.stride(0),
            high.stride(0), high_start, scales.stride(0), out.stride(0),
            MP=1 if rows == 1 else (2 if rows == 2 else 4), BN=cfg["BN"], NKC=nkc,
            POST_SCALE=post, FAST=_fast(spec, cfg, cols, cfg["BK"]), GROUP=spec.group,
            SIGNED=spec.signed, FP8=spec.fp8, HAS_MIN=spec.has_min,
            EVEN_K=nchunk % nkc == 0 and cols % 8 == 0, **planes,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
        return out if result is out else result.copy_(out[:m])
    if not _fast(spec, cfg, cols, cfg["BK"]) and (per_chunk > 1 or spec.high) and not cfg["SWAP"]:
        # Triton 3.6 fails to compile strided-unit tiles as the right-hand operand (two-plane
        # chunks not tried there): use the transposed tile (weights on the left) at any M.
        cfg.update(BM=64, BN=64, BK=128, SWAP=True, num_warps=4, num_stages=3)
    bm, bn, bk = cfg["BM"], cfg["BN"], cfg["BK"]
    nkc = bk // 8
    fast = _fast(spec, cfg, cols, bk)
    even_k = nchunk % nkc == 0 and cols % 8 == 0
    grid_m, grid_n = triton.cdiv(rows, bm), triton.cdiv(n, bn)
    # Split the hidden size only when the vocabulary leaves multiprocessors idle.
    split = cfg.get("SPLIT_K") or 1
    if "SPLIT_K" not in cfg and grid_m * grid_n < 2 * num_sms(x2.device):
        split = max(1, min(triton.cdiv(nchunk, nkc), (4 * num_sms(x2.device)) // (grid_m * grid_n)))
    per_split = triton.cdiv(triton.cdiv(nchunk, split), nkc) * nkc  # a multiple of nkc
    split = triton.cdiv(nchunk, per_split)
    dest = out if split == 1 else torch.empty((split, rows, n), dtype=torch.float32, device=x2.device)
    stages = cfg["num_stages"]
    _linear_kernel[(grid_m, grid_n, split)](
        x2, units, table.codes, high, scales, mins, dest,
        rows, n, cols, nchunk, per_split, x2.stride(0), units.stride(0), table.codes.stride(0),
        high.stride(0), high_start, scales.stride(0), dest.stride(-2),
        dest.stride(0) if split > 1 else 0,
        BM=bm, BN=bn, NKC=nkc, SWAP=cfg["SWAP"], SPLIT=split > 1, POST_SCALE=post, FAST=fast,
        GROUP=spec.group, SIGNED=spec.signed, **planes,
        FP8=spec.fp8, HAS_MIN=spec.has_min, EVEN_K=even_k,
        WORDS=words, ASM=_words_asm(spec, x2) if words else "",
        num_warps=cfg["num_warps"], num_stages=stages,
    )
    if split > 1:
        out.copy_(dest.sum(dim=0))  # a fixed order: the same bits every run
    if result is not out:
        result.copy_(out[:m])
    return result
