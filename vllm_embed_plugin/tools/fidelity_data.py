"""What a fidelity run measures, as plain data: the rows (`Candidate`) and their statistics
(`ModeStats`, `Result`). `evaluate` fills them in and `fidelity_report` renders them: evaluate
imports fidelity_report, both import this module, and this module imports neither."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..importance import Calibration

__all__ = ["Candidate", "ModeStats", "Result", "Roundtrip", "mode_stats"]

#: One lossy copy of a float32 table: (table [rows, cols], what calibration measured, an
#: `importance.Calibration`: M, and S where measured) -> table.
Roundtrip = Callable[[torch.Tensor, "Calibration"], torch.Tensor]


@dataclass(frozen=True)
class Candidate:
    """One row: a way to make the lossy copy of a table with `cols` columns."""

    label: str
    #: Stored bits per weight (scales, minimums and side tables included); None if n/a.
    bpw: float | None
    #: None when the format cannot store this table (`note` says why).
    roundtrip: Roundtrip | None
    #: "plugin", "llama.cpp" or "experiment".
    kind: str = "plugin"
    note: str = ""
    #: What the targets name this row by ("int4", "int4+tied", "Q4_0", ...), or "".
    key: str = ""


@dataclass(frozen=True)
class ModeStats:
    kld_mean: float
    kld_p99: float
    top1: float
    #: Mean KLD of each window, in order: the spread of the figure across texts.
    window_klds: tuple[float, ...] = ()

    @property
    def spread(self) -> tuple[float, float]:
        """(lowest, highest) mean KLD of one window."""
        return (
            (min(self.window_klds), max(self.window_klds))
            if self.window_klds
            else (self.kld_mean, self.kld_mean)
        )

    @property
    def kld_std(self) -> float:
        """Standard deviation of the window means (0 for one window)."""
        return float(torch.tensor(self.window_klds).std()) if len(self.window_klds) > 1 else 0.0


def mode_stats(
    kld: torch.Tensor, agree: torch.Tensor, bounds: Sequence[tuple[int, int]]
) -> ModeStats:
    """Statistics of per-position KLDs and top-1 agreements over the windows at `bounds`
    ((start, end) positions, in order; together they cover what is summarised)."""
    kld = torch.cat([kld[s:e] for s, e in bounds])
    agree = torch.cat([agree[s:e] for s, e in bounds])
    return ModeStats(
        kld.mean().item(),
        torch.quantile(kld, 0.99).item(),
        agree.float().mean().item(),
        tuple(kld_w.mean().item() for kld_w in torch.split(kld, [e - s for s, e in bounds])),
    )


#: What a Result measures, in the order of its per-domain tuples.
MODES = ("input", "tied", "head")


@dataclass(frozen=True)
class Result:
    candidate: Candidate
    #: Over every window of every domain.
    input: ModeStats | None = None
    tied: ModeStats | None = None
    seconds: float = 0.0
    #: domain -> (input, tied) over that domain's windows, or (None, None, head) for a row
    #: measured as an untied head (`FidelityRun.evaluate_head`).
    domains: dict = dataclasses.field(default_factory=dict)
    #: The lookup exact, the lossy table computing the logits (an untied LM head).
    head: ModeStats | None = None

    def domain(self, name: str, mode: str) -> ModeStats | None:
        stats = self.domains.get(name, ())
        index = MODES.index(mode)
        return stats[index] if index < len(stats) else None
