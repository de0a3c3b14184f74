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

M takes a forward pass over text, which the plugin cannot run inside vLLM's loader. So it is
measured once per model by `vllm-embed-plugin calibrate MODEL` (llama.cpp's imatrix plays the
same role), stored in a small safetensors file, and named by `VLLM_EMBED_IMPORTANCE`. The
checkpoint is never touched; without the file the formats use their plain rules.

This module is the file format, which the plugin reads inside vLLM; measuring M is operator
tooling (`tools/calibrate.py`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .formats.base import ColumnImportance

#: The tensor's name inside an importance file: M = E[h h^T], float32 [cols, cols].
TENSOR = "second_moment"


class ImportanceError(ValueError):
    """An importance file cannot be used for this table."""


def save(path: str | Path, moment: torch.Tensor, meta: dict) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(
        {TENSOR: moment.float().contiguous()},
        str(path),
        metadata={k: json.dumps(v) for k, v in meta.items()},
    )
    return path


def load_moment(path: str | Path) -> torch.Tensor:
    """M [cols, cols] float32 from an importance file, checked to be one (finite, positive
    diagonal). Raises ImportanceError, naming the file and what is wrong."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
    except (OSError, SafetensorError) as exc:
        raise ImportanceError(f"{str(path)!r} is not a readable importance file ({exc})") from None
    moment = tensors.get(TENSOR)
    if moment is None:
        raise ImportanceError(
            f"{str(path)!r} holds no {TENSOR!r} tensor (make it with "
            "`vllm-embed-plugin calibrate MODEL`)"
        )
    moment = moment.float()
    if moment.dim() != 2 or moment.shape[0] != moment.shape[1]:
        raise ImportanceError(
            f"{str(path)!r} holds a {tuple(moment.shape)} tensor, not a square second moment"
        )
    if not bool(torch.isfinite(moment).all()) or not bool((moment.diagonal() > 0).all()):
        raise ImportanceError(
            f"{str(path)!r} holds values that are not finite, or a column "
            "whose importance is not positive"
        )
    return moment


def load(path: str | Path, cols: int, joint: bool) -> ColumnImportance:
    """The importance in `path` for a table with `cols` columns; `joint`: the table is also a
    tied LM head, so its rows are rounded jointly.

    Raises ImportanceError, naming the file and what is wrong, if it cannot serve this table."""
    moment = load_moment(path)
    if moment.shape != (cols, cols):
        raise ImportanceError(
            f"{str(path)!r} is {tuple(moment.shape)}, but this table has {cols} "
            "columns: it was measured on another model"
        )
    try:
        return ColumnImportance.from_second_moment(moment, joint)
    except torch.linalg.LinAlgError:
        raise ImportanceError(
            f"{str(path)!r} is not a second moment (not positive definite)"
        ) from None


def read_meta(path: str | Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {k: json.loads(v) for k, v in (f.metadata() or {}).items()}
