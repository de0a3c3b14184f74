"""Weight-only GEMM for a tied LM head: logits [M, rows] = x [M, cols] @ dequant(W)^T.

The packed table is never densified as a whole and never copied: kernels read the lookup's
layout. Which kernel runs is a per-call choice on M (`linear_config`, from a sweep on an H200,
docs/BENCHMARKS.md):

- "gemv", M = 1: the word kernel on CUDA cores (`gemm_words._words_kernel`, MMA off). Codes are read as
  32-bit words, a block of U words holding P values (int8 1/4, int4 1/8, fp8 1/4); value J
  of each block is cut out with compile-time shifts and turned into a float by OR-ing it
  into the mantissa of 2^23 and one subtraction (no int->float unit), multiplied
  with x's matching columns (x optionally permuted so they are contiguous, XPERM), and the
  block's scale (and minimum times the block's sum of x) is applied once per block. 4-bit
  codes skip the subtraction: OR-ed into the mantissa of 2^4, their constant offset times the
  block's sum of x is taken off once per block (`gemm_words._biased_level`).
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
- "tiles": the generic tile kernels (`gemm_tiles`): 8-, 6-, 5- and 4-bit codes
  split in registers (5 and 6 bits from two planes: low nibbles as 4-bit codes, then the
  high bits), other widths through the lookup's chunk unpacker; tensor cores on the
  transposed product for small M, classic tiles for larger M.
- "cublas", large M (compute-bound; every format above M = 256): dequantize CHUNK_BYTES of rows
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

from dataclasses import dataclass

import torch

from ..formats import PackedRows, TableFormat
from .gemm_tiles import linear_tiles
from .gemm_words import WORD_KINDS, block_shape, linear_words, words_of
from .triton_lookup import spec_of


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
    """The word GEMV (`gemm_words`): BN rows of W a program."""
    return dict(KIND="gemv", BM=1, BN=bn, num_warps=4, num_stages=1, XPERM=xperm)


def _wdot(bm: int, bn: int, warps: int, stages: int, **flags) -> dict:
    return dict(KIND="wdot", BM=bm, BN=bn, num_warps=warps, num_stages=stages, **flags)


TILES = dict(KIND="tiles")


def tiles_shape(bm: int, bn: int, bk: int, warps: int, stages: int, swap: bool = True) -> dict:
    """The generic tiles at BM x BN, BK columns a step (x padded to 16 rows when BM is 16);
    never the M = 1 GEMV that `gemm_tiles.tiles_config` would otherwise lend them."""
    return dict(TILES, BM=bm, BN=bn, BK=bk, SWAP=swap, num_warps=warps, num_stages=stages,
                PAD_M=bm == 16, GEMV=False)  # fmt: skip


def _words(*shape: int) -> dict:
    """The generic tiles reading 4-bit codes (and 5- and 6-bit codes' two planes) as words
    (`gemm_tiles._word_tile`) at `tiles_shape(*shape)`, W on the left up to BM = 64; no
    shape: `gemm_tiles.tiles_config`'s."""
    if not shape:
        return dict(TILES, WORDS=True)
    return dict(tiles_shape(*shape, swap=shape[0] <= 64), WORDS=True)


#: The M dispatch: the first row that takes (M, format, width) wins; docs/BENCHMARKS.md
#: explains it row by row. Ratios to BF16 cuBLAS in the same run (`bench/bench_gemm.py
#: --sweep`, tables 262144 x 2560 and 151936 x 4096). M that no row takes goes to cuBLAS.
ROUTES = (
    Route(1, ("int4",), _gemv(32, True), "32 rows a program, x permuted", tile=512),
    Route(1, ("int8",), _gemv(32, True), "as int4, on rows of 4096+", min_cols=4096, tile=512),
    Route(1, ("int8", "fp8"), _gemv(16, True), "16 rows a program, x permuted", tile=256),
    Route(
        16,
        ("int5", "int6"),
        _words(16, 64, 256, 4, 3),
        "codes as words, x padded to 16 rows (H100): 0.49-0.55x against 0.75-0.78x for the "
        "byte tiles at M = 4-16, and the GEMV's 0.66-0.72x at M = 1",
    ),
    Route(64, ("int5", "int6"), _words(), "words (H100): 0.83-0.87x against 0.88-0.98x"),
    Route(
        128,
        ("int5",),
        _words(128, 128, 128, 8, 3),
        "words, x on the left (H100): 1.28-1.33x against 1.42-1.43x",
    ),
    Route(
        256,
        ("int5",),
        _words(256, 64, 64, 8, 3),
        "words, every row of x in one tile (H100): 1.87-2.22x against 2.43-2.69x for cuBLAS",
    ),
    Route(
        256,
        ("int6",),
        _words(),
        "words, x on the left (H100): 1.09-1.20x at M = 128 against 1.29-1.30x; 1.70-2.06x at "
        "160-256 against 2.36-2.60x for cuBLAS",
    ),
    Route(
        16,
        ("fp8",),
        _wdot(16, 128, 4, 3),
        "no per-weight scale: 0.65-0.67x against 0.76-0.80x for 'tiles'",
        tile=128,
    ),
    Route(
        16,
        ("int8",),
        _wdot(16, 64, 4, 3, GPOST=True),
        "group scale after the dot: 0.70x against 0.78-0.83x for 'tiles'",
        tile=128,
    ),
    Route(
        16,
        ("int4",),
        _words(16, 64, 256, 4, 3),
        "codes as words (H100): 0.36-0.37x against 0.48-0.52x for the byte tiles",
    ),
    Route(
        64,
        ("int8",),
        _wdot(64, 128, 4, 1, SWAP=False),
        "x on the left, one stage: 0.96-1.00x against 1.01-1.23x (3 stages)",
        tile=128,
    ),
    Route(
        64,
        ("int4",),
        _words(64, 128, 128, 8, 3),
        "codes as words (H100): 0.54-0.55x against 0.68-0.69x for the byte tiles",
    ),
    Route(64, ("fp8",), TILES, "the generic tiles: 0.92x at M = 64"),
    Route(
        128,
        ("fp8",),
        _wdot(128, 256, 8, 3, SWAP=False),
        "1.26-1.38x against 1.33-1.49x for 'tiles'",
        tile=64,
    ),
    Route(
        128,
        ("int8",),
        _wdot(128, 128, 8, 3, SWAP=False),
        "1.30-1.47x against 2.71-2.77x for cuBLAS",
        tile=64,
    ),
    Route(128, ("int4",), _words(), "codes as words (H100): 0.92-0.93x against 1.00x for bytes"),
    Route(
        256,
        ("int8",),
        _wdot(256, 128, 8, 4),
        "W on the left, every row of x in one tile (H100): 1.30-1.46x against 1.44-1.76x "
        "with x on the left",
        tile=64,
    ),
    Route(
        256,
        ("int4",),
        _wdot(256, 64, 4, 3),
        "as int8, 4 warps (H100): 1.42-1.65x against 1.56-1.90x with x on the left",
        tile=64,
    ),
    Route(
        256,
        ("fp8",),
        _wdot(256, 64, 4, 3, SWAP=False),
        "x on the left, 4 warps (W on the left not swept for fp8)",
        tile=64,
    ),
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
            return dict(route.config, T=max(1, route.tile // block_shape(bits)[1]))
    return dict(KIND="cublas", CHUNK_BYTES=96 << 20, OVERLAP=m <= 1024)


_SIDE_STREAMS: dict = {}


def dequant_rows(
    fmt: TableFormat, spec, table: PackedRows, start: int, out: torch.Tensor, cols: int
) -> None:
    """Rows start .. start + len(out) of the table, dequantized into `out` [len, cols]: the
    lookup kernel on consecutive ids (equal to fmt.dequantize)."""
    from .triton_lookup import lookup, lookup_config

    nrows = out.shape[0]
    ids = torch.arange(start, start + nrows, device=out.device)
    config = lookup_config(max(nrows, 2048), cols, spec)  # the prefill tiling: a whole chunk
    lookup(fmt, table, ids, cols, out.dtype, config=config, out=out)


def _linear_cublas(
    fmt: TableFormat,
    spec,
    table: PackedRows,
    x2: torch.Tensor,
    cols: int,
    out: torch.Tensor,
    cfg: dict,
) -> torch.Tensor:
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


def linear(
    fmt: TableFormat,
    table: PackedRows,
    x: torch.Tensor,
    cols: int,
    config: dict | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
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
    if words is None or linear_words(spec, table, words, x2, cols, out, cfg) is None:
        linear_tiles(fmt, spec, table, x2, cols, out, None if kind in WORD_KINDS else cfg)
    return out.view(*lead, n)
