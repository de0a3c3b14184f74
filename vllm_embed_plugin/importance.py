"""Column importance: what an error in the token table costs, measured once per model.

A tied LM head computes logits = h @ table^T, so an error d in a token's row moves its logit
by d . h, and over many positions costs d M d^T, where M = E[h h^T] is the second moment of
the final hidden state. Its diagonal (the importance of each column) spans orders of
magnitude: a few "massive activation" columns carry most of it, and on SmolLM2-135M 60% of it
is the constant part of h. Formats use M two ways (`formats.ColumnImportance`):

- every table: the scale search weighs each column's squared error by M's diagonal;
- a table that is also a tied LM head: the codes of each row are chosen jointly against M
  (GPTQ), so rounding errors cancel in the logits instead of adding up.

Together they bring the tied KL divergence to between a third and two thirds of llama.cpp's
formats at the same bits per weight (docs/FIDELITY.md).

A tied table is also looked up, where an error e in a token's row costs e S e^T each time the
token is read, S being the Fisher information of the model's output with respect to its input
embedding, averaged over positions. Both costs scale with how often the token occurs, so a
tied row is rounded against M + S. A file may hold S beside M (`calibrate` measures it with one
backward pass per window); without it a tied table is rounded against M alone.

M takes a forward pass over text, which the plugin cannot run inside vLLM's loader. So it is
measured once per model by `vllm-embed-plugin calibrate MODEL` (llama.cpp's imatrix plays the
same role), stored in a small safetensors file, and named by `VLLM_EMBED_IMPORTANCE`. The
checkpoint is never touched; without the file the formats use their plain rules.

This module is the file format, which the plugin reads inside vLLM; measuring M is operator
tooling (`tools/calibrate.py`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from .formats.base import ColumnImportance

#: The tensor's name inside an importance file: M = E[h h^T], float32 [cols, cols].
TENSOR = "second_moment"
#: The optional second tensor: S, the input embedding's Fisher information, float32 [cols, cols].
FISHER_TENSOR = "input_fisher"


class ImportanceError(ValueError):
    """An importance file cannot be used for this table."""


def save(
    path: str | Path, moment: torch.Tensor, meta: dict, input_fisher: torch.Tensor | None = None
) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {TENSOR: moment.float().contiguous()}
    if input_fisher is not None:
        tensors[FISHER_TENSOR] = input_fisher.float().contiguous()
    save_file(
        tensors,
        str(path),
        metadata={k: json.dumps(v) for k, v in meta.items()},
    )
    return path


@dataclass(frozen=True)
class Calibration:
    """What an importance file holds."""

    #: M = E[h h^T] [cols, cols] of the final hidden state.
    second_moment: torch.Tensor
    #: S [cols, cols], the input embedding's Fisher information; None in a file without it
    #: (`calibrate --engine vllm`, or a file from before it was measured).
    input_fisher: torch.Tensor | None = None

    @property
    def cols(self) -> int:
        return self.second_moment.shape[0]


def _checked(path, tensors: dict, name: str, what: str, required: bool) -> torch.Tensor | None:
    """Tensor `name` of a file, checked to be a square matrix with finite values and a
    positive diagonal."""
    tensor = tensors.get(name)
    if tensor is None:
        if required:
            raise ImportanceError(
                f"{str(path)!r} holds no {name!r} tensor (make it with "
                "`vllm-embed-plugin calibrate MODEL`)"
            )
        return None
    tensor = tensor.float()
    if tensor.dim() != 2 or tensor.shape[0] != tensor.shape[1]:
        raise ImportanceError(
            f"{str(path)!r} holds a {tuple(tensor.shape)} tensor, not a square {what}"
        )
    if not bool(torch.isfinite(tensor).all()) or not bool((tensor.diagonal() > 0).all()):
        raise ImportanceError(
            f"{str(path)!r} holds values that are not finite, or a column "
            f"whose {what} is not positive"
        )
    return tensor


def read(path: str | Path) -> Calibration:
    """An importance file's tensors, checked (finite, square, positive diagonals, the same
    size). Raises ImportanceError, naming the file and what is wrong."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
    except (OSError, SafetensorError) as exc:
        raise ImportanceError(f"{str(path)!r} is not a readable importance file ({exc})") from None
    moment = _checked(path, tensors, TENSOR, "second moment", required=True)
    fisher = _checked(path, tensors, FISHER_TENSOR, "input Fisher information", required=False)
    if fisher is not None and fisher.shape != moment.shape:
        raise ImportanceError(
            f"{str(path)!r} holds {TENSOR!r} {tuple(moment.shape)} but {FISHER_TENSOR!r} "
            f"{tuple(fisher.shape)}"
        )
    return Calibration(moment, fisher)


#: How a table is used, which decides what in the file applies to it: "lookup" an untied
#: embedding, "head" an untied LM head, "tied" a table that is both.
Role = Literal["lookup", "head", "tied"]


def load(path: str | Path, cols: int, role: Role) -> ColumnImportance:
    """The importance in `path` for a table with `cols` columns used as `role`: a table that
    computes logits ("head", "tied") has its rows rounded jointly against M, plus S for a
    tied one; an untied embedding ignores it (`ColumnImportance.lookup_only`).

    Raises ImportanceError, naming the file and what is wrong, if it cannot serve this table."""
    calibration = read(path)
    if calibration.cols != cols:
        raise ImportanceError(
            f"{str(path)!r} is {tuple(calibration.second_moment.shape)}, but this table has "
            f"{cols} columns: it was measured on another model"
        )
    return for_role(calibration, role, repr(str(path)))


def for_role(
    calibration: Calibration, role: Role, source: str = "the measured calibration"
) -> ColumnImportance:
    """`calibration` as the importance of a table used as `role` (see `load`); `source` names
    it in an error."""
    fisher = calibration.input_fisher if role == "tied" else None
    try:
        return ColumnImportance.from_second_moment(
            calibration.second_moment, role != "lookup", fisher
        )
    except torch.linalg.LinAlgError:
        raise ImportanceError(f"{source} is not a second moment (not positive definite)") from None


def read_meta(path: str | Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {k: json.loads(v) for k, v in (f.metadata() or {}).items()}
