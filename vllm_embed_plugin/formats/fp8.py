"""fp8 e4m3 codes with one float scale per group (absmax maps to 448, e4m3's largest value)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .base import ColumnImportance, GroupRounder, PackedRows, TableFormat

E4M3_MAX = 448.0


@dataclass(frozen=True)
class Fp8Format(TableFormat):
    name: str
    #: Columns per scale; None means one scale for the whole row.
    group_size: int | None

    def group_cols(self, cols: int) -> int:
        return cols if self.group_size is None else self.group_size

    def num_groups(self, cols: int) -> int:
        return math.ceil(cols / self.group_cols(cols))

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.float32 if self.group_size is None else torch.float16

    def bits_per_weight(self, cols: int) -> float:
        return 8 + self.num_groups(cols) * torch.finfo(self.scale_dtype).bits / cols

    def empty(self, rows: int, cols: int, device) -> PackedRows:
        return PackedRows(
            codes=torch.empty(rows, cols, dtype=torch.uint8, device=device),
            scales=torch.empty(rows, self.num_groups(cols), dtype=self.scale_dtype, device=device),
        )

    def describe(self, cols: int) -> str:
        group = "row" if self.group_size is None else str(self.group_size)
        return f"{self.name} (e4m3, group {group}, {self.bits_per_weight(cols):.2f} bits/weight)"

    def quantize(
        self,
        rows: torch.Tensor,
        importance: ColumnImportance | None = None,
        round_group: GroupRounder | None = None,
    ) -> PackedRows:
        n, cols = rows.shape
        g, groups = self.group_cols(cols), self.num_groups(cols)
        x = torch.nn.functional.pad(rows.float(), (0, groups * g - cols)).view(n, groups, g)
        scale = (x.abs().amax(-1, keepdim=True) / E4M3_MAX).to(self.scale_dtype).float()
        inv = torch.where(scale > 0, 1.0 / torch.where(scale > 0, scale, 1.0), 0.0)
        codes = (x * inv).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return PackedRows(
            codes=codes.view(n, groups * g)[:, :cols].contiguous().view(torch.uint8),
            scales=scale.squeeze(-1).to(self.scale_dtype),
        )

    def dequantize(self, packed: PackedRows, cols: int, dtype: torch.dtype) -> torch.Tensor:
        n = packed.num_rows
        g, groups = self.group_cols(cols), self.num_groups(cols)
        values = packed.codes.view(torch.float8_e4m3fn).float()
        values = torch.nn.functional.pad(values, (0, groups * g - cols)).view(n, groups, g)
        return (
            (values * packed.scales.float().unsqueeze(-1)).view(n, groups * g)[:, :cols].to(dtype)
        )
