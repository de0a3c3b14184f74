"""Measure a model's column importance: the second moment M = E[h h^T] of its final hidden
state on a text (see `importance.py` for what M is and how formats use it).

`vllm-embed-plugin calibrate MODEL` runs `measure` and writes the file that
`VLLM_EMBED_IMPORTANCE` names. Needs transformers (the `eval` extra); never imports vLLM.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from . import DATA_DIR, cache_dir, progress_bar

#: `calibrate`'s defaults: tokens per window, and at most this many tokens in all, in windows
#: spread evenly over the corpus: the whole packaged corpus (about 10,000 tokens), which
#: measured better on held-out text than its first 4,096 tokens or more, shorter windows.
DEFAULT_WINDOW = 512
DEFAULT_POSITIONS = 16384


def default_out(model_dir: Path) -> Path:
    """Where `vllm-embed-plugin calibrate` writes by default: the cache, named after the model
    directory."""
    return cache_dir("importance") / f"{Path(model_dir).name}.safetensors"


def default_corpus() -> Path:
    """The packaged calibration corpus: prose, code, chat in several languages (data/README.md)."""
    return DATA_DIR / "calibration.txt"


def second_moment(hidden: torch.Tensor) -> torch.Tensor:
    """M = E[h h^T] [cols, cols] of final hidden states [..., cols] (summed in float64)."""
    flat = hidden.reshape(-1, hidden.shape[-1]).double()
    return (flat.T @ flat / flat.shape[0]).float()


def special_prefix(tokenizer) -> list[int]:
    """The special tokens the tokenizer puts before a text (e.g. <bos>), possibly none."""
    probe = " the"
    with_special = tokenizer(probe)["input_ids"]
    plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
    if with_special[-len(plain) :] == plain:
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
def measure(
    model_path: str | Path,
    text: str,
    *,
    window: int = DEFAULT_WINDOW,
    max_positions: int = DEFAULT_POSITIONS,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: bool = False,
) -> tuple[torch.Tensor, dict]:
    """(M [cols, cols], metadata) of the checkpoint at `model_path`, measured on `text`;
    `progress`: a progress bar over the windows on stderr."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    windows = spread_windows(tokenizer, text, window, max_positions // window)
    print(
        f"calibrate: {len(windows)} windows of {windows.shape[1]} tokens, "
        f"{windows.numel()} positions (--positions {max_positions} is a cap)",
        file=sys.stderr,
        flush=True,
    )
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype).to(device).eval()
    body = getattr(model, model.base_model_prefix)
    total = None
    for ids in progress_bar(
        windows, f"calibrate: {len(windows)} windows of {windows.shape[1]} tokens", progress
    ):
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
        "engine": "transformers",
    }
    return moment, meta
