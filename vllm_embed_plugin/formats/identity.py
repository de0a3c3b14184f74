"""The lossless format: the table as it was loaded (for host placement, where the point is
where the table lives, not how small it is). The method sets `dtype` to the loaded table's."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import ColumnImportance, GroupRounder, PackedRows, TableFormat


@dataclass(frozen=True)
class IdentityFormat(TableFormat):
    name: str
    dtype: torch.dtype = torch.bfloat16

    def bits_per_weight(self, cols: int) -> float:
        return float(torch.finfo(self.dtype).bits)

    def empty(self, rows: int, cols: int, device) -> PackedRows:
        return PackedRows(
            codes=torch.empty(rows, cols, dtype=self.dtype, device=device),
            scales=torch.empty(rows, 0, dtype=torch.float32, device=device),
        )

    def describe(self, cols: int) -> str:
        return f"{self.name} (lossless {str(self.dtype).removeprefix('torch.')})"

    def quantize(
        self,
        rows: torch.Tensor,
        importance: ColumnImportance | None = None,
        round_group: GroupRounder | None = None,
    ) -> PackedRows:
        return PackedRows(
            codes=rows.to(self.dtype), scales=rows.new_empty(rows.shape[0], 0, dtype=torch.float32)
        )

    def dequantize(self, packed: PackedRows, cols: int, dtype: torch.dtype) -> torch.Tensor:
        return packed.codes.to(dtype)
