"""Lookup and tied-head matmul over packed tables: fused GPU kernels where they exist,
torch reference paths everywhere else. Imports neither vLLM nor the settings."""

from __future__ import annotations

import torch

from ..formats import PackedRows, TableFormat


def lookup(fmt: TableFormat, table: PackedRows, ids: torch.Tensor, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of the table, dequantized to `dtype`: shape ids.shape + (cols,).

    No host synchronisation, so CUDA graphs can capture it."""
    flat = ids.reshape(-1)
    out = fmt.dequantize(table.rows(flat), cols, dtype)
    return out.view(*ids.shape, cols)
