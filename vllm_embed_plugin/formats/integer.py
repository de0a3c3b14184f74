"""Integer formats: `bits`-bit codes in groups of `group_size` columns, one scale per group
(symmetric) or a scale and a minimum per group (affine).

Layout of one row (`bits` bytes per eight columns): 8-bit codes one byte each; 4-bit codes two
per byte, low nibble first. 5- and 6-bit codes are two planes, so that every read is an
aligned word: the low 4 bits of every code as 4-bit codes would be stored, then the high 1 or
2 bits as a little-endian bit stream (`high_bits`). Other widths are a little-endian bit
stream, eight values in `bits` bytes. Symmetric codes are two's complement, affine codes are
unsigned. Scales and minimums are float16 for groups (bfloat16 for Machete's layout) and
float32 for a whole-row group.

Scale choice follows llama.cpp's quantizers: try a few candidate scales per group, round, then
solve least squares for the scale (and minimum) that best fits those rounded codes, and keep
the candidate with the smallest squared error. Given a column importance, that error is
weighted per column, and with its inverse factor the codes of a row are chosen jointly (GPTQ,
`_fit_jointly`), for a table that is also a tied LM head. An untied table's importance
(`lookup_only`) leaves the plain rule in place.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from .base import ColumnImportance, GroupRounder, PackedRows, TableFormat


@dataclass(frozen=True)
class IntFormat(TableFormat):
    name: str
    bits: int
    #: Columns per scale; None means one scale for the whole row.
    group_size: int | None
    symmetric: bool = True
    #: Candidate scales tried per group on each side of the plain one (0 = no search).
    search: int = 0
    #: dtype of group scales and minimums (a whole-row group keeps float32). bfloat16 is for
    #: kernels that take no other (vLLM's Machete); codes are always rounded against the
    #: scale as stored.
    group_scale_dtype: torch.dtype = torch.float16

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
        return torch.float32 if self.group_size is None else self.group_scale_dtype

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
        search = ", importance-weighted scales" if self.search else ""
        return f"{self.name} ({self.bits}-bit {kind}, group {group}{search}, {self.bits_per_weight(cols):.2f} bits/weight)"

    # -- quantize / dequantize ----------------------------------------------------------

    def quantize(
        self,
        rows: torch.Tensor,
        importance: ColumnImportance | None = None,
        round_group: GroupRounder | None = None,
    ) -> PackedRows:
        """`importance` (optional, see `ColumnImportance`): its weights steer the scale search
        (`search` > 0), and its inverse factor, if any, makes the codes of each row a joint
        choice (GPTQ), one group at a time by `round_group` where given. None weighs every
        column alike and rounds each value to its nearest level."""
        if importance is not None and importance.lookup_only:
            # An untied table: the importance describes another use (ColumnImportance).
            return dataclasses.replace(self, search=0).quantize(rows)
        n, cols = rows.shape
        g = self.group_cols(cols)
        groups = self.num_groups(cols)
        if importance is None:
            col_weight = torch.ones(1, cols, device=rows.device, dtype=torch.float32)
        else:
            col_weight = importance.weights.to(device=rows.device, dtype=torch.float32).reshape(
                1, -1
            )
            if col_weight.shape[1] != cols:
                raise ValueError(f"importance has {col_weight.shape[1]} weights for {cols} columns")
        # Padded columns carry no weight in the fit.
        weight = _pad_cols(col_weight, groups * g).view(1, groups, g)
        if importance is not None and importance.inverse_factor is not None:
            levels, scale, mins = self._fit_jointly(rows.float(), weight, importance, round_group)
        else:
            levels, scale, mins = self._fit(
                _pad_cols(rows.float(), groups * g).view(n, groups, g), weight
            )
            levels = levels.reshape(n, groups * g)[:, :cols]
        codes = pack_bits(levels, self.bits)
        return PackedRows(
            codes=codes,
            scales=scale.to(self.scale_dtype),
            mins=None if mins is None else mins.to(self.scale_dtype),
        )

    def _fit(self, x: torch.Tensor, weight: torch.Tensor):
        """(levels, scale, mins or None) for groups x [n, G, g], each value at its nearest level."""
        if self.symmetric:
            levels, scale = _fit_symmetric(x, weight, self.bits, self.search, self.scale_dtype)
            return levels, scale, None
        return _fit_affine(x, weight, self.bits, self.search, self.scale_dtype)

    def _fit_jointly(
        self,
        rows: torch.Tensor,
        weight: torch.Tensor,
        importance: ColumnImportance,
        round_group: GroupRounder | None = None,
    ):
        """GPTQ on the rows as the weight of a linear layer whose input has second moment M:
        the group scales are fitted first, on the values as loaded (GPTQ's "static groups"),
        then the columns are rounded most important first (`importance.order`), each column's
        error (scaled by the inverse factor of M) moved into the columns not yet rounded. Then
        the scales are refitted to the codes (`refit_scales`), `REFIT_ROUNDS` times, the rows
        rounded again against the refitted scales between two refits. Levels come back
        [n, cols]."""
        n, cols = rows.shape
        g = self.group_cols(cols)
        groups = self.num_groups(cols)
        _, scale, mins = self._fit(_pad_cols(rows, groups * g).view(n, groups, g), weight)
        factor = importance.inverse_factor.to(rows.device, torch.float32)
        order = importance.order.to(rows.device) if importance.order is not None else None

        def rounded():
            return round_jointly(
                rows, scale, mins, factor, g, self.bits, self.symmetric, round_group, order
            )

        levels = rounded()
        if importance.metric is None:
            return levels, scale, mins
        metric = importance.metric.to(rows.device, torch.float32)
        for refit in range(importance.REFIT_ROUNDS):
            if refit:  # the rows again, against the scales refitted last
                levels = rounded()
            scale, mins = refit_scales(rows, levels, scale, mins, metric, g, self.scale_dtype)
        return levels, scale, mins

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
        candidates = [scale] + [
            signed_max / -(nmax + 0.1 * step) for step in range(-search, search + 1)
        ]
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
    return _round_symmetric(x * _safe_inv(scale), bits), scale.squeeze(-1)


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
    return _round_affine((x - mins) * _safe_inv(scale), bits), scale.squeeze(-1), mins.squeeze(-1)


def round_jointly(
    rows: torch.Tensor,
    scale: torch.Tensor,
    mins: torch.Tensor | None,
    factor: torch.Tensor,
    group: int,
    bits: int,
    symmetric: bool,
    round_group: GroupRounder | None = None,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """Levels [n, cols] for float32 rows with fixed group scales [n, groups] (and minimums),
    rounded column by column with GPTQ's error feedback through the upper `factor` [cols, cols].

    The columns are visited in `order` (default: as stored), which `factor` follows; each keeps
    its own group's scale (GPTQ's static groups), so a block of visited columns may mix groups.
    Within a block of `group` columns every column waits for the one before it; the columns
    after it take the block's carried errors in one matrix product. `round_group` (the
    conversion passes a Triton kernel on CUDA) rounds a whole block at once; the torch loop
    below is the reference."""
    n, cols = rows.shape
    if order is None:
        order = torch.arange(cols, device=rows.device)
    work = rows[:, order]
    visited = torch.empty_like(rows)
    group_of = order // group
    for a in range(0, cols, group):
        b = min(a + group, cols)
        step = scale[:, group_of[a:b]].contiguous()
        low = torch.zeros_like(step) if mins is None else mins[:, group_of[a:b]].contiguous()
        args = (work[:, a:b], step, low, factor[a:b, a:b], bits, symmetric)
        rounded = round_group(*args) if round_group is not None else None
        visited[:, a:b], carried = (
            rounded if rounded is not None else round_group_jointly_torch(*args)
        )
        if b < cols:
            work[:, b:] -= carried @ factor[a:b, b:]
    levels = torch.empty_like(rows)
    levels[:, order] = visited
    return levels


def refit_scales(
    rows: torch.Tensor,
    levels: torch.Tensor,
    scale: torch.Tensor,
    mins: torch.Tensor | None,
    metric: torch.Tensor,
    group: int,
    scale_dtype: torch.dtype,
    chunk_elements: int = 1 << 24,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scales [n, groups] (and minimums) that cost least for fixed `levels` [n, cols]: a row
    w is stored as w' = sum_k s_k q_k (+ m_k 1_k) over its groups k, and the error costs
    (w - w') H (w - w')^T for the `metric` H [cols, cols]; so the group scales (and minimums)
    of a row solve a [groups (x2)] linear system. A row keeps its old scales where the new
    ones, as stored in `scale_dtype`, would not cost less."""
    n, cols = rows.shape
    groups = scale.shape[1]
    padded = groups * group
    metric = torch.nn.functional.pad(metric, (0, padded - cols, 0, padded - cols))
    valid = _pad_cols(torch.ones(1, cols, device=rows.device, dtype=torch.float32), padded).view(
        1, groups, group
    )
    width = 1 if mins is None else 2
    new_scale, new_mins = scale.clone(), None if mins is None else mins.clone()
    eye = torch.eye(groups * width, device=rows.device, dtype=torch.float32)
    step = max(1, chunk_elements // (padded * width))
    for a in range(0, n, step):
        b = min(a + step, n)
        w = _pad_cols(rows[a:b], padded)
        q = _pad_cols(levels[a:b], padded).view(b - a, groups, group)
        basis = q[..., None] if mins is None else torch.stack([q, valid.expand_as(q)], -1)
        # Q^T H Q, one group's columns of Q at a time: H Q_l is a plain product, [rows, padded]
        # per basis vector, where H Q for all groups at once would take `groups` times the memory.
        lhs = torch.empty(
            b - a, groups, width, groups, width, device=rows.device, dtype=torch.float32
        )
        for g in range(groups):
            cols_g = slice(g * group, (g + 1) * group)
            hq = basis[:, g].transpose(1, 2).reshape(-1, group) @ metric[:, cols_g].T
            hq = hq.view(b - a, width, groups, group)
            # Group k's block: the sum over its columns of basis * H Q_g. An einsum here copied
            # hq into another layout first: the int5 conversion took 1.4x as long on an H100.
            for c in range(width):
                lhs[:, :, c, g, :] = (basis[:, None, :, :, c] * hq).sum(-1).transpose(1, 2)
        lhs = lhs.reshape(b - a, groups * width, groups * width)
        hw = w @ metric
        rhs = torch.einsum("bkic,bki->bkc", basis, hw.view(b - a, groups, group))
        old = scale[a:b, :, None] if mins is None else torch.stack([scale[a:b], mins[a:b]], -1)
        old = old.reshape(b - a, groups * width)
        # A tiny ridge toward the old values: a group whose codes are all zero keeps its scale.
        ridge = 1e-6 * lhs.diagonal(dim1=1, dim2=2).mean(-1, keepdim=True).clamp_min(1e-30)
        # Cholesky, not LU: the system is symmetric positive definite, which halves the work,
        # and torch 2.13's CPU LU (solve_ex) returns garbage for batches of 152+ unknowns on
        # more than one thread. The _ex form does not sync to check; a row whose factorisation
        # failed keeps its old scales below.
        factor, failed = torch.linalg.cholesky_ex(lhs + ridge[..., None] * eye)
        fitted = torch.cholesky_solve((rhs.reshape(b - a, -1) + ridge * old)[..., None], factor)
        fitted = fitted[..., 0].to(scale_dtype).float()

        def cost(values):
            err = w - torch.einsum(
                "bkic,bkc->bki", basis, values.view(b - a, groups, width)
            ).reshape(b - a, padded)
            return ((err @ metric) * err).sum(-1)

        better = (cost(fitted) < cost(old)) & fitted.isfinite().all(-1) & (failed == 0)
        chosen = torch.where(better[:, None], fitted, old).view(b - a, groups, width)
        new_scale[a:b] = chosen[..., 0]
        if new_mins is not None:
            new_mins[a:b] = chosen[..., 1]
    return new_scale, new_mins


def round_group_jointly_torch(
    values: torch.Tensor,
    step: torch.Tensor,
    low: torch.Tensor,
    factor: torch.Tensor,
    bits: int,
    symmetric: bool,
):
    values = values.clone()
    width = values.shape[1]
    inv = _safe_inv(step)
    levels = torch.empty_like(values)
    carried = torch.empty_like(values)
    for j in range(width):
        value = values[:, j]
        scaled = (value - low[:, j]) * inv[:, j]
        level = _round_symmetric(scaled, bits) if symmetric else _round_affine(scaled, bits)
        error = (value - (level * step[:, j] + low[:, j])) / factor[j, j]
        values[:, j + 1 :] -= error[:, None] * factor[j, j + 1 :]
        levels[:, j] = level
        carried[:, j] = error
    return levels, carried


def _round_symmetric(scaled: torch.Tensor, bits: int) -> torch.Tensor:
    nmax = 2 ** (bits - 1)
    return torch.round(scaled).clamp_(-nmax, nmax - 1)


def _round_affine(scaled: torch.Tensor, bits: int) -> torch.Tensor:
    return torch.round(scaled).clamp_(0, 2**bits - 1)


def _safe_inv(t: torch.Tensor) -> torch.Tensor:
    """1/t, and 0 where t is 0 (all-zero groups quantize to zero codes)."""
    return torch.where(
        t != 0, 1.0 / torch.where(t != 0, t, torch.ones_like(t)), torch.zeros_like(t)
    )


def _pad_cols(t: torch.Tensor, cols: int) -> torch.Tensor:
    extra = cols - t.shape[-1]
    return t if extra == 0 else torch.nn.functional.pad(t, (0, extra))


# -- bit packing ---------------------------------------------------------------------------


def high_bits(bits: int) -> int:
    """Bits per code in the high plane of a `bits`-bit row (0: the row is one plane)."""
    return bits - 4 if bits in (5, 6) else 0


def pack_bits(levels: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer levels [n, cols] (signed or unsigned, fitting in `bits`) -> [n, ceil(cols/8)*bits] uint8."""
    values = levels.to(torch.int64) & ((1 << bits) - 1)
    high = high_bits(bits)
    if high:
        return torch.cat([_pack_stream(values & 15, 4), _pack_stream(values >> 4, high)], dim=1)
    return _pack_stream(values, bits)


def unpack_bits(codes: torch.Tensor, bits: int, cols: int, signed: bool) -> torch.Tensor:
    """Inverse of `pack_bits`: [n, code_bytes] uint8 -> [n, cols] int32 levels."""
    high = high_bits(bits)
    if high:
        low_bytes = math.ceil(cols / 8) * 4
        values = _unpack_stream(codes[:, :low_bytes], 4, cols) | (
            _unpack_stream(codes[:, low_bytes:], high, cols) << 4
        )
    elif bits == 8:
        values = codes[:, :cols].to(torch.int64)
    else:
        values = _unpack_stream(codes, bits, cols)
    if signed:
        half = 1 << (bits - 1)
        values = (values ^ half) - half
    return values.to(torch.int32)


def _pack_stream(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned values [n, cols] below 2^bits -> [n, ceil(cols/8)*bits] uint8, a little-endian
    bit stream."""
    n, cols = values.shape
    values = _pad_cols(values, math.ceil(cols / 8) * 8)
    if bits == 8:
        return values.to(torch.uint8)
    values = values.view(n, -1, 8)
    shifts = torch.arange(8, device=values.device, dtype=torch.int64) * bits
    words = (values << shifts).sum(-1, keepdim=True)  # [n, cols/8, 1], at most 64 bits
    byte_shifts = torch.arange(bits, device=values.device, dtype=torch.int64) * 8
    return ((words >> byte_shifts) & 0xFF).to(torch.uint8).view(n, -1)


def _unpack_stream(codes: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """Inverse of `_pack_stream`: [n, ceil(cols/8)*bits] uint8 -> [n, cols] int64."""
    n = codes.shape[0]
    raw = codes.to(torch.int64).reshape(n, -1, bits)
    byte_shifts = torch.arange(bits, device=codes.device, dtype=torch.int64) * 8
    words = (raw << byte_shifts).sum(-1, keepdim=True)
    shifts = torch.arange(8, device=codes.device, dtype=torch.int64) * bits
    return ((words >> shifts) & ((1 << bits) - 1)).view(n, -1)[:, :cols]
