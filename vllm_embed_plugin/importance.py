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

This module never imports vLLM; `measure` needs transformers (the `eval` extra).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .formats.base import ColumnImportance

#: The tensor's name inside an importance file: M = E[h h^T], float32 [cols, cols].
TENSOR = "second_moment"
#: Where `vllm-embed-plugin calibrate` writes by default.
DEFAULT_DIR = Path.home() / ".cache" / "vllm-embed-plugin" / "importance"
#: `calibrate`'s defaults: tokens per window, and at most this many tokens in all, in windows
#: spread evenly over the corpus: the whole packaged corpus (about 10,000 tokens), which
#: measured better on held-out text than its first 4,096 tokens or more, shorter windows.
DEFAULT_WINDOW = 512
DEFAULT_POSITIONS = 16384


def default_corpus() -> Path:
    """The packaged calibration corpus: prose, code, chat in several languages (data/README.md)."""
    return Path(__file__).parent / "data" / "calibration.txt"


class ImportanceError(ValueError):
    """An importance file cannot be used for this table."""


def second_moment(hidden: torch.Tensor) -> torch.Tensor:
    """M = E[h h^T] [cols, cols] of final hidden states [..., cols] (summed in float64)."""
    flat = hidden.reshape(-1, hidden.shape[-1]).double()
    return (flat.T @ flat / flat.shape[0]).float()


def special_prefix(tokenizer) -> list[int]:
    """The special tokens the tokenizer puts before a text (e.g. <bos>), possibly none."""
    probe = " the"
    with_special = tokenizer(probe)["input_ids"]
    plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
    if with_special[-len(plain):] == plain:
        return with_special[: len(with_special) - len(plain)]
    return []


def spread_windows(tokenizer, text: str, window: int, count: int) -> torch.Tensor:
    """At most `count` token windows [n, window] spread evenly over the whole text, never
    overlapping: each is the special prefix the tokenizer adds (e.g. <bos>), then consecutive
    tokens of the text. A text shorter than one window gives one shorter window."""
    prefix = special_prefix(tokenizer)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    body = max(1, min(window - len(prefix), len(ids)))
    available = max(1, len(ids) // body)
    n = min(available, max(1, count))
    starts = [(i * available // n) * body for i in range(n)]
    return torch.tensor([prefix + ids[s : s + body] for s in starts], dtype=torch.long)


@torch.inference_mode()
def measure(model_path: str | Path, text: str, *, window: int = DEFAULT_WINDOW,
            max_positions: int = DEFAULT_POSITIONS,
            device: str = "cpu", dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, dict]:
    """(M [cols, cols], metadata) of the checkpoint at `model_path`, measured on `text`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    windows = spread_windows(tokenizer, text, window, max_positions // window)
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype).to(device).eval()
    body = getattr(model, model.base_model_prefix)
    total = None
    for ids in windows:
        h = body(input_ids=ids[None].to(device)).last_hidden_state[0].double()
        part = h.T @ h
        total = part if total is None else total + part
    moment = (total / windows.numel()).float().cpu()
    table = model.get_input_embeddings().weight
    meta = {
        "model": str(model_path),
        "rows": table.shape[0],
        "cols": table.shape[1],
        "positions": windows.numel(),
        "tied": bool(getattr(model.config.get_text_config(), "tie_word_embeddings", False)),
    }
    return moment, meta


def save(path: str | Path, moment: torch.Tensor, meta: dict) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({TENSOR: moment.float().contiguous()}, str(path),
              metadata={k: json.dumps(v) for k, v in meta.items()})
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
        raise ImportanceError(f"{str(path)!r} holds no {TENSOR!r} tensor (make it with "
                              "`vllm-embed-plugin calibrate MODEL`)")
    moment = moment.float()
    if moment.dim() != 2 or moment.shape[0] != moment.shape[1]:
        raise ImportanceError(f"{str(path)!r} holds a {tuple(moment.shape)} tensor, not a square "
                              "second moment")
    if not bool(torch.isfinite(moment).all()) or not bool((moment.diagonal() > 0).all()):
        raise ImportanceError(f"{str(path)!r} holds values that are not finite, or a column "
                              "whose importance is not positive")
    return moment


def load(path: str | Path, cols: int, joint: bool) -> ColumnImportance:
    """The importance in `path` for a table with `cols` columns; `joint`: the table is also a
    tied LM head, so its rows are rounded jointly.

    Raises ImportanceError, naming the file and what is wrong, if it cannot serve this table."""
    moment = load_moment(path)
    if moment.shape != (cols, cols):
        raise ImportanceError(f"{str(path)!r} is {tuple(moment.shape)}, but this table has {cols} "
                              "columns: it was measured on another model")
    try:
        return ColumnImportance.from_second_moment(moment, joint)
    except torch.linalg.LinAlgError:
        raise ImportanceError(f"{str(path)!r} is not a second moment (not positive "
                              "definite)") from None


def read_meta(path: str | Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {k: json.loads(v) for k, v in (f.metadata() or {}).items()}
