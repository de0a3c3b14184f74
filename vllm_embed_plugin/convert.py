"""Whole-table conversion: one fused GPU pass where a kernel covers the format, else the
format's own rule in row chunks, so the transient stays bounded in bytes.

The one place that joins formats (what the bytes mean) with kernels (how a device computes
them): formats never import kernels."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from .formats import ColumnImportance, ConversionError, PackedRows, TableFormat
from .kernels import quantize_rows_fast, round_group_jointly_fast

#: Default bound on the conversion's transient memory (float32 copies, levels, packing).
DEFAULT_SCRATCH_BYTES = 256 << 20
#: Upper estimate of the scratch one element needs while a chunk is quantized: a float32
#: copy, padded groups, float levels, products for the scale fit and int64 words for packing.
SCRATCH_BYTES_PER_ELEMENT = 48


def row_chunks(rows: int, cols: int, scratch_bytes: int | None = None) -> Iterator[slice]:
    """Consecutive row slices of a [rows, cols] table, each small enough that quantizing it
    needs at most `scratch_bytes` of transient memory."""
    step = max(1, (scratch_bytes or DEFAULT_SCRATCH_BYTES) // (cols * SCRATCH_BYTES_PER_ELEMENT))
    return (slice(start, min(start + step, rows)) for start in range(0, rows, step))


def quantize_table(
    weight: torch.Tensor,
    fmt: TableFormat,
    scratch_bytes: int | None = None,
    out: PackedRows | None = None,
    importance: ColumnImportance | None = None,
    fused: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> PackedRows:
    """Quantize a [rows, cols] table chunk by chunk into `out` (by default fresh storage on
    the table's device; pinned host storage for host placement). `importance`: what an error
    in each column costs (`ColumnImportance`), for the formats that use it. `fused=False`
    skips the one-pass GPU kernel (to measure or check the chunked path against it).
    `progress(rows_done, rows)` is called after every chunk.

    Raises ConversionError (and allocates nothing that outlives the call) if a row is not
    finite. The input is never modified."""
    rows, cols = weight.shape
    # One fused pass on the GPU for the formats that have one (no scratch at all).
    if fused and importance is None and (fast := quantize_rows_fast(fmt, weight, out)) is not None:
        return fast
    if out is None:
        out = fmt.empty(rows, cols, weight.device)
    if importance is not None:
        importance = importance.to(weight.device)
    for part in row_chunks(rows, cols, scratch_bytes):
        chunk = weight[part]
        if not torch.isfinite(chunk).all():
            bad = part.start + int((~torch.isfinite(chunk)).any(dim=1).nonzero()[0])
            raise ConversionError(f"row {bad} of the table holds NaN or Inf")
        packed = fmt.quantize(chunk, importance, round_group=round_group_jointly_fast)
        for name, dst in out.tensors().items():
            dst[part].copy_(getattr(packed, name))
        del packed, chunk
        if progress is not None:
            progress(part.stop, rows)
    return out
