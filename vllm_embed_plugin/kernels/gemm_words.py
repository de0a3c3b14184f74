"""The word kernels of the head GEMM ("gemv", "rows", "wdot", "mma"): codes read as 32-bit
words, each weight decoded once. `triton_linear` chooses between these and the generic tiles
(`gemm_tiles`).

A row's codes are read as 32-bit words, U of them holding P = 32 * U / BITS values ("a
block": int8 1 word / 4 values, int4 1 / 8, fp8 1 / 4; 3- and 7-bit codes 3 / 32 and 7 / 32;
5- and 6-bit rows are two planes, which these kernels do not read). A tile
is T blocks of BN rows: U strided [BN, T] word loads that together cover T * U contiguous
words per row. Value J of every block ("piece" J) is cut out with compile-time shifts and
multiplied with the matching columns of x (t * P + J), so nothing is interleaved back into
column order. Integer levels become floats without the int->float unit (16 per clock and
multiprocessor on Hopper, the bottleneck of a plain conversion): OR the level into the
mantissa of 2^23 and subtract 2^23 (plus the sign offset) in one float add. The CUDA-core
GEMV is bound by such integer operations per weight, not by loads (docs/BENCHMARKS.md); for
4-bit codes it puts the code into the mantissa of 2^4 with one shift and one bitwise op and
takes the constant offset off once per block (`_biased_level`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..formats import PackedRows
from .gemm_tiles import num_sms, word_order
from .nibbles import NIBBLES_BF16, NIBBLES_BF16_SIGNED, NIBBLES_FP16, NIBBLES_FP16_SIGNED


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
def _biased_level(w0, w1, w2, w3, w4, w5, w6, J: tl.constexpr, BITS: tl.constexpr,
                  SIGNED: tl.constexpr):
    """Piece J of every block as the float32 2^BITS + level (+ 2^(BITS-1) if SIGNED), for
    codes that never straddle two words: the code's bits moved into the mantissa of 2^BITS by
    one shift, masked and joined with the exponent (and the sign flip) by one bitwise op; no
    float subtraction per weight. The caller takes the offset off once per block (times the
    block's sum of x); a float of BITS + 1 significant bits times x's 8 to 11 is exact in
    float32, so only the block sums round."""
    LO: tl.constexpr = J * BITS
    S: tl.constexpr = LO % 32
    tl.static_assert(S + BITS <= 32, "_biased_level: a code straddles two words")
    E: tl.constexpr = 23 - BITS  # where the code goes: the low bits of 2^BITS's mantissa
    MASK: tl.constexpr = ((1 << BITS) - 1) << E
    FLIP: tl.constexpr = (1 << (BITS - 1)) << E if SIGNED else 0
    HEAD: tl.constexpr = ((127 + BITS) << 23) | FLIP
    u = _pick(w0, w1, w2, w3, w4, w5, w6, LO // 32)
    if S > E:
        u = u >> (S - E)
    elif S < E:
        u = u << (E - S)
    return ((u & MASK) ^ HEAD).to(tl.float32, bitcast=True)


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
    # CUDA cores, 4-bit codes: levels offset by a constant (`_biased_level`), taken off once
    # per block. Measured on an H100 (docs/BENCHMARKS.md): int4 at M = 1 8-9% faster; int5,
    # int6 and int8 0.4-1.3% slower, so they keep `_level`.
    BIASED: tl.constexpr = MAGIC and not MMA and BLOCK_SCALE and BITS == 4
    OFFSET: tl.constexpr = (1 << BITS) + ((1 << (BITS - 1)) if SIGNED else 0)  # _biased_level's
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
            if BIASED:
                lev = _biased_level(w0, w1, w2, w3, w4, w5, w6, J, BITS, SIGNED)
            else:
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
            if BIASED:
                p0 -= OFFSET * xs0[None, :]
                if BM > 1:
                    p1 -= OFFSET * xs1[None, :]
                if BM > 2:
                    p2 -= OFFSET * xs2[None, :]
                    p3 -= OFFSET * xs3[None, :]
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
def _nibble_levels(w, SIGNED: tl.constexpr, DT: tl.constexpr, PTX: tl.constexpr):
    """The 8 levels of every word of 4-bit codes [BN, W] (W a multiple of 4) as a [BN, W * 8]
    tile of DT (bf16 or fp16), exact. PTX: two levels per packed instruction (`nibbles.nibble_asm`);
    else plain operations (Triton's CPU interpreter runs no PTX). The columns are in the
    order of wgmma's A operand, so the decoded pairs go to the dot without a trip through
    shared memory: within every 4 words, column 8m + 2q + b holds nibble m + 4b of word q
    (four lanes hold the four words; `gemm_tiles.word_order` orders x's columns alike)."""
    C: tl.constexpr = "=h,=h,=h,=h,=h,=h,=h,=h,r"
    if not PTX:  # `_level` on a one-word block, without the float tricks
        p0 = _level(w, w, w, w, w, w, w, 0, 4, SIGNED, False, False).to(DT)
        p1 = _level(w, w, w, w, w, w, w, 1, 4, SIGNED, False, False).to(DT)
        p2 = _level(w, w, w, w, w, w, w, 2, 4, SIGNED, False, False).to(DT)
        p3 = _level(w, w, w, w, w, w, w, 3, 4, SIGNED, False, False).to(DT)
        p4 = _level(w, w, w, w, w, w, w, 4, 4, SIGNED, False, False).to(DT)
        p5 = _level(w, w, w, w, w, w, w, 5, 4, SIGNED, False, False).to(DT)
        p6 = _level(w, w, w, w, w, w, w, 6, 4, SIGNED, False, False).to(DT)
        p7 = _level(w, w, w, w, w, w, w, 7, 4, SIGNED, False, False).to(DT)
    elif DT == tl.bfloat16:
        asm: tl.constexpr = NIBBLES_BF16_SIGNED if SIGNED else NIBBLES_BF16
        p0, p1, p2, p3, p4, p5, p6, p7 = tl.inline_asm_elementwise(
            asm, C, [w], (tl.bfloat16,) * 8, is_pure=True, pack=1)
    else:
        asm: tl.constexpr = NIBBLES_FP16_SIGNED if SIGNED else NIBBLES_FP16
        p0, p1, p2, p3, p4, p5, p6, p7 = tl.inline_asm_elementwise(
            asm, C, [w], (tl.float16,) * 8, is_pure=True, pack=1)
    # Element (b, i, j) of [BN, W, 2, 2, 2] is nibble m + 4b with m = 2i + j; split the words
    # into [W / 4, 4] and order [words / 4, m, word, b].
    v = tl.join(tl.join(tl.join(p0, p4), tl.join(p2, p6)),
                tl.join(tl.join(p1, p5), tl.join(p3, p7)))
    v = tl.permute(tl.reshape(v, [w.shape[0], w.shape[1] // 4, 4, 2, 2, 2]), (0, 1, 4, 5, 2, 3))
    return tl.reshape(v, [w.shape[0], w.shape[1] * 8])


@triton.jit
def _wdot_kernel(x_ptr, words_ptr, scales_ptr, mins_ptr, out_ptr,
                 M, N, nblk, blk_per_split, stride_xm, word_stride, scale_stride, stride_om,
                 stride_split,
                 BM: tl.constexpr, BN: tl.constexpr, T: tl.constexpr, BITS: tl.constexpr,
                 U: tl.constexpr, P: tl.constexpr, GROUP: tl.constexpr, SIGNED: tl.constexpr,
                 FP8: tl.constexpr, HAS_MIN: tl.constexpr, SPLIT: tl.constexpr,
                 EVEN: tl.constexpr, SB: tl.constexpr, SWAP: tl.constexpr,
                 GPOST: tl.constexpr = False, PACK: tl.constexpr = False,
                 PTX: tl.constexpr = True):
    """logits[rm, rn] for BN rows of W against up to BM rows of x (masked rows are zeros):
    per tile of T blocks, the words are decoded once into a [BN, T * P] tile in column order
    (scaled and rounded to x's dtype as the reference does, or raw levels with one scale per
    row applied after the dot) and multiplied on tensor cores with x's [BM, T * P] columns.
    GPOST (SWAP, whole groups of >= 16 columns per tile): one dot per group on the raw levels,
    its [BN, BM] result scaled (plus the minimum times the group's sum of x) in float32.
    PACK (4-bit codes, levels dotted raw: GPOST or one scale per row): the levels decoded two
    per instruction (`_nibble_levels`; PTX off: plain operations, for the interpreter), the
    tile's columns and x's in wgmma's order (x permuted by `gemm_tiles.word_order`)."""
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
                if PACK:
                    lev = _nibble_levels(g0, SIGNED, xdt, PTX)
                else:
                    lev = _wtile(g0, g1, g2, g3, g4, g5, g6, BITS, SIGNED, FP8, False, HAS_MIN,
                                 True, srow, mrow, soff0, tg, scales_ptr, mins_ptr, gmask, P, GROUP,
                                 xdt)
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
            if PACK and not PRE:
                w = _nibble_levels(w0, SIGNED, xdt, PTX)
            else:
                w = _wtile(w0, w1, w2, w3, w4, w5, w6, BITS, SIGNED, FP8, PRE, HAS_MIN, BLOCK_SCALE,
                           sblk, mblk, soff0, t, scales_ptr, mins_ptr, wmask, P, GROUP, xdt)
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


def block_shape(bits: int) -> tuple[int, int]:
    """(words per block U, values per block P) for BITS-bit codes in 32-bit words."""
    u = bits // math.gcd(bits, 32)
    return u, 32 * u // bits


def words_of(table: PackedRows, spec, cols: int) -> torch.Tensor | None:
    """The codes as [rows, words] int32 (a view, no copy), or None when the row is not a
    whole number of blocks or the view is not 4-byte aligned, or is two planes (5- and 6-bit
    codes: the generic tiles read those as fast as 4-bit ones)."""
    codes = table.codes
    if spec.high:
        return None
    u, p = block_shape(spec.bits)
    if cols % p or codes.shape[1] % 4 or codes.stride(-1) != 1 or codes.stride(0) % 4:
        return None
    if codes.data_ptr() % 4:
        return None
    try:
        return codes.view(torch.int32)
    except RuntimeError:
        return None


def _pow2_ceil(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def linear_words(spec, table: PackedRows, words: torch.Tensor, x2: torch.Tensor, cols: int,
                  out: torch.Tensor, cfg: dict) -> torch.Tensor | None:
    """The word kernels, one launch for all rows of x: 'gemv' (M = 1; more rows go to
    'rows'), 'rows' (CUDA cores, BM rows of x per program), 'wdot' (one dot per tile on
    tensor cores), 'mma' (one dot per piece). None: 'wdot' does not fit the row (a row that
    is no whole number of tiles); the caller takes the generic kernels."""
    m, n = x2.shape[0], table.num_rows
    u, p = block_shape(spec.bits)
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
    if "SPLIT_K" not in cfg and grid_n * grid_m < 2 * num_sms(x2.device):
        split = max(1, min(triton.cdiv(nblk, t), (4 * num_sms(x2.device)) // (grid_n * grid_m)))
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
        # PACK decodes raw 4-bit levels (x's 16-bit dtype): the dot must take them unscaled.
        # Its column order works on 4 words at a time: tiles (and GPOST's groups) of 4k words.
        raw = cfg.get("GPOST") or (g == 0 and not spec.has_min)
        words_per_dot = g // p if cfg.get("GPOST") else t
        if cfg.get("PACK") and not (spec.bits == 4 and raw and words_per_dot % 4 == 0):
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
    if kind == "wdot" and cfg.get("PACK"):
        x2 = word_order(x2, True, m)
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
                                                 GPOST=bool(cfg.get("GPOST")),
                                                 PACK=bool(cfg.get("PACK")), PTX=x2.is_cuda,
                                                 **common)
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
