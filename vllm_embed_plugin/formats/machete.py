"""A symmetric int4 or int8 table stored in the layout of vLLM's Machete GEMM (Hopper), so a
tied LM head can run on `machete_mm` while the lookup reads the same bytes: no second copy.

`machete_prepack_B` (vLLM) stores the codes of a [rows, cols] table as blocks of 128 rows x 64
columns, block (k-block, n-block) at (k_block * padded_rows / 128 + n_block) * 8192 elements,
and permutes the 8192 elements inside a block by a fixed permutation of their index bits
(measured on an H200 with vLLM 0.26, and checked against vLLM's op at every conversion,
`kernels.machete`). Rows n and n + 8 share one run of 128 elements, so a lookup reads twice
the bytes of its rows: 64 B for int4, 128 B for int8, per row and block. Codes are unsigned
with a bias (vLLM's `uint4b8`, `uint8b128`); scales are in the model's dtype, [groups, rows].

The tensors keep the row-major shapes of `PackedRows` ([rows, ...]) as transposed views, so
shapes, the fake ops and memory accounting read them as any table; only this format (and
the kernels) know the bytes are not row-major. Rows are padded to a multiple of 128.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from .base import PackedRows, TableFormat
from .integer import IntFormat, pack_bits, unpack_bits

#: Machete's prepacked block: rows (output features) x columns (input features).
BLOCK_ROWS, BLOCK_COLS = 128, 64
BLOCK_ELEMENTS = BLOCK_ROWS * BLOCK_COLS
#: What Machete serves with BF16 or FP16 activations (vLLM's machete_utils).
BITS = (4, 8)
GROUP_SIZES = (64, 128)
#: Machete's group scales have the activations' dtype.
SCALE_DTYPES = (torch.bfloat16, torch.float16)


def unsupported(fmt: TableFormat, cols: int) -> str | None:
    """Why `fmt` on `cols` columns cannot take this layout, or None if it can."""
    if not isinstance(fmt, IntFormat) or not fmt.symmetric or fmt.bits not in BITS:
        return f"format {fmt.name!r} is not symmetric int4 or int8"
    if fmt.group_size not in GROUP_SIZES:
        group = "row" if fmt.group_size is None else fmt.group_size
        return f"group size {group} is not one of {', '.join(map(str, GROUP_SIZES))}"
    if cols % BLOCK_COLS:
        return f"the hidden size {cols} is not a multiple of {BLOCK_COLS}"
    return None


def element_offset(rows: torch.Tensor, cols: torch.Tensor, bits: int, padded_rows: int):
    """Element index (code number in memory order) of table entries (row, col) in the
    prepacked layout; int64 tensors that broadcast. The kernel computes the same (Triton)."""
    block = (cols // BLOCK_COLS) * (padded_rows // BLOCK_ROWS) + rows // BLOCK_ROWS
    r, c = rows % BLOCK_ROWS, cols % BLOCK_COLS
    # Index bits 7..12: row bits 0-2, 4-6; bits 3..6: column bits 4, 5, 1, 2.
    inner = (((r & 7) | ((r >> 4) << 3)) << 7) | (((c >> 4) & 3) << 3) | (((c >> 1) & 3) << 5)
    r3, c0, c3 = (r >> 3) & 1, c & 1, (c >> 3) & 1
    # Bits 0..2: int4 (row 3, column 3, column 0), int8 (column 0, row 3, column 3).
    low = (r3 | (c3 << 1) | (c0 << 2)) if bits == 4 else (c0 | (r3 << 1) | (c3 << 2))
    return block * BLOCK_ELEMENTS + inner + low


@dataclass(frozen=True)
class MacheteLayout(TableFormat):
    """`base` (symmetric int4/int8, groups of 64 or 128) in Machete's prepacked layout, with
    scales in `scale_dtype` (the activations' dtype, which Machete requires)."""

    base: IntFormat
    scale_dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        if (reason := unsupported(self.base, BLOCK_COLS)) is not None:
            raise ValueError(f"Machete layout: {reason}")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(
                f"Machete layout: scales must be bfloat16 or float16, not {self.scale_dtype}"
            )

    @property
    def row_format(self) -> IntFormat:
        """The row-major format this table is quantized in before the repack: `base` with its
        scales in `scale_dtype`, so the codes are rounded against the scales Machete reads."""
        return dataclasses.replace(self.base, group_scale_dtype=self.scale_dtype)

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.base.name

    @property
    def bits(self) -> int:
        return self.base.bits

    @property
    def group_size(self) -> int:
        return self.base.group_size

    def bits_per_weight(self, cols: int) -> float:
        return self.base.bits_per_weight(cols)  # 16-bit scales either way

    def describe(self, cols: int) -> str:
        return self.base.describe(cols) + ", in Machete's layout (logits on vLLM's Machete GEMM)"

    @staticmethod
    def padded_rows(rows: int) -> int:
        return math.ceil(rows / BLOCK_ROWS) * BLOCK_ROWS

    @property
    def bias_word(self) -> int:
        """The XOR (as a signed int32) that turns the two's-complement codes of a 32-bit word
        (four int8 or eight int4) into Machete's biased unsigned ones (uint8b128, uint4b8)."""
        return (0x88888888 if self.bits == 4 else 0x80808080) - (1 << 32)

    def from_rows(self, packed: PackedRows, cols: int) -> PackedRows:
        """The reference repack of a row-major table of `row_format` (torch, any device): what
        `kernels.machete.repack` builds with vLLM's op, and checks against this."""
        rows = packed.num_rows
        padded = self.padded_rows(rows)
        half = 1 << (self.bits - 1)  # the biased zero
        levels = unpack_bits(packed.codes, self.bits, cols, signed=False) ^ half
        n = torch.arange(rows, device=levels.device)[:, None]
        k = torch.arange(cols, device=levels.device)[None, :]
        # Padding rows hold level 0, as vLLM's prepack of zero-level rows.
        flat = torch.full((padded * cols,), half, dtype=torch.int32, device=levels.device)
        flat[element_offset(n, k, self.bits, padded).reshape(-1)] = levels.reshape(-1)
        words = pack_bits(flat.view(1, -1), self.bits).view(torch.int32).view(-1, padded)
        return self.wrap(words, self.padded_scales(packed.scales, padded), rows)

    def padded_scales(self, scales: torch.Tensor, padded: int) -> torch.Tensor:
        """[rows, groups] -> [groups, padded rows] in `scale_dtype`, zeros past the rows."""
        out = torch.zeros(scales.shape[1], padded, dtype=self.scale_dtype, device=scales.device)
        out[:, : scales.shape[0]] = scales.t()
        return out

    @staticmethod
    def wrap(words: torch.Tensor, scales: torch.Tensor, rows: int) -> PackedRows:
        """Machete's contiguous [cols * bits / 32, padded] words and [groups, padded] scales as
        [rows, ...] views (see the module doc)."""
        return PackedRows(codes=words.t()[:rows], scales=scales.t()[:rows])

    @staticmethod
    def machete_operands(table: PackedRows) -> tuple[torch.Tensor, torch.Tensor]:
        """The contiguous tensors `machete_mm` takes, from the views `wrap` made."""
        padded = table.codes.stride(1)
        words = table.codes.as_strided((table.codes.shape[1], padded), (padded, 1))
        scales = table.scales.as_strided((table.scales.shape[1], padded), (padded, 1))
        return words, scales

    def codes_at(self, words: torch.Tensor, element: torch.Tensor) -> torch.Tensor:
        """The biased codes of elements `element` (int64, from `element_offset`) of Machete's
        contiguous words."""
        per_word = 32 // self.bits
        word = words.reshape(-1)[element // per_word].long() & 0xFFFFFFFF
        return (word >> ((element % per_word) * self.bits)) & ((1 << self.bits) - 1)

    # -- TableFormat ------------------------------------------------------------------------

    def quantize(self, rows, importance=None, round_group=None) -> PackedRows:
        packed = self.row_format.quantize(rows, importance, round_group)
        return self.from_rows(packed, rows.shape[1])

    def dequantize(self, packed: PackedRows, cols: int, dtype: torch.dtype) -> torch.Tensor:
        return self.dequantize_rows(packed, slice(None), cols, dtype)

    def dequantize_rows(
        self, table: PackedRows, index: torch.Tensor | slice, cols: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """Rows `index` dequantized (the torch reference of the lookup kernel)."""
        if isinstance(index, slice):
            index = torch.arange(table.num_rows, device=table.codes.device)[index]
        words, scales = self.machete_operands(table)
        n = index.reshape(-1, 1).long()
        k = torch.arange(cols, device=index.device)[None, :]
        codes = self.codes_at(words, element_offset(n, k, self.bits, words.shape[1]))
        level = codes - (1 << (self.bits - 1))
        scale = scales[k // self.group_size, n].float()
        return (level.float() * scale).to(dtype)

    def empty(self, rows: int, cols: int, device) -> PackedRows:
        padded = self.padded_rows(rows)
        words = torch.empty(cols * self.bits // 32, padded, dtype=torch.int32, device=device)
        scales = torch.empty(cols // self.group_size, padded, dtype=self.scale_dtype, device=device)
        return self.wrap(words, scales, rows)
