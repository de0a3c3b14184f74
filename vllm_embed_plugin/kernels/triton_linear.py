"""Weight-only GEMM for a tied LM head: logits [M, rows] = x [M, cols] @ dequant(W)^T.

The packed table is never densified as a whole and never copied: kernels read the lookup's
layout. Which kernel runs is a per-call choice on M (`linear_config`, from a sweep on an H200,
docs/BENCHMARKS.md):

- "gemv", M = 1: the word kernel on CUDA cores (`_words_kernel`, MMA off). Codes are read as
  32-bit words, a block of U words holding P values (int8 1/4, int4 1/8, int6 3/16, int5 5/32,
  fp8 1/4); value J of each block is cut out with compile-time shifts and turned into a float
  by OR-ing it into the mantissa of 2^23 and one subtraction (no int->float unit), multiplied
  with x's matching columns (x optionally permuted so they are contiguous, XPERM), and the
  block's scale (and minimum times the block's sum of x) is applied once per block.
- "wdot", M = 2..256 for some formats: the same word tiles on tensor cores, decoded once per
  weight for up to BM rows of x (x's missing rows masked to zeros, no copy; BM up to 256, so
  a batch of 256 decodes each weight once). The P pieces of a tile are put back into column
  order with a tree of joins, so a tile is one [BN, T * P] operand and one dot with x's
  matching columns. Scaled and rounded to x's dtype before the dot (the reference's
  rounding), or raw levels with the row scale after it (fp8); GPOST (int8 at M = 2..16): one
  dot per group on raw levels, scaled in float32 after.
  Only whole tiles: a row that is no whole number of tiles takes the generic kernels.
- "rows": the CUDA-core word kernel for BM rows of x in one launch (each weight decoded once
  for all of them; what "gemv" runs for M > 1). Slower than "tiles"/"wdot" at every M it was
  timed at (docs/BENCHMARKS.md), so the heuristic does not pick it.
- "mma": the word tiles on tensor cores with one dot per piece (the previous int5 choice).
- "tiles": the generic tile kernels (`_linear_kernel`, `_gemv_kernel`): 8- and 4-bit codes
  split in registers, other widths through the lookup's chunk unpacker; tensor cores on the
  transposed product for small M, classic tiles for larger M.
- "cublas", large M (compute-bound; int5 and int6 from M = 65): dequantize CHUNK_BYTES of rows
  at a time (the lookup's arithmetic) into a scratch buffer, multiply it with cuBLAS into the
  output's columns; OVERLAP dequantizes the next chunk on a side stream (two buffers). The
  scratch is bounded (96 MiB, twice that with OVERLAP) and freed after the call.

Deterministic: no atomics anywhere. Where the vocabulary gives too few programs to fill the
GPU (small TP shards) the hidden size is split into float32 partials [split, M, N] that one
`sum` reduces in a fixed order; the chunks and cuBLAS calls are the same every call.
Accuracy: float32 accumulation in another order than the reference, one rounding of the
logits (relative error about 2e-3 against x @ dequant(W)^T in float32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..formats import PackedRows, TableFormat
from .triton_lookup import dequant_chunks, spec_of, units_of


@triton.jit
def _weight_tile(units_ptr, codes8_ptr, row_off, row_off8, kc, cmask, scales_ptr, mins_ptr,
                 rn_safe, scale_stride, srow, mrow,
                 BN: tl.constexpr, NKC: tl.constexpr, FAST: tl.constexpr,
                 BITS: tl.constexpr, U: tl.constexpr, UNIT_BITS: tl.constexpr,
                 GROUP: tl.constexpr, SIGNED: tl.constexpr, FP8: tl.constexpr,
                 HAS_MIN: tl.constexpr, POST_SCALE: tl.constexpr, DT: tl.constexpr):
    """Dequantized [BN, NKC * 8] tile of W in DT. FAST: 8-bit codes loaded as one byte per
    value, or 4-bit codes as bytes split into nibbles, with group scales broadcast over
    [BN, groups, GROUP] (GROUP a power of two dividing the tile); otherwise the generic
    chunk path of the lookup."""
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
                if SIGNED:
                    lo = (lo ^ 128) - 128
                    hi = (hi ^ 128) - 128
                v = tl.interleave(lo, hi).to(tl.float32)
        else:  # 4-bit: two values per byte, low nibble first
            k = kc * 4 + tl.arange(0, BK // 2)
            raw = tl.load(codes8_ptr + row_off8 + k[None, :]).to(tl.int32)
            lo = raw & 15
            hi = raw >> 4
            if SIGNED:
                lo = (lo ^ 8) - 8
                hi = (hi ^ 8) - 8
            v = tl.interleave(lo, hi).to(tl.float32)
        if POST_SCALE:
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
        return dequant_chunks(units_ptr, row_off, chunk[None, :], cmask, scale, mn,
                              BITS, U, UNIT_BITS, SIGNED, FP8, not POST_SCALE, HAS_MIN, DT)


@triton.jit
def _linear_kernel(x_ptr, units_ptr, codes8_ptr, scales_ptr, mins_ptr, out_ptr,
                   M, N, cols, nchunk, k_chunks_per_split, stride_xm, code_stride, code8_stride,
                   scale_stride, stride_om, stride_split,
                   BM: tl.constexpr, BN: tl.constexpr, NKC: tl.constexpr, SWAP: tl.constexpr,
                   SPLIT: tl.constexpr, POST_SCALE: tl.constexpr, FAST: tl.constexpr,
                   BITS: tl.constexpr, U: tl.constexpr, UNIT_BITS: tl.constexpr,
                   GROUP: tl.constexpr, SIGNED: tl.constexpr, FP8: tl.constexpr,
                   HAS_MIN: tl.constexpr, EVEN_K: tl.constexpr):
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
        w = _weight_tile(units_ptr, codes8_ptr, row_off, row_off8, kc, cmask, scales_ptr, mins_ptr,
                         rn_safe, scale_stride, srow, mrow, BN, NKC, FAST, BITS, U, UNIT_BITS,
                         GROUP, SIGNED, FP8, HAS_MIN, POST_SCALE, xdt)
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
def _gemv_step(x_ptr, units_ptr, codes8_ptr, row_off, row_off8, kc, rn_safe, scales_ptr, mins_ptr,
               scale_stride, srow, mrow, M, cols, nchunk, stride_xm,
               MP: tl.constexpr, BN: tl.constexpr, NKC: tl.constexpr, POST_SCALE: tl.constexpr,
               FAST: tl.constexpr, BITS: tl.constexpr, U: tl.constexpr, UNIT_BITS: tl.constexpr,
               GROUP: tl.constexpr, SIGNED: tl.constexpr, FP8: tl.constexpr,
               HAS_MIN: tl.constexpr, EVEN_K: tl.constexpr):
    """One [BN, BK] block of W times up to four rows of x, elementwise (summed later)."""
    BK: tl.constexpr = NKC * 8
    chunk = kc + tl.arange(0, NKC)
    if EVEN_K:
        cmask = (chunk >= 0)[None, :] & (rn_safe >= 0)[:, None]
    else:
        cmask = (chunk < nchunk)[None, :] & (rn_safe >= 0)[:, None]
    w = _weight_tile(units_ptr, codes8_ptr, row_off, row_off8, kc, cmask, scales_ptr, mins_ptr,
                     rn_safe, scale_stride, srow, mrow, BN, NKC, FAST, BITS, U, UNIT_BITS,
                     GROUP, SIGNED, FP8, HAS_MIN, POST_SCALE, tl.float32)
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
def _gemv_kernel(x_ptr, units_ptr, codes8_ptr, scales_ptr, mins_ptr, out_ptr,
                 M, N, cols, nchunk, stride_xm, code_stride, code8_stride, scale_stride, stride_om,
                 MP: tl.constexpr, BN: tl.constexpr, NKC: tl.constexpr, POST_SCALE: tl.constexpr,
                 FAST: tl.constexpr, BITS: tl.constexpr, U: tl.constexpr, UNIT_BITS: tl.constexpr,
                 GROUP: tl.constexpr, SIGNED: tl.constexpr, FP8: tl.constexpr,
                 HAS_MIN: tl.constexpr, EVEN_K: tl.constexpr):
    """CUDA-core GEMV for a handful of rows (M <= MP <= 4): each program streams BN whole
    rows of W in long contiguous pieces and keeps [BN, BK] float32 partial sums per row of x,
    reduced once at the end. No tensor cores, no shared-memory staging."""
    pid_n = tl.program_id(0)
    rn = pid_n * BN + tl.arange(0, BN)
    nmask = rn < N
    rn_safe = tl.where(nmask, rn, 0).to(tl.int64)
    row_off = rn_safe[:, None] * code_stride
    row_off8 = rn_safe[:, None] * code8_stride
    srow = tl.zeros([BN, 1], dtype=tl.float32)
    mrow = srow
    if GROUP == 0:
        srow = tl.load(scales_ptr + rn_safe * scale_stride).to(tl.float32)[:, None]
        if HAS_MIN:
            mrow = tl.load(mins_ptr + rn_safe * scale_stride).to(tl.float32)[:, None]
    # The first block is peeled: the partial sums take the layout of the weight loads
    # (16-byte vectors) instead of a default one that would split the loads into bytes.
    acc0, acc1, acc2, acc3 = _gemv_step(x_ptr, units_ptr, codes8_ptr, row_off, row_off8, 0, rn_safe,
                                        scales_ptr, mins_ptr, scale_stride, srow, mrow, M, cols,
                                        nchunk, stride_xm, MP, BN, NKC, POST_SCALE, FAST, BITS, U,
                                        UNIT_BITS, GROUP, SIGNED, FP8, HAS_MIN, EVEN_K)
    for kc in range(NKC, nchunk, NKC):
        p0, p1, p2, p3 = _gemv_step(x_ptr, units_ptr, codes8_ptr, row_off, row_off8, kc, rn_safe,
                                    scales_ptr, mins_ptr, scale_stride, srow, mrow, M, cols,
                                    nchunk, stride_xm, MP, BN, NKC, POST_SCALE, FAST, BITS, U,
                                    UNIT_BITS, GROUP, SIGNED, FP8, HAS_MIN, EVEN_K)
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



# -- packed words: the small-M kernels ------------------------------------------------------
#
# A row's codes are read as 32-bit words, U of them holding P = 32 * U / BITS values ("a
# block": int8 1 word / 4 values, int4 1 / 8, int6 3 / 16, int5 5 / 32, fp8 1 / 4). A tile
# is T blocks of BN rows: U strided [BN, T] word loads that together cover T * U contiguous
# words per row. Value J of every block ("piece" J) is cut out with compile-time shifts and
# multiplied with the matching columns of x (t * P + J), so nothing is interleaved back into
# column order. Integer levels become floats without the int->float unit (16 per clock and
# multiprocessor on Hopper, the bottleneck of a plain conversion): OR the level into the
# mantissa of 2^23 and subtract 2^23 (plus the sign offset) in one float add.


@triton.jit
def _pick(w0, w1, w2, w3, w4, w5, w6, A: tl.constexpr):
    r = w0
    if A == 1:
        r = w1
    if A == 2:
        r = w2
    if A == 3:
        r = w3
    if A == 4:
        r = w4
    if A == 5:
        r = w5
    if A == 6:
        r = w6
    return r


@triton.jit
def _level(w0, w1, w2, w3, w4, w5, w6, J: tl.constexpr, BITS: tl.constexpr,
           SIGNED: tl.constexpr, FP8: tl.constexpr, MAGIC: tl.constexpr):
    """Piece J of every block, as float32 levels (fp8: values)."""
    LO: tl.constexpr = J * BITS
    A: tl.constexpr = LO // 32
    S: tl.constexpr = LO % 32
    u = _pick(w0, w1, w2, w3, w4, w5, w6, A)
    if S > 0:
        u = u >> S
    if S + BITS > 32:
        u = u | (_pick(w0, w1, w2, w3, w4, w5, w6, A + 1) << (32 - S))
    MASK: tl.constexpr = (1 << BITS) - 1
    HALF: tl.constexpr = 1 << (BITS - 1)
    if FP8:
        v = (u & 255).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    elif MAGIC:
        if SIGNED:  # two's complement code ^ HALF = level + HALF, unsigned
            f = ((u & MASK) ^ HALF) | 0x4B000000
            v = f.to(tl.float32, bitcast=True) - (8388608.0 + HALF)
        else:
            f = (u & MASK) | 0x4B000000
            v = f.to(tl.float32, bitcast=True) - 8388608.0
    else:
        q = (u & MASK).to(tl.int32)
        if SIGNED:
            q = (q ^ HALF) - HALF
        v = q.to(tl.float32)
    return v


@triton.jit
def _load_word(p, mask, EVEN: tl.constexpr):
    if EVEN:  # no mask: a masked load is split into 4-byte loads
        w = tl.load(p)
    else:
        w = tl.load(p, mask=mask, other=0)
    return w.to(tl.uint32, bitcast=True)


@triton.jit
def _load_words(wp, U: tl.constexpr, mask, EVEN: tl.constexpr = False):
    """The U words of every block; EVEN: the tile is inside the row, so no mask (rows
    beyond the table read row 0 and are not stored)."""
    w0 = _load_word(wp, mask, EVEN)
    w1 = w0
    w2 = w0
    w3 = w0
    w4 = w0
    w5 = w0
    w6 = w0
    if U > 1:
        w1 = _load_word(wp + 1, mask, EVEN)
    if U > 2:
        w2 = _load_word(wp + 2, mask, EVEN)
    if U > 3:
        w3 = _load_word(wp + 3, mask, EVEN)
    if U > 4:
        w4 = _load_word(wp + 4, mask, EVEN)
    if U > 5:
        w5 = _load_word(wp + 5, mask, EVEN)
    if U > 6:
        w6 = _load_word(wp + 6, mask, EVEN)
    return w0, w1, w2, w3, w4, w5, w6


@triton.jit
def _words_kernel(x_ptr, words_ptr, scales_ptr, mins_ptr, out_ptr,
                  M, N, nblk, blk_per_split, stride_xm, word_stride, scale_stride, stride_om,
                  stride_split,
                  MMA: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, T: tl.constexpr,
                  BITS: tl.constexpr, U: tl.constexpr, P: tl.constexpr, GROUP: tl.constexpr,
                  SIGNED: tl.constexpr, FP8: tl.constexpr, HAS_MIN: tl.constexpr,
                  MAGIC: tl.constexpr, SPLIT: tl.constexpr, EVEN: tl.constexpr,
                  SB: tl.constexpr, XPERM: tl.constexpr):
    """logits[rm, rn] for BN rows of W against BM rows of x (padded with zero rows).

    MMA: tensor cores on the transposed product (dequantized W piece [BN, T] @ x piece^T
    [T, BM]), the piece scaled to x's dtype first (as the reference rounds it). Otherwise
    CUDA cores (BM <= 4): float32 products of levels and x per block, the block's scale
    (and minimum times the block's sum of x) applied once per block.
    SB: the tile holds whole groups; their scales are loaded once per group and broadcast
    over its blocks. XPERM: x comes permuted to [M, P, blocks], so piece J's columns of x
    are contiguous."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    nmask = rn < N
    rn_safe = tl.where(nmask, rn, 0).to(tl.int64)
    rm = tl.arange(0, BM)
    mmask = rm < M
    xdt = x_ptr.dtype.element_ty
    BLOCK_SCALE: tl.constexpr = GROUP == 0 or GROUP % P == 0
    if GROUP == 0:
        srow = tl.load(scales_ptr + rn_safe * scale_stride).to(tl.float32)[:, None]
        mrow = srow
        if HAS_MIN:
            mrow = tl.load(mins_ptr + rn_safe * scale_stride).to(tl.float32)[:, None]
    if MMA:
        acc = tl.zeros([BN, BM], dtype=tl.float32)
    else:
        acc0 = tl.zeros([BN, T], dtype=tl.float32)
        acc1 = acc0
        acc2 = acc0
        acc3 = acc0
    k_begin = pid_k * blk_per_split
    k_end = tl.minimum(k_begin + blk_per_split, nblk)
    for kt in range(k_begin, k_end, T):
        t = kt + tl.arange(0, T)
        if EVEN:
            wmask = (t >= 0)[None, :] & (rn_safe >= 0)[:, None]
            tmask = t >= 0
        else:
            tmask = t < k_end
            wmask = tmask[None, :] & (rn_safe >= 0)[:, None]
        wp = words_ptr + rn_safe[:, None] * word_stride + (t * U)[None, :]
        w0, w1, w2, w3, w4, w5, w6 = _load_words(wp, U, wmask, EVEN)
        if GROUP != 0:
            if SB:
                NG: tl.constexpr = (T * P) // GROUP
                gi = (kt * P) // GROUP + tl.arange(0, NG)
                soff = rn_safe[:, None] * scale_stride + gi[None, :]
                sg = tl.load(scales_ptr + soff).to(tl.float32)
                sblk = tl.reshape(tl.broadcast_to(sg[:, :, None], [BN, NG, GROUP // P]), [BN, T])
                mblk = sblk
                if HAS_MIN:
                    mg = tl.load(mins_ptr + soff).to(tl.float32)
                    mblk = tl.reshape(tl.broadcast_to(mg[:, :, None], [BN, NG, GROUP // P]), [BN, T])
            elif BLOCK_SCALE:
                soff = rn_safe[:, None] * scale_stride + ((t * P) // GROUP)[None, :]
                sblk = tl.load(scales_ptr + soff, mask=wmask, other=0).to(tl.float32)
                mblk = sblk
                if HAS_MIN:
                    mblk = tl.load(mins_ptr + soff, mask=wmask, other=0).to(tl.float32)
        else:
            sblk = srow
            mblk = mrow
        if not MMA:
            p0 = tl.zeros([BN, T], dtype=tl.float32)
            p1 = p0
            p2 = p0
            p3 = p0
            xs0 = tl.zeros([T], dtype=tl.float32)
            xs1 = xs0
            xs2 = xs0
            xs3 = xs0
        for J in tl.static_range(P):
            lev = _level(w0, w1, w2, w3, w4, w5, w6, J, BITS, SIGNED, FP8, MAGIC)
            col = t * P + J
            if XPERM:
                xcol = J * nblk + t
            else:
                xcol = col
            if not BLOCK_SCALE:  # the block spans groups: scale each piece
                soff = rn_safe[:, None] * scale_stride + (col // GROUP)[None, :]
                sp = tl.load(scales_ptr + soff, mask=wmask, other=0).to(tl.float32)
                lev = lev * sp
                if HAS_MIN:
                    lev = lev + tl.load(mins_ptr + soff, mask=wmask, other=0).to(tl.float32)
            if MMA:
                if BLOCK_SCALE:
                    if not (GROUP == 0 and not HAS_MIN):  # else: row scale after the dot
                        lev = lev * sblk
                        if HAS_MIN:
                            lev = lev + mblk
                if EVEN:
                    xt = tl.load(x_ptr + rm[:, None] * stride_xm + xcol[None, :], mask=mmask[:, None], other=0)
                else:
                    xt = tl.load(x_ptr + rm[:, None] * stride_xm + xcol[None, :],
                                 mask=mmask[:, None] & tmask[None, :], other=0)
                acc = tl.dot(lev.to(xdt), tl.trans(xt), acc)
            else:
                if EVEN:
                    x0 = tl.load(x_ptr + xcol).to(tl.float32)
                else:
                    x0 = tl.load(x_ptr + xcol, mask=tmask, other=0).to(tl.float32)
                p0 += lev * x0[None, :]
                xs0 += x0
                if BM > 1:
                    x1 = tl.load(x_ptr + stride_xm + xcol, mask=tmask & (t * 0 + M > 1), other=0).to(tl.float32)
                    p1 += lev * x1[None, :]
                    xs1 += x1
                if BM > 2:
                    x2 = tl.load(x_ptr + 2 * stride_xm + xcol, mask=tmask & (t * 0 + M > 2), other=0).to(tl.float32)
                    x3 = tl.load(x_ptr + 3 * stride_xm + xcol, mask=tmask & (t * 0 + M > 3), other=0).to(tl.float32)
                    p2 += lev * x2[None, :]
                    p3 += lev * x3[None, :]
                    xs2 += x2
                    xs3 += x3
        if not MMA:
            if BLOCK_SCALE:
                acc0 += p0 * sblk
                if HAS_MIN:
                    acc0 += mblk * xs0[None, :]
                if BM > 1:
                    acc1 += p1 * sblk
                    if HAS_MIN:
                        acc1 += mblk * xs1[None, :]
                if BM > 2:
                    acc2 += p2 * sblk
                    acc3 += p3 * sblk
                    if HAS_MIN:
                        acc2 += mblk * xs2[None, :]
                        acc3 += mblk * xs3[None, :]
            else:
                acc0 += p0
                if BM > 1:
                    acc1 += p1
                if BM > 2:
                    acc2 += p2
                    acc3 += p3
    odt = out_ptr.dtype.element_ty
    if MMA:
        if GROUP == 0 and not HAS_MIN:
            acc = acc * srow
        optr = out_ptr + rm.to(tl.int64)[None, :] * stride_om + rn[:, None]
        omask = mmask[None, :] & nmask[:, None]
        if SPLIT:
            tl.store(optr + pid_k.to(tl.int64) * stride_split, acc, mask=omask)
        else:
            tl.store(optr, acc.to(odt), mask=omask)
    else:
        optr = out_ptr + pid_k.to(tl.int64) * stride_split + rn
        r0 = tl.sum(acc0, axis=1)
        if SPLIT:
            tl.store(optr, r0, mask=nmask)
        else:
            tl.store(optr, r0.to(odt), mask=nmask)
        if BM > 1:
            r1 = tl.sum(acc1, axis=1)
            if SPLIT:
                tl.store(optr + stride_om, r1, mask=nmask & (rn * 0 + M > 1))
            else:
                tl.store(optr + stride_om, r1.to(odt), mask=nmask & (rn * 0 + M > 1))
        if BM > 2:
            r2 = tl.sum(acc2, axis=1)
            r3 = tl.sum(acc3, axis=1)
            if SPLIT:
                tl.store(optr + 2 * stride_om, r2, mask=nmask & (rn * 0 + M > 2))
                tl.store(optr + 3 * stride_om, r3, mask=nmask & (rn * 0 + M > 3))
            else:
                tl.store(optr + 2 * stride_om, r2.to(odt), mask=nmask & (rn * 0 + M > 2))
                tl.store(optr + 3 * stride_om, r3.to(odt), mask=nmask & (rn * 0 + M > 3))


# -- packed words on tensor cores, one dot per tile ("wdot") ---------------------------------
#
# The P pieces of a tile of T blocks are put back into column order with a tree of joins
# (`_wtree`: pieces J, J + STEP, ... joined even-then-odd, recursively), so one tile is one
# [BN, T * P] operand and one dot with x's matching [BM, T * P] columns (no permutation of x,
# no dot per piece). Each weight is decoded once for all BM rows of x.


@triton.jit
def _wpiece(w0, w1, w2, w3, w4, w5, w6, J: tl.constexpr, BITS: tl.constexpr, SIGNED: tl.constexpr,
            FP8: tl.constexpr, PRE: tl.constexpr, HAS_MIN: tl.constexpr, BLOCK_SCALE: tl.constexpr,
            sblk, mblk, soff0, t, scales_ptr, mins_ptr, wmask, P: tl.constexpr, GROUP: tl.constexpr,
            DT: tl.constexpr):
    """Piece J of every block [BN, T], dequantized (PRE) or as levels, in DT."""
    lev = _level(w0, w1, w2, w3, w4, w5, w6, J, BITS, SIGNED, FP8, True)
    if not BLOCK_SCALE:  # the block spans groups: this piece's own scales
        soff = soff0 + ((t * P + J) // GROUP)[None, :]
        lev = lev * tl.load(scales_ptr + soff, mask=wmask, other=0).to(tl.float32)
        if HAS_MIN:
            lev = lev + tl.load(mins_ptr + soff, mask=wmask, other=0).to(tl.float32)
    elif PRE:
        lev = lev * sblk
        if HAS_MIN:
            lev = lev + mblk
    return lev.to(DT)


@triton.jit
def _wtree(w0, w1, w2, w3, w4, w5, w6, J: tl.constexpr, STEP: tl.constexpr, N: tl.constexpr,
           BITS: tl.constexpr, SIGNED: tl.constexpr, FP8: tl.constexpr, PRE: tl.constexpr,
           HAS_MIN: tl.constexpr, BLOCK_SCALE: tl.constexpr, sblk, mblk, soff0, t, scales_ptr,
           mins_ptr, wmask, P: tl.constexpr, GROUP: tl.constexpr, DT: tl.constexpr):
    """Pieces J, J + STEP, ..., J + (N - 1) * STEP as [BN, T, N] (one piece: [BN, T]). The
    even half and the odd half, joined: element i of the result is piece J + i * STEP."""
    if N == 1:
        return _wpiece(w0, w1, w2, w3, w4, w5, w6, J, BITS, SIGNED, FP8, PRE, HAS_MIN, BLOCK_SCALE,
                       sblk, mblk, soff0, t, scales_ptr, mins_ptr, wmask, P, GROUP, DT)
    else:
        e = _wtree(w0, w1, w2, w3, w4, w5, w6, J, 2 * STEP, N // 2, BITS, SIGNED, FP8, PRE, HAS_MIN,
                   BLOCK_SCALE, sblk, mblk, soff0, t, scales_ptr, mins_ptr, wmask, P, GROUP, DT)
        o = _wtree(w0, w1, w2, w3, w4, w5, w6, J + STEP, 2 * STEP, N // 2, BITS, SIGNED, FP8, PRE,
                   HAS_MIN, BLOCK_SCALE, sblk, mblk, soff0, t, scales_ptr, mins_ptr, wmask, P,
                   GROUP, DT)
        return tl.reshape(tl.join(e, o), [e.shape[0], e.shape[1], N])


@triton.jit
def _wtile(w0, w1, w2, w3, w4, w5, w6, BITS: tl.constexpr, SIGNED: tl.constexpr, FP8: tl.constexpr,
           PRE: tl.constexpr, HAS_MIN: tl.constexpr, BLOCK_SCALE: tl.constexpr, sblk, mblk, soff0, t,
           scales_ptr, mins_ptr, wmask, P: tl.constexpr, GROUP: tl.constexpr, DT: tl.constexpr):
    """The tile [BN, T * P] in column order."""
    v = _wtree(w0, w1, w2, w3, w4, w5, w6, 0, 1, P, BITS, SIGNED, FP8, PRE, HAS_MIN, BLOCK_SCALE,
               sblk, mblk, soff0, t, scales_ptr, mins_ptr, wmask, P, GROUP, DT)
    return tl.reshape(v, [v.shape[0], v.shape[1] * P])


@triton.jit
def _wdot_kernel(x_ptr, words_ptr, scales_ptr, mins_ptr, out_ptr,
                 M, N, nblk, blk_per_split, stride_xm, word_stride, scale_stride, stride_om,
                 stride_split,
                 BM: tl.constexpr, BN: tl.constexpr, T: tl.constexpr, BITS: tl.constexpr,
                 U: tl.constexpr, P: tl.constexpr, GROUP: tl.constexpr, SIGNED: tl.constexpr,
                 FP8: tl.constexpr, HAS_MIN: tl.constexpr, SPLIT: tl.constexpr,
                 EVEN: tl.constexpr, SB: tl.constexpr, SWAP: tl.constexpr,
                 GPOST: tl.constexpr = False):
    """logits[rm, rn] for BN rows of W against up to BM rows of x (masked rows are zeros):
    per tile of T blocks, the words are decoded once into a [BN, T * P] tile in column order
    (scaled and rounded to x's dtype as the reference does, or raw levels with one scale per
    row applied after the dot) and multiplied on tensor cores with x's [BM, T * P] columns.
    GPOST (SWAP, whole groups of >= 16 columns per tile): one dot per group on the raw levels,
    its [BN, BM] result scaled (plus the minimum times the group's sum of x) in float32."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    nmask = rn < N
    rn_safe = tl.where(nmask, rn, 0).to(tl.int64)
    rm = tl.program_id(2) * BM + tl.arange(0, BM)
    mmask = rm < M
    xdt = x_ptr.dtype.element_ty
    K: tl.constexpr = T * P
    BLOCK_SCALE: tl.constexpr = GROUP == 0 or GROUP % P == 0
    PRE: tl.constexpr = not (GROUP == 0 and not HAS_MIN)  # else: the row scale after the dot
    soff0 = rn_safe[:, None] * scale_stride
    srow = tl.zeros([BN, 1], dtype=tl.float32)
    mrow = srow
    if GROUP == 0:
        srow = tl.load(scales_ptr + rn_safe * scale_stride).to(tl.float32)[:, None]
        if HAS_MIN:
            mrow = tl.load(mins_ptr + rn_safe * scale_stride).to(tl.float32)[:, None]
    if SWAP:  # W on the left: [BN, K] @ [K, BM]
        acc = tl.zeros([BN, BM], dtype=tl.float32)
    else:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
    k_begin = pid_k * blk_per_split
    k_end = tl.minimum(k_begin + blk_per_split, nblk)
    for kt in range(k_begin, k_end, T):
        if GPOST:
            TG: tl.constexpr = GROUP // P
            for g in tl.static_range(K // GROUP):
                tg = kt + g * TG + tl.arange(0, TG)
                kg = (kt + g * TG) * P + tl.arange(0, GROUP)
                if EVEN:
                    gmask = (tg >= 0)[None, :] & (rn_safe >= 0)[:, None]
                    xgmask = mmask[:, None]
                else:
                    gmask = (tg < k_end)[None, :] & (rn_safe >= 0)[:, None]
                    xgmask = mmask[:, None] & (kg < k_end * P)[None, :]
                wpg = words_ptr + rn_safe[:, None] * word_stride + (tg * U)[None, :]
                g0, g1, g2, g3, g4, g5, g6 = _load_words(wpg, U, gmask, EVEN)
                lev = _wtile(g0, g1, g2, g3, g4, g5, g6, BITS, SIGNED, FP8, False, HAS_MIN, True,
                             srow, mrow, soff0, tg, scales_ptr, mins_ptr, gmask, P, GROUP, xdt)
                xg = tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_xm + kg[None, :], mask=xgmask, other=0)
                smask = (rn_safe[:, None] * 0 + (kt + g * TG)) < k_end  # [BN, 1]
                sp = scales_ptr + soff0 + (kt * P) // GROUP + g
                acc += tl.dot(lev, tl.trans(xg)) * tl.load(sp, mask=smask, other=0).to(tl.float32)
                if HAS_MIN:
                    mp = mins_ptr + soff0 + (kt * P) // GROUP + g
                    xsum = tl.reshape(tl.sum(xg.to(tl.float32), axis=1), [1, BM])
                    acc += tl.load(mp, mask=smask, other=0).to(tl.float32) * xsum
        else:
            t = kt + tl.arange(0, T)
            kk = kt * P + tl.arange(0, K)
            if EVEN:
                wmask = (t >= 0)[None, :] & (rn_safe >= 0)[:, None]
                xmask = mmask[:, None]  # constant along the row: the loads stay vectors
            else:
                wmask = (t < k_end)[None, :] & (rn_safe >= 0)[:, None]
                xmask = mmask[:, None] & (kk < k_end * P)[None, :]
            wp = words_ptr + rn_safe[:, None] * word_stride + (t * U)[None, :]
            w0, w1, w2, w3, w4, w5, w6 = _load_words(wp, U, wmask, EVEN)
            sblk = srow  # one scale per row, or the per-piece scales (not BLOCK_SCALE)
            mblk = mrow
            if GROUP != 0 and BLOCK_SCALE:
                if SB:  # whole groups per tile: one load per group, broadcast over its blocks
                    NG: tl.constexpr = K // GROUP
                    gi = (kt * P) // GROUP + tl.arange(0, NG)
                    sg = tl.load(scales_ptr + soff0 + gi[None, :]).to(tl.float32)
                    sblk = tl.reshape(tl.broadcast_to(sg[:, :, None], [BN, NG, GROUP // P]), [BN, T])
                    if HAS_MIN:
                        mg = tl.load(mins_ptr + soff0 + gi[None, :]).to(tl.float32)
                        mblk = tl.reshape(tl.broadcast_to(mg[:, :, None], [BN, NG, GROUP // P]), [BN, T])
                else:
                    soff = soff0 + ((t * P) // GROUP)[None, :]
                    sblk = tl.load(scales_ptr + soff, mask=wmask, other=0).to(tl.float32)
                    if HAS_MIN:
                        mblk = tl.load(mins_ptr + soff, mask=wmask, other=0).to(tl.float32)
            w = _wtile(w0, w1, w2, w3, w4, w5, w6, BITS, SIGNED, FP8, PRE, HAS_MIN, BLOCK_SCALE, sblk,
                       mblk, soff0, t, scales_ptr, mins_ptr, wmask, P, GROUP, xdt)
            xt = tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_xm + kk[None, :], mask=xmask, other=0)
            if SWAP:
                acc = tl.dot(w, tl.trans(xt), acc)
            else:
                acc = tl.dot(xt, tl.trans(w), acc)
    if SWAP:
        if not PRE:
            acc = acc * srow
        optr = out_ptr + rm.to(tl.int64)[None, :] * stride_om + rn[:, None]
        omask = mmask[None, :] & nmask[:, None]
    else:
        if not PRE:
            acc = acc * tl.reshape(srow, [1, BN])
        optr = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
        omask = mmask[:, None] & nmask[None, :]
    if SPLIT:
        tl.store(optr + pid_k.to(tl.int64) * stride_split, acc, mask=omask)
    else:
        tl.store(optr, acc.to(out_ptr.dtype.element_ty), mask=omask)


# -- packed words on CUDA cores, several rows of x per launch ("rows") -----------------------


@triton.jit
def _rows_kernel(x_ptr, words_ptr, scales_ptr, mins_ptr, out_ptr,
                 M, N, nblk, blk_per_split, stride_xm, word_stride, scale_stride, stride_om,
                 stride_split,
                 BM: tl.constexpr, BN: tl.constexpr, T: tl.constexpr, BITS: tl.constexpr,
                 U: tl.constexpr, P: tl.constexpr, GROUP: tl.constexpr, SIGNED: tl.constexpr,
                 FP8: tl.constexpr, HAS_MIN: tl.constexpr, SPLIT: tl.constexpr,
                 EVEN: tl.constexpr, SB: tl.constexpr, XPERM: tl.constexpr):
    """The CUDA-core word GEMV for BM rows of x at once: every weight is decoded once and
    multiplied with all BM rows ([BM, BN, T] float32 partial sums); the block's scale (and
    minimum times the block's sum of x) applied once per block and row."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    nmask = rn < N
    rn_safe = tl.where(nmask, rn, 0).to(tl.int64)
    rm = tl.program_id(2) * BM + tl.arange(0, BM)
    mmask = rm < M
    BLOCK_SCALE: tl.constexpr = GROUP == 0 or GROUP % P == 0
    ROWPOST: tl.constexpr = GROUP == 0 and not HAS_MIN
    soff0 = rn_safe[:, None] * scale_stride
    srow = tl.zeros([BN, 1], dtype=tl.float32)
    mrow = srow
    if GROUP == 0:
        srow = tl.load(scales_ptr + rn_safe * scale_stride).to(tl.float32)[:, None]
        if HAS_MIN:
            mrow = tl.load(mins_ptr + rn_safe * scale_stride).to(tl.float32)[:, None]
    acc = tl.zeros([BM, BN, T], dtype=tl.float32)
    k_begin = pid_k * blk_per_split
    k_end = tl.minimum(k_begin + blk_per_split, nblk)
    for kt in range(k_begin, k_end, T):
        t = kt + tl.arange(0, T)
        if EVEN:
            wmask = (t >= 0)[None, :] & (rn_safe >= 0)[:, None]
            tmask = t >= 0
        else:
            tmask = t < k_end
            wmask = tmask[None, :] & (rn_safe >= 0)[:, None]
        wp = words_ptr + rn_safe[:, None] * word_stride + (t * U)[None, :]
        w0, w1, w2, w3, w4, w5, w6 = _load_words(wp, U, wmask, EVEN)
        sblk = srow  # one scale per row, or the per-piece scales (not BLOCK_SCALE)
        mblk = mrow
        if GROUP != 0 and BLOCK_SCALE:
            if SB:
                NG: tl.constexpr = (T * P) // GROUP
                gi = (kt * P) // GROUP + tl.arange(0, NG)
                sg = tl.load(scales_ptr + soff0 + gi[None, :]).to(tl.float32)
                sblk = tl.reshape(tl.broadcast_to(sg[:, :, None], [BN, NG, GROUP // P]), [BN, T])
                if HAS_MIN:
                    mg = tl.load(mins_ptr + soff0 + gi[None, :]).to(tl.float32)
                    mblk = tl.reshape(tl.broadcast_to(mg[:, :, None], [BN, NG, GROUP // P]), [BN, T])
            else:
                soff = soff0 + ((t * P) // GROUP)[None, :]
                sblk = tl.load(scales_ptr + soff, mask=wmask, other=0).to(tl.float32)
                if HAS_MIN:
                    mblk = tl.load(mins_ptr + soff, mask=wmask, other=0).to(tl.float32)
        if ROWPOST:
            p = acc
        else:
            p = tl.zeros([BM, BN, T], dtype=tl.float32)
        xs = tl.zeros([BM, T], dtype=tl.float32)
        for J in tl.static_range(P):
            lev = _level(w0, w1, w2, w3, w4, w5, w6, J, BITS, SIGNED, FP8, True)
            if XPERM:
                xcol = J * nblk + t
            else:
                xcol = t * P + J
            if not BLOCK_SCALE:
                soff = soff0 + ((t * P + J) // GROUP)[None, :]
                lev = lev * tl.load(scales_ptr + soff, mask=wmask, other=0).to(tl.float32)
                if HAS_MIN:
                    lev = lev + tl.load(mins_ptr + soff, mask=wmask, other=0).to(tl.float32)
            if EVEN:
                xv = tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_xm + xcol[None, :],
                             mask=mmask[:, None], other=0).to(tl.float32)
            else:
                xv = tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_xm + xcol[None, :],
                             mask=mmask[:, None] & tmask[None, :], other=0).to(tl.float32)
            p += lev[None, :, :] * xv[:, None, :]
            if HAS_MIN and BLOCK_SCALE:
                xs += xv
        if ROWPOST:
            acc = p
        elif BLOCK_SCALE:
            acc += p * sblk[None, :, :]
            if HAS_MIN:
                acc += mblk[None, :, :] * xs[:, None, :]
        else:
            acc += p
    r = tl.sum(acc, axis=2)
    if ROWPOST:
        r = r * tl.reshape(srow, [1, BN])
    optr = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    omask = mmask[:, None] & nmask[None, :]
    if SPLIT:
        tl.store(optr + pid_k.to(tl.int64) * stride_split, r, mask=omask)
    else:
        tl.store(optr, r.to(out_ptr.dtype.element_ty), mask=omask)


# -- large M: dequantize bounded row chunks, multiply with cuBLAS --------------------------


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def tiles_config(m: int, n: int, cols: int, bits: int) -> dict:
    """Kernel and tile shapes, from sweeps on an H200 (table 262144 x 2560,
    bench/bench_kernels.py --sweep gemm). One row of x: the CUDA-core GEMV. 2..16 rows: the
    transposed tensor-core tile with x padded to 16 rows (Triton 3.6 compiled M=4 to a
    kernel 2-3x slower than M=16). Formats read through strided units (6, 5, 3 bits...)
    keep the transposed tile at every M: Triton 3.6 fails to compile them in the big one."""
    if m == 1:
        if bits == 8:
            return dict(GEMV=True, BN=16, BK=256, num_warps=4, num_stages=1)
        return dict(GEMV=True, BN=16, BK=128, num_warps=2, num_stages=1)
    if m <= 16:
        return dict(BM=16, BN=64, BK=128, SWAP=True, num_warps=4, num_stages=2 if bits == 8 else 4,
                    PAD_M=True)
    if m <= 64 or bits not in (4, 8):
        return dict(BM=64, BN=64, BK=128, SWAP=True, num_warps=4, num_stages=3)
    if bits == 8:
        return dict(BM=128, BN=256, BK=64, SWAP=False, num_warps=8, num_stages=4)
    return dict(BM=128, BN=128, BK=64, SWAP=False, num_warps=8, num_stages=3)


def _linear_tiles(fmt: TableFormat, spec, table: PackedRows, x2: torch.Tensor, cols: int,
                  out: torch.Tensor, config: dict | None) -> torch.Tensor:
    """The generic tile kernels (any width, any cols): the fallback of the word kernels."""
    m, n = x2.shape[0], table.num_rows
    units, per_chunk, unit_bits = units_of(table.codes, spec.bits)
    cfg = dict(tiles_config(m, n, cols, spec.bits))
    if config:
        cfg.update(config)
    scales = table.scales
    mins = table.mins if table.mins is not None else scales
    post = spec.group == 0 and spec.signed and not spec.fp8
    if cfg.get("PAD_M") and m < cfg["BM"]:
        # Same kernel as for a full tile of rows; the extra rows are zeros, sliced off.
        padded = x2.new_zeros((cfg["BM"], cols))
        padded[:m] = x2
        cfg = {k: v for k, v in cfg.items() if k != "PAD_M"}
        full = torch.empty((cfg["BM"], n), dtype=out.dtype, device=out.device)
        _linear_tiles(fmt, spec, table, padded, cols, full, cfg)
        out.copy_(full[:m])
        return out
    if cfg.get("GEMV") and m <= 4 and n > 0:
        nkc = cfg["BK"] // 8
        nchunk = math.ceil(cols / 8)
        even_k = nchunk % nkc == 0 and cols % 8 == 0
        group_ok = spec.group == 0 or (spec.group & (spec.group - 1) == 0 and cfg["BK"] % spec.group == 0)
        fast = cfg.get("FAST", True) and even_k and spec.bits in (4, 8) and group_ok
        _gemv_kernel[(triton.cdiv(n, cfg["BN"]),)](
            x2, units, table.codes, scales, mins, out,
            m, n, cols, nchunk, x2.stride(0), units.stride(0), table.codes.stride(0),
            scales.stride(0), out.stride(0),
            MP=1 if m == 1 else (2 if m == 2 else 4), BN=cfg["BN"], NKC=nkc, POST_SCALE=post,
            FAST=fast, BITS=spec.bits, U=per_chunk, UNIT_BITS=unit_bits, GROUP=spec.group,
            SIGNED=spec.signed, FP8=spec.fp8, HAS_MIN=spec.has_min, EVEN_K=even_k,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
        return out
    nchunk = math.ceil(cols / 8)

    def fast_path(bk: int) -> bool:
        even = nchunk % (bk // 8) == 0 and cols % 8 == 0
        group_ok = spec.group == 0 or (spec.group & (spec.group - 1) == 0 and bk % spec.group == 0)
        return cfg.get("FAST", True) and even and spec.bits in (4, 8) and group_ok

    if not fast_path(cfg["BK"]) and per_chunk > 1 and not cfg["SWAP"]:
        # Triton 3.6 fails to compile strided-unit tiles as the right-hand operand: use the
        # transposed tile (dequantized weights on the left) at any M.
        cfg.update(BM=64, BN=64, BK=128, SWAP=True, num_warps=4, num_stages=3)
    bm, bn, bk = cfg["BM"], cfg["BN"], cfg["BK"]
    nkc = bk // 8
    fast = fast_path(bk)
    even_k = nchunk % nkc == 0 and cols % 8 == 0
    grid_m, grid_n = triton.cdiv(m, bm), triton.cdiv(n, bn)
    # Split the hidden size only when the vocabulary leaves multiprocessors idle.
    split = cfg.get("SPLIT_K") or 1
    if "SPLIT_K" not in cfg and grid_m * grid_n < 2 * _num_sms(x2.device):
        split = max(1, min(triton.cdiv(nchunk, nkc), (4 * _num_sms(x2.device)) // (grid_m * grid_n)))
    per_split = triton.cdiv(triton.cdiv(nchunk, split), nkc) * nkc  # a multiple of nkc
    split = triton.cdiv(nchunk, per_split)
    dest = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x2.device)
    stages = cfg["num_stages"]
    _linear_kernel[(grid_m, grid_n, split)](
        x2, units, table.codes, scales, mins, dest,
        m, n, cols, nchunk, per_split, x2.stride(0), units.stride(0), table.codes.stride(0),
        scales.stride(0), dest.stride(-2), dest.stride(0) if split > 1 else 0,
        BM=bm, BN=bn, NKC=nkc, SWAP=cfg["SWAP"], SPLIT=split > 1, POST_SCALE=post, FAST=fast,
        BITS=spec.bits, U=per_chunk, UNIT_BITS=unit_bits, GROUP=spec.group, SIGNED=spec.signed,
        FP8=spec.fp8, HAS_MIN=spec.has_min, EVEN_K=even_k,
        num_warps=cfg["num_warps"], num_stages=stages,
    )
    if split > 1:
        out.copy_(dest.sum(dim=0))  # a fixed order: the same bits every run
    return out


# -- host side: the word kernels, the cuBLAS path, and the choice between them ---------------


def _block_shape(bits: int) -> tuple[int, int]:
    """(words per block U, values per block P) for BITS-bit codes in 32-bit words."""
    u = bits // math.gcd(bits, 32)
    return u, 32 * u // bits


def words_of(table: PackedRows, spec, cols: int) -> torch.Tensor | None:
    """The codes as [rows, words] int32 (a view, no copy), or None when the row is not a
    whole number of blocks or the view is not 4-byte aligned."""
    codes = table.codes
    u, p = _block_shape(spec.bits)
    if cols % p or codes.shape[1] % 4 or codes.stride(-1) != 1 or codes.stride(0) % 4:
        return None
    if codes.data_ptr() % 4:
        return None
    try:
        return codes.view(torch.int32)
    except RuntimeError:
        return None


@dataclass(frozen=True)
class Route:
    """One row of the M dispatch: up to MAX_M rows of x, on the formats named (and tables of
    at least MIN_COLS columns), run CONFIG. TILE: the weights a word tile spans in one row (its
    T is TILE // P for a format of P values per block). WHY: what the H200 sweep measured."""

    max_m: int
    formats: tuple[str, ...]
    config: dict
    why: str
    min_cols: int = 0
    tile: int = 0


def _gemv(bn: int, xperm: bool) -> dict:
    return dict(KIND="gemv", BM=1, BN=bn, num_warps=4, num_stages=1, XPERM=xperm)


def _wdot(bm: int, bn: int, warps: int, stages: int, **flags) -> dict:
    return dict(KIND="wdot", BM=bm, BN=bn, num_warps=warps, num_stages=stages, **flags)


TILES = dict(KIND="tiles")

#: The M dispatch: the first row that takes (M, format, width) wins; docs/BENCHMARKS.md
#: explains it row by row. Ratios to BF16 cuBLAS in the same run (`bench/bench_gemm.py
#: --sweep`, tables 262144 x 2560 and 151936 x 4096). M that no row takes goes to cuBLAS.
ROUTES = (
    Route(1, ("int4",), _gemv(32, True), "32 rows a program, x permuted", tile=512),
    Route(1, ("int8",), _gemv(32, True), "as int4, on rows of 4096+", min_cols=4096, tile=512),
    Route(1, ("int8", "fp8"), _gemv(16, True), "16 rows a program, x permuted", tile=256),
    Route(1, ("int5", "int6"), _gemv(16, False), "8-16 pieces read x from L1 faster as is",
          tile=256),
    Route(16, ("fp8",), _wdot(16, 128, 4, 3), "no per-weight scale: 0.65-0.67x against "
          "0.76-0.80x for 'tiles'", tile=128),
    Route(16, ("int5",), _wdot(16, 128, 4, 1), "1.68-1.76x against 1.81-2.07x for one dot per "
          "piece", tile=128),
    Route(16, ("int8",), _wdot(16, 64, 4, 3, GPOST=True), "group scale after the dot: 0.70x "
          "against 0.78-0.83x for 'tiles'", tile=128),
    Route(16, ("int4", "int6"), TILES, "the generic tiles: int4 0.67-0.70x, int6 1.66-1.71x "
          "(262144 x 2560)"),
    Route(64, ("int8",), _wdot(64, 128, 4, 1, SWAP=False), "x on the left, one stage: "
          "0.96-1.00x against 1.01-1.23x (3 stages)", tile=128),
    Route(64, ("int5", "int6"), _wdot(64, 64, 4, 1), "2.0-2.9x against 2.9-3.1x for cuBLAS",
          tile=128),
    Route(64, ("int4", "fp8"), TILES, "the generic tiles: int4 0.97x, fp8 0.92x at M = 64"),
    Route(128, ("fp8",), _wdot(128, 256, 8, 3, SWAP=False), "1.26-1.38x against 1.33-1.49x for "
          "'tiles'", tile=64),
    Route(128, ("int8",), _wdot(128, 128, 8, 3, SWAP=False), "1.30-1.47x against 2.71-2.77x for "
          "cuBLAS", tile=64),
    Route(128, ("int4",), TILES, "the generic tiles: 1.31x at M = 128"),
    Route(256, ("int4", "int8"), _wdot(256, 64, 8, 3, SWAP=False), "every row of x in one "
          "tile, each weight decoded once: 1.56-1.71x against 1.78-1.87x ('tiles') and "
          "2.06-2.08x (cuBLAS, int8)", tile=64),
    Route(256, ("fp8",), _wdot(256, 64, 4, 3, SWAP=False), "as int4 and int8, 4 warps", tile=64),
)


def linear_config(m: int, n: int, cols: int, bits: int, fp8: bool = False) -> dict:
    """The kernel and its shape for m rows of x: the first of ROUTES that takes this m, format
    and width, else cuBLAS on dequantized chunks. KIND: 'gemv' (word kernel on CUDA cores, one
    row of x), 'wdot' (word tiles in column order, one tensor-core dot per tile, x's rows
    masked up to BM), 'tiles' (the generic tile kernels), 'cublas' (dequantize CHUNK_BYTES of
    rows at a time, multiply with cuBLAS). 'rows' and 'mma' are kept as options the sweep
    compares."""
    name = "fp8" if fp8 else f"int{bits}"
    for route in ROUTES:
        if m <= route.max_m and name in route.formats and cols >= route.min_cols:
            if not route.tile:
                return dict(route.config)
            return dict(route.config, T=max(1, route.tile // _block_shape(bits)[1]))
    return dict(KIND="cublas", CHUNK_BYTES=96 << 20, OVERLAP=m <= 1024)


def _pow2_ceil(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def _linear_words(spec, table: PackedRows, words: torch.Tensor, x2: torch.Tensor, cols: int,
                  out: torch.Tensor, cfg: dict) -> torch.Tensor | None:
    """The word kernels, one launch for all rows of x: 'gemv' (M = 1; more rows go to
    'rows'), 'rows' (CUDA cores, BM rows of x per program), 'wdot' (one dot per tile on
    tensor cores), 'mma' (one dot per piece). None: 'wdot' does not fit the row (a row that
    is no whole number of tiles); the caller takes the generic kernels."""
    m, n = x2.shape[0], table.num_rows
    u, p = _block_shape(spec.bits)
    kind = cfg["KIND"]
    if kind == "gemv" and m > 1:
        kind = "rows"
        cfg = dict(cfg, BM=min(4, _pow2_ceil(m)))
    bm, bn, t = cfg["BM"], cfg["BN"], cfg["T"]
    if kind == "rows":
        bm = min(bm, _pow2_ceil(m))
    if kind == "gemv":
        bm = 1
    nblk = cols // p
    grid_n = triton.cdiv(n, bn)
    grid_m = triton.cdiv(m, bm) if kind != "mma" else 1
    split = cfg.get("SPLIT_K") or 1
    if "SPLIT_K" not in cfg and grid_n * grid_m < 2 * _num_sms(x2.device):
        split = max(1, min(triton.cdiv(nblk, t), (4 * _num_sms(x2.device)) // (grid_n * grid_m)))
    g = spec.group
    whole_groups = g != 0 and g % p == 0 and (t * p) % g == 0  # a tile holds whole groups
    swap = cfg.get("SWAP", True)
    if kind == "wdot":
        # Whole tiles in every split (the masked tail of 'wdot' was not verified on a GPU):
        # a row that is no whole number of tiles takes the generic kernels instead.
        if nblk % t:
            return None
        # GPOST asks for whole groups per dot; other layouts (per-row scales, groups wider
        # than a tile) keep the generic kernels the heuristic chose for them before GPOST.
        if cfg.get("GPOST") and not (swap and g >= 16 and whole_groups):
            return None
        split = min(split, nblk // t)
        while (nblk // t) % split:
            split -= 1
    per_split = triton.cdiv(triton.cdiv(nblk, split), t) * t
    split = triton.cdiv(nblk, per_split)
    scales = table.scales
    mins = table.mins if table.mins is not None else scales
    even = nblk % per_split == 0 and per_split % t == 0
    sb = cfg.get("SB", True) and even and whole_groups and ((t * p) // g) & ((t * p) // g - 1) == 0
    xperm = cfg.get("XPERM", False) and kind != "wdot"
    if xperm:  # [m, blocks, P] -> [m, P, blocks]: piece J's columns contiguous
        xp = x2.view(m, nblk, p).transpose(1, 2).contiguous().view(m, cols)
        x2 = xp if kind == "mma" else xp.float()
    common = dict(BITS=spec.bits, U=u, P=p, GROUP=spec.group, SIGNED=spec.signed, FP8=spec.fp8,
                  HAS_MIN=spec.has_min, SPLIT=split > 1, EVEN=even, SB=sb,
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if kind in ("rows", "wdot"):
        dest = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x2.device)
        args = (x2, words, scales, mins, dest, m, n, nblk, per_split, x2.stride(0), words.stride(0),
                scales.stride(0), dest.stride(-2), dest.stride(0) if split > 1 else 0)
        if kind == "rows":
            _rows_kernel[(grid_n, split, grid_m)](*args, BM=bm, BN=bn, T=t, XPERM=xperm, **common)
        else:
            _wdot_kernel[(grid_n, split, grid_m)](*args, BM=bm, BN=bn, T=t, SWAP=swap,
                                                 GPOST=bool(cfg.get("GPOST")), **common)
        if split > 1:
            out.copy_(dest.sum(dim=0))  # a fixed order: the same bits every run
        return out
    mma = kind == "mma"
    for start in range(0, m, bm):  # 'mma' beyond BM rows: one launch per tile of rows
        xs, os_ = x2[start:start + bm], out[start:start + bm]
        rows = xs.shape[0]
        dest = os_ if split == 1 else torch.empty((split, rows, n), dtype=torch.float32, device=x2.device)
        _words_kernel[(grid_n, split)](
            xs, words, scales, mins, dest,
            rows, n, nblk, per_split, xs.stride(0), words.stride(0), scales.stride(0),
            dest.stride(-2), dest.stride(0) if split > 1 else 0,
            MMA=mma, BM=bm, BN=bn, T=t, MAGIC=cfg.get("MAGIC", True), XPERM=xperm, **common,
        )
        if split > 1:
            os_.copy_(dest.sum(dim=0))  # a fixed order: the same bits every run
    return out


WORD_KINDS = ("gemv", "rows", "wdot", "mma")

_SIDE_STREAMS: dict = {}


def dequant_rows(fmt: TableFormat, spec, table: PackedRows, start: int, out: torch.Tensor, cols: int) -> None:
    """Rows start .. start + len(out) of the table, dequantized into `out` [len, cols]: the
    lookup kernel on consecutive ids (equal to fmt.dequantize)."""
    from .triton_lookup import lookup, lookup_config

    nrows = out.shape[0]
    ids = torch.arange(start, start + nrows, device=out.device)
    config = lookup_config(max(nrows, 2048), cols, spec)  # the prefill tiling: a whole chunk
    lookup(fmt, table, ids, cols, out.dtype, config=config, out=out)


def _linear_cublas(fmt: TableFormat, spec, table: PackedRows, x2: torch.Tensor, cols: int,
                   out: torch.Tensor, cfg: dict) -> torch.Tensor:
    """Compute-bound sizes: dequantize CHUNK_BYTES of rows at a time into one scratch buffer
    (reused, so it stays in L2) and multiply it with cuBLAS straight into the output's
    columns. Deterministic: no atomics, the same chunks every call. OVERLAP: two buffers,
    the next chunk dequantized on a side stream while cuBLAS multiplies this one."""
    n = table.num_rows
    rows = max(256, (cfg.get("CHUNK_BYTES", 48 << 20) // (cols * x2.element_size())) // 256 * 256)
    rows = min(rows, n)
    starts = list(range(0, n, rows))
    if not cfg.get("OVERLAP") or len(starts) == 1 or x2.device.type != "cuda":
        buf = torch.empty((rows, cols), dtype=x2.dtype, device=x2.device)
        for s in starts:
            e = min(n, s + rows)
            w = buf[: e - s]
            dequant_rows(fmt, spec, table, s, w, cols)
            torch.mm(x2, w.t(), out=out[:, s:e])
        return out
    cur = torch.cuda.current_stream(x2.device)
    side = _SIDE_STREAMS.get(x2.device)
    if side is None:
        side = _SIDE_STREAMS[x2.device] = torch.cuda.Stream(x2.device)
    bufs = [torch.empty((rows, cols), dtype=x2.dtype, device=x2.device) for _ in range(2)]
    ready = [torch.cuda.Event() for _ in starts]
    done = [torch.cuda.Event() for _ in starts]
    side.wait_stream(cur)

    def produce(i):
        s = starts[i]
        with torch.cuda.stream(side):
            if i >= 2:
                side.wait_event(done[i - 2])  # its buffer's last reader
            dequant_rows(fmt, spec, table, s, bufs[i % 2][: min(n, s + rows) - s], cols)
            ready[i].record(side)

    produce(0)
    for i, s in enumerate(starts):
        if i + 1 < len(starts):
            produce(i + 1)
        e = min(n, s + rows)
        cur.wait_event(ready[i])
        torch.mm(x2, bufs[i % 2][: e - s].t(), out=out[:, s:e])
        done[i].record(cur)
    cur.wait_stream(side)
    return out


def linear(fmt: TableFormat, table: PackedRows, x: torch.Tensor, cols: int,
           config: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [..., cols] @ dequant(table)^T -> [..., rows] in x.dtype (into `out` [m, rows] if
    given); None if the format is not one the kernels handle. Deterministic: the same inputs
    give the same bits every call (no atomics; split sums are reduced in a fixed order)."""
    spec = spec_of(fmt, cols)
    if spec is None or x.dtype not in (torch.bfloat16, torch.float16):
        return None
    lead = x.shape[:-1]
    x2 = x.reshape(-1, cols)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n = x2.shape[0], table.num_rows
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*lead, n)
    # An explicit config (tests, benchmark sweeps) replaces the heuristic whole: merged into
    # the heuristic's choice, it would inherit flags such as SWAP or GPOST it does not name.
    cfg = dict(config) if config else linear_config(m, n, cols, spec.bits, spec.fp8)
    kind = cfg.get("KIND", "tiles")
    if kind == "cublas":
        _linear_cublas(fmt, spec, table, x2, cols, out, cfg)
        return out.view(*lead, n)
    words = words_of(table, spec, cols) if kind in WORD_KINDS else None
    if words is None or _linear_words(spec, table, words, x2, cols, out, cfg) is None:
        _linear_tiles(fmt, spec, table, x2, cols, out, None if kind in WORD_KINDS else cfg)
    return out.view(*lead, n)
