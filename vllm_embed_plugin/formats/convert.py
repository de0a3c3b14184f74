"""Whole-table conversion in row chunks, so the transient stays bounded in bytes."""

from __future__ import annotations

import torch

from .base import ColumnImportance, ConversionError, PackedRows, TableFormat

#: Default bound on the conversion's transient memory (float32 copies, levels, packing).
DEFAULT_SCRATCH_BYTES = 256 << 20
#: Upper estimate of the scratch one element needs while a chunk is quantized: a float32
#: copy, padded groups, float levels, products for the scale fit and int64 words for packing.
SCRATCH_BYTES_PER_ELEMENT = 48


def chunk_rows(cols: int, scratch_bytes: int | None = None) -> int:
    return max(1, (scratch_bytes or DEFAULT_SCRATCH_BYTES) // (cols * SCRATCH_BYTES_PER_ELEMENT))


def quantize_table(
    weight: torch.Tensor,
    fmt: TableFormat,
    scratch_bytes: int | None = None,
    out: PackedRows | None = None,
    importance: ColumnImportance | None = None,
    fused: bool = True,
) -> PackedRows:
    """Quantize a [rows, cols] table chunk by chunk into `out` (by default fresh storage on
    the table's device; pinned host storage for host placement). `importance`: what an error
    in each column costs (`ColumnImportance`), for the formats that use it. `fused=False`
    skips the one-pass GPU kernel (to measure or check the chunked path against it).

    Raises ConversionError (and allocates nothing that outlives the call) if a row is not
    finite. The input is never modified."""
    rows, cols = weight.shape
    from ..kernels import quantize_rows_fast  # lazy: kernels imports formats

    # One fused pass on the GPU for the formats that have one (no scratch at all).
    if fused and importance is None and (fast := quantize_rows_fast(fmt, weight, out)) is not None:
        return fast
    if out is None:
        out = fmt.empty(rows, cols, weight.device)
    if importance is not None:
        importance = importance.to(weight.device)
    step = chunk_rows(cols, scratch_bytes)
    for start in range(0, rows, step):
        chunk = weight[start : start + step]
        if not torch.isfinite(chunk).all():
            bad = start + int((~torch.isfinite(chunk)).any(dim=1).nonzero()[0])
            raise ConversionError(f"row {bad} of the table holds NaN or Inf")
        packed = fmt.quantize(chunk, importance)
        for name, dst in out.tensors().items():
            dst[start : start + step].copy_(getattr(packed, name))
        del packed, chunk
    return out
