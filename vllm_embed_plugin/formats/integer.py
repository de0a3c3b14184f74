"""Integer formats: `bits`-bit codes in groups of `group_size` columns, one scale per group
(symmetric) or a scale and a minimum per group (affine).

Layout of one row: codes are a little-endian bit stream, eight values in `bits` bytes
(8-bit: one byte each; 6-bit: four values in three bytes; 4-bit: two per byte, low nibble
first). Symmetric codes are two's complement, affine codes are unsigned. Scales and minimums
are float16 for groups and float32 for a whole-row group.

Scale choice follows llama.cpp's quantizers: try a few candidate scales per group, round, then
solve least squares for the scale (and minimum) that best fits those rounded codes, and keep
the candidate with the smallest squared error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .base import PackedRows, TableFormat


@dataclass(frozen=True)
class IntFormat(TableFormat):
    name: str
    bits: int
    #: Columns per scale; None means one scale for the whole row.
    group_size: int | None
    symmetric: bool = True
    #: Candidate scales tried per group on each side of the plain one (0 = no search).
    search: int = 0

    def __post_init__(self) -> None:
        if not 2 <= self.bits <= 8:
            raise ValueError(f"bits must be 2..8, got {self.bits}")
        if self.group_size is not None and (self.group_size < 8 or self.group_size % 8):
            raise ValueError(f"group_size must be a multiple of 8, got {self.group_size}")

    # -- geometry -----------------------------------------------------------------------

    def group_cols(self, cols: int) -> int:
        return cols if self.group_size is None else self.group_size

    def num_groups(self, cols: int) -> int:
        return math.ceil(cols / self.group_cols(cols))

    def code_bytes(self, cols: int) -> int:
        return math.ceil(cols / 8) * self.bits

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.float32 if self.group_size is None else torch.float16

    def bits_per_weight(self, cols: int) -> float:
        scale_bits = torch.finfo(self.scale_dtype).bits * (1 if self.symmetric else 2)
        return (self.code_bytes(cols) * 8 + self.num_groups(cols) * scale_bits) / cols

    def empty(self, rows: int, cols: int, device) -> PackedRows:
        groups = self.num_groups(cols)
        return PackedRows(
            codes=torch.empty(rows, self.code_bytes(cols), dtype=torch.uint8, device=device),
            scales=torch.empty(rows, groups, dtype=self.scale_dtype, device=device),
            mins=None
            if self.symmetric
            else torch.empty(rows, groups, dtype=self.scale_dtype, device=device),
        )

    def describe(self, cols: int) -> str:
        group = "row" if self.group_size is None else str(self.group_size)
        kind = "symmetric" if self.symmetric else "affine"
        return f"{self.name} ({self.bits}-bit {kind}, group {group}, {self.bits_per_weight(cols):.2f} bits/weight)"

    # -- quantize / dequantize ----------------------------------------------------------

    def quantize(self, rows: torch.Tensor, importance: torch.Tensor | None = None) -> PackedRows:
        """`importance` (optional): one positive weight per column for the squared error that
        the scale search minimises, e.g. the mean square of the hidden state that multiplies
        that column in a tied LM head. It steers only the search (`search` > 0): the codes are
        always the nearest levels of the chosen scale. None weighs every column alike."""
        n, cols = rows.shape
        g = self.group_cols(cols)
        groups = self.num_groups(cols)
        x = _pad_cols(rows.float(), groups * g).view(n, groups, g)
        if importance is None:
            col_weight = torch.ones(1, cols, device=rows.device)
        else:
            col_weight = importance.to(device=rows.device, dtype=torch.float32).reshape(1, -1)
            if col_weight.shape[1] != cols or not bool((col_weight > 0).all()):
                raise ValueError(f"importance must hold {cols} positive weights, one per column")
        # Padded columns carry no weight in the fit.
        weight = _pad_cols(col_weight, groups * g).view(1, groups, g)
        if self.symmetric:
            levels, scale = _fit_symmetric(x, weight, self.bits, self.search, self.scale_dtype)
            mins = None
        else:
            levels, scale, mins = _fit_affine(x, weight, self.bits, self.search, self.scale_dtype)
            mins = mins.to(self.scale_dtype)
        codes = pack_bits(levels.view(n, groups * g)[:, :cols], self.bits)
        return PackedRows(codes=codes, scales=scale.to(self.scale_dtype), mins=mins)

    def dequantize(self, packed: PackedRows, cols: int, dtype: torch.dtype) -> torch.Tensor:
        n = packed.num_rows
        g = self.group_cols(cols)
        groups = self.num_groups(cols)
        levels = unpack_bits(packed.codes, self.bits, cols, signed=self.symmetric)
        x = _pad_cols(levels.float(), groups * g).view(n, groups, g)
        x = x * packed.scales.float().unsqueeze(-1)
        if packed.mins is not None:
            x = x + packed.mins.float().unsqueeze(-1)
        return x.view(n, groups * g)[:, :cols].to(dtype)


# -- scale fitting (pure functions on [rows, groups, group_cols] float32) ----------------


def _fit_symmetric(x: torch.Tensor, w: torch.Tensor, bits: int, search: int, scale_dtype):
    """Levels in [-2^(b-1), 2^(b-1)-1] and one scale per group.

    The plain scale depends on the width. From 5 bits up it is llama.cpp's Q8_0 rule, absmax
    to the largest positive level: no value is ever clipped, which matters more than one extra
    level. Below, it is Q4_0's "signed max": the value of largest magnitude maps to the extreme
    negative level, so all 2^b levels are used. A search refits around the signed max."""
    nmax = 2 ** (bits - 1)
    signed_max = x.gather(-1, x.abs().argmax(dim=-1, keepdim=True))  # [n, G, 1]
    # A product with the float32 reciprocal, as the fused GPU kernel computes it.
    scale = signed_max.abs() * (1.0 / (nmax - 1)) if bits >= 5 else signed_max / -nmax
    if search:
        candidates = [scale] + [signed_max / -(nmax + 0.1 * step) for step in range(-search, search + 1)]
        best_score = None
        for candidate in candidates:
            levels = torch.round(x * _safe_inv(candidate)).clamp_(-nmax, nmax - 1)
            sum_xl = (w * x * levels).sum(-1, keepdim=True)
            sum_ll = (w * levels * levels).sum(-1, keepdim=True)
            fitted = torch.where(sum_ll > 0, sum_xl / sum_ll.clamp_min(1e-30), candidate)
            # Squared error = sum w x^2 - sum_xl^2 / sum_ll, so maximise sum_xl^2 / sum_ll.
            score = sum_xl * sum_xl / sum_ll.clamp_min(1e-30)
            if best_score is None:
                best_score, best_scale = score, fitted
            else:
                best_scale = torch.where(score > best_score, fitted, best_scale)
                best_score = torch.maximum(score, best_score)
        scale = best_scale
    # Round the codes against the scale exactly as it is stored.
    scale = scale.to(scale_dtype).float()
    levels = torch.round(x * _safe_inv(scale)).clamp_(-nmax, nmax - 1)
    return levels, scale.squeeze(-1)


def _fit_affine(x: torch.Tensor, w: torch.Tensor, bits: int, search: int, scale_dtype):
    """Levels in [0, 2^b - 1], x ~ scale * level + min. The plain fit is llama.cpp's Q5_1/Q4_1:
    the group's min and max span the levels; a search refits scale and min by least squares."""
    nmax = 2**bits - 1
    big = torch.finfo(torch.float32).max
    xmin = torch.where(w > 0, x, torch.full_like(x, big)).amin(-1, keepdim=True)
    xmax = torch.where(w > 0, x, torch.full_like(x, -big)).amax(-1, keepdim=True)
    span = (xmax - xmin).clamp_min(0)
    scale, mins = span / nmax, xmin
    best_err = None
    for step in range(-search, search + 1) if search else ():
        levels = torch.round((x - xmin) * _safe_inv(span / (nmax + 0.1 * step))).clamp_(0, nmax)
        # Weighted least squares for (scale, min) given the levels.
        sw = w.sum(-1, keepdim=True)
        sl = (w * levels).sum(-1, keepdim=True)
        sll = (w * levels * levels).sum(-1, keepdim=True)
        sx = (w * x).sum(-1, keepdim=True)
        sxl = (w * x * levels).sum(-1, keepdim=True)
        det = sw * sll - sl * sl
        ok = det > 0
        det = torch.where(ok, det, torch.ones_like(det))
        fit_scale = torch.where(ok, (sw * sxl - sx * sl) / det, span / nmax)
        fit_min = torch.where(ok, (sll * sx - sl * sxl) / det, xmin)
        err = (w * (fit_scale * levels + fit_min - x) ** 2).sum(-1, keepdim=True)
        if best_err is None:
            best_err, scale, mins = err, fit_scale, fit_min
        else:
            better = err < best_err
            scale = torch.where(better, fit_scale, scale)
            mins = torch.where(better, fit_min, mins)
            best_err = torch.minimum(err, best_err)
    scale = scale.to(scale_dtype).float()
    mins = mins.to(scale_dtype).float()
    levels = torch.round((x - mins) * _safe_inv(scale)).clamp_(0, nmax)
    return levels, scale.squeeze(-1), mins.squeeze(-1)


def _safe_inv(t: torch.Tensor) -> torch.Tensor:
    """1/t, and 0 where t is 0 (all-zero groups quantize to zero codes)."""
    return torch.where(t != 0, 1.0 / torch.where(t != 0, t, torch.ones_like(t)), torch.zeros_like(t))


def _pad_cols(t: torch.Tensor, cols: int) -> torch.Tensor:
    extra = cols - t.shape[-1]
    return t if extra == 0 else torch.nn.functional.pad(t, (0, extra))


# -- bit packing ---------------------------------------------------------------------------


def pack_bits(levels: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer levels [n, cols] (signed or unsigned, fitting in `bits`) -> [n, ceil(cols/8)*bits] uint8."""
    n, cols = levels.shape
    values = _pad_cols(levels.to(torch.int64), math.ceil(cols / 8) * 8) & ((1 << bits) - 1)
    if bits == 8:
        return values.to(torch.uint8)
    values = values.view(n, -1, 8)
    shifts = torch.arange(8, device=levels.device, dtype=torch.int64) * bits
    words = (values << shifts).sum(-1, keepdim=True)  # [n, cols/8, 1], at most 64 bits
    byte_shifts = torch.arange(bits, device=levels.device, dtype=torch.int64) * 8
    return ((words >> byte_shifts) & 0xFF).to(torch.uint8).view(n, -1)


def unpack_bits(codes: torch.Tensor, bits: int, cols: int, signed: bool) -> torch.Tensor:
    """Inverse of `pack_bits`: [n, code_bytes] uint8 -> [n, cols] int32 levels."""
    n = codes.shape[0]
    if bits == 8:
        values = codes.view(torch.int8) if signed else codes
        return values[:, :cols].to(torch.int32)
    raw = codes.to(torch.int64).view(n, -1, bits)
    byte_shifts = torch.arange(bits, device=codes.device, dtype=torch.int64) * 8
    words = (raw << byte_shifts).sum(-1, keepdim=True)
    shifts = torch.arange(8, device=codes.device, dtype=torch.int64) * bits
    values = ((words >> shifts) & ((1 << bits) - 1)).view(n, -1)[:, :cols]
    if signed:
        half = 1 << (bits - 1)
        values = (values ^ half) - half
    return values.to(torch.int32)
