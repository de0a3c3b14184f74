"""What every storage format is: plain tensors made by `quantize`, read back by `dequantize`.

A format never knows about vLLM, settings or devices. All of its tensors have one leading
row per table row, so slicing, gathering and tensor-parallel sharding work on any of them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class PackedRows:
    """Quantized rows: `codes` [rows, code_bytes] uint8, `scales` [rows, groups], optional
    `mins` [rows, groups] (affine formats)."""

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None
        }

    def map(self, fn) -> PackedRows:
        """Apply `fn` to every tensor (slice, gather, move)."""
        return PackedRows(**{name: fn(t) for name, t in self.tensors().items()})

    def rows(self, index: torch.Tensor | slice) -> PackedRows:
        return self.map(lambda t: t[index])

    @property
    def num_rows(self) -> int:
        return self.codes.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


@dataclass(frozen=True)
class ColumnImportance:
    """What an error in the table costs, from the second moment M = E[h h^T] of the hidden
    states h that multiply the table's rows (a tied LM head's input; `importance.py`).

    `weights` (M's diagonal) steer the scale search. With `inverse_factor` the codes of each
    row are also chosen jointly (GPTQ): the rounding error of a column is carried into the
    columns after it, so it cancels in the logits instead of adding up. The columns are
    visited most important first (`order`, GPTQ's act-order), so the few columns whose error
    costs most are rounded before any error is carried into them. A tied table, also
    looked up, is rounded against M + S where the file holds S, the lookup's own cost.

    With `lookup_only` (an untied table) the importance is not used at all: the format
    quantizes by its plain rule, exactly as without a file. M weighs what an error costs in the
    LM head's input; an input-only table's errors reach the model through its first layer
    instead, where M's massive-activation columns are not what matters. A search against M,
    even one that keeps the plain fit in every group where it would leave more unweighted error,
    raised the input-only KL divergence of some formats on some text (Gemma 3 int6 +46% on
    held-out code, prose and chat; docs/CALIBRATION.md), and a file must never make an untied
    table worse."""

    #: [cols] positive: the cost of a squared error in each column.
    weights: torch.Tensor
    #: [cols, cols] upper Cholesky factor of (M + damping)^-1 with rows and columns taken in
    #: `order`, or None for per-column weights only.
    inverse_factor: torch.Tensor | None = None
    #: An untied table: quantize by the plain rule, as without an importance.
    lookup_only: bool = False
    #: [cols, cols] the damped M (+ S) itself, whose inverse `inverse_factor` factors: after
    #: the joint rounding, the group scales are refitted against it (`formats.integer`).
    metric: torch.Tensor | None = None
    #: [cols] int64: the columns in the order the joint rounding visits them, by descending
    #: diagonal of the damped M (+ S).
    order: torch.Tensor | None = None

    #: Added to M's diagonal before inverting, as a share of its mean (GPTQ's `percdamp`).
    DAMPING = 0.01
    #: A tied table's M (+ S) is first mixed with mean(diag) * I by this share: measured on one
    #: corpus, it describes other text only in part, and shrunk it generalises better (lower
    #: tied KLD on held-out code, prose and chat than M as measured; docs/FIDELITY.md). S is
    #: shrunk with M, for the same reason (docs/CALIBRATION.md).
    SHRINK = 0.1
    #: Refits of the group scales to the codes after the joint rounding (`formats.integer`),
    #: the rows rounded again between two refits: GPTQ fits the scales before it rounds, to
    #: the values as loaded; once the codes are chosen, the scales that cost least for them
    #: solve a small least-squares problem per row. 0: none.
    REFIT_ROUNDS = 2

    def __post_init__(self) -> None:
        # Checked once here, not on every chunk a format quantizes.
        if self.weights.dim() != 1 or not bool((self.weights > 0).all()):
            raise ValueError("importance weights must be one positive number per column")

    @classmethod
    def from_second_moment(
        cls, moment: torch.Tensor, joint: bool, input_fisher: torch.Tensor | None = None
    ) -> ColumnImportance:
        """`joint`: the table computes logits (a tied table or an untied head). `input_fisher`
        (S, `importance.py`): the table is also looked up, so a row's error costs e S e^T
        in the lookup beside e M e^T in the logits; pass it for a tied table only (for an
        untied table alone it measured better on most text but not all: docs/CALIBRATION.md)."""
        moment = moment.double()
        if not joint:
            # Without joint rounding the table is untied (lookup only): see the class doc.
            return cls(moment.diagonal().clamp_min(1e-12).float(), lookup_only=True)
        if input_fisher is not None:
            moment = moment + input_fisher.double()
        moment = shrink(moment, cls.SHRINK)
        weights = moment.diagonal().clamp_min(1e-12).float()
        damped = moment + cls.DAMPING * moment.diagonal().mean() * torch.eye(
            moment.shape[0], dtype=moment.dtype, device=moment.device
        )
        order = torch.argsort(damped.diagonal(), descending=True, stable=True)
        factor = inverse_upper_factor(damped[order][:, order])
        return cls(weights, factor, metric=damped.float(), order=order)

    def to(self, device) -> ColumnImportance:
        def moved(t):
            return None if t is None else t.to(device)

        return ColumnImportance(
            self.weights.to(device),
            moved(self.inverse_factor),
            self.lookup_only,
            moved(self.metric),
            moved(self.order),
        )


def inverse_upper_factor(matrix: torch.Tensor) -> torch.Tensor:
    """Float32 upper Cholesky factor U of matrix^-1 (U^T U = matrix^-1), GPTQ's form of the
    inverse of a positive definite [cols, cols] matrix."""
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(matrix))
    return torch.linalg.cholesky(inverse, upper=True).float()


def shrink(moment: torch.Tensor, amount: float) -> torch.Tensor:
    """(1 - amount) * M + amount * mean(diag M) * I."""
    eye = torch.eye(moment.shape[0], dtype=moment.dtype, device=moment.device)
    return (1 - amount) * moment + amount * moment.diagonal().mean() * eye


#: (values, step, low [n, width], factor [width, width], bits, symmetric) ->
#: (levels, carried errors) [n, width], or None where it does not apply (the torch loop
#: `formats.integer.round_group_jointly_torch` then runs). The conversion passes a GPU kernel.
GroupRounder = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, bool],
    "tuple[torch.Tensor, torch.Tensor] | None",
]


class TableFormat(ABC):
    """A storage format for an embedding table of `cols` columns."""

    #: The name users select it by (`VLLM_EMBED_FORMAT`).
    name: str

    @abstractmethod
    def bits_per_weight(self, cols: int) -> float:
        """Stored bits per table element, scales and minimums included."""

    @abstractmethod
    def quantize(
        self,
        rows: torch.Tensor,
        importance: ColumnImportance | None = None,
        round_group: GroupRounder | None = None,
    ) -> PackedRows:
        """Quantize float rows [n, cols] (any float dtype) into packed rows. `importance`
        steers the formats that search their scales; the others ignore it. `round_group`: a
        faster rounding of one group for the joint (GPTQ) rounding, such as a GPU kernel;
        formats that do not round jointly ignore it."""

    @abstractmethod
    def dequantize(self, packed: PackedRows, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """The reference inverse: packed rows -> [n, cols] in `dtype`."""

    @abstractmethod
    def empty(self, rows: int, cols: int, device: torch.device | str) -> PackedRows:
        """Uninitialised storage for a whole table, filled chunk by chunk."""

    def dequantize_rows(
        self, table: PackedRows, index: torch.Tensor | slice, cols: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """Rows `index` (1-D ids or a slice) of a whole table, dequantized: [n, cols]. A layout
        whose tensors are not row-major (`formats.machete`) gathers them itself."""
        return self.dequantize(table.rows(index), cols, dtype)

    def describe(self, cols: int) -> str:
        return f"{self.name} ({self.bits_per_weight(cols):.2f} bits/weight)"

    def nbytes(self, rows: int, cols: int) -> int:
        return self.empty(rows, cols, "meta").nbytes


class ConversionError(RuntimeError):
    """A table could not be converted; the original layer is left untouched."""
