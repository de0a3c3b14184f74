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


def lookup_scale(embedding: torch.nn.Module, ids: torch.Tensor, looked_up: torch.Tensor) -> float:
    """The factor between a table row and what the embedding module returns for it (Gemma
    multiplies by sqrt(hidden size); most models by 1), checked to be one number."""
    rows = embedding.weight[ids].to(looked_up.dtype)
    scale = float((looked_up * rows).sum() / rows.pow(2).sum().clamp_min(1e-30))
    if not torch.allclose(looked_up, rows * scale, rtol=1e-2, atol=1e-6):
        raise RuntimeError(f"{type(embedding).__name__} is not a scaled table lookup")
    return scale


def logits_of(model, hidden: torch.Tensor) -> torch.Tensor:
    """The model's logits from its final hidden states (head, then any final soft-cap)."""
    z = model.get_output_embeddings()(hidden)
    cap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    return torch.tanh(z / cap) * cap if cap else z


def measure(
    model_path: str | Path,
    text: str,
    *,
    window: int = DEFAULT_WINDOW,
    max_positions: int = DEFAULT_POSITIONS,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """(M, S or None, metadata) of the checkpoint at `model_path`, measured on `text`
    (`importance.py`; S for a tied model only, see `measure_model`); `progress`: a progress
    bar over the windows on stderr."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    windows = spread_windows(tokenizer, text, window, max_positions // window)
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype).to(device).eval()
    tied = is_tied(model.config)
    print(
        f"calibrate: {len(windows)} windows of {windows.shape[1]} tokens, "
        f"{windows.numel()} positions (--positions {max_positions} is a cap)"
        + (", a backward pass each for the lookup's Fisher information" if tied else ""),
        file=sys.stderr,
        flush=True,
    )
    moment, fisher = measure_model(model, windows, fisher=tied, progress=progress)
    table = model.get_input_embeddings().weight
    meta = {
        "model": str(model_path),
        "rows": table.shape[0],
        "cols": table.shape[1],
        "positions": windows.numel(),
        "tied": tied,
        "engine": "transformers",
    }
    return moment, fisher, meta


def is_tied(config) -> bool:
    """Whether a transformers config (multimodal ones by their text model) ties its LM head to
    the input embedding."""
    return bool(getattr(config.get_text_config(), "tie_word_embeddings", False))


def measure_model(
    model, windows: torch.Tensor, *, fisher: bool, progress: bool = False, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(M, S or None) [cols, cols] float32 of a transformers causal LM over token `windows`
    [n, window]; S only with `fisher` (only a tied table uses it).

    S: at every position a token y is drawn from the model's own next-token distribution p,
    and sum log p(y) is back-propagated to the input embeddings. The mean outer product of
    the per-position gradient g, scaled back to the table's rows, is S: E_y[g g^T] is the
    Fisher information, and the cross terms between positions vanish in expectation."""
    body = getattr(model, model.base_model_prefix)
    embedding = model.get_input_embeddings()
    device = embedding.weight.device
    cols = embedding.weight.shape[1]
    generator = torch.Generator(device).manual_seed(seed)
    moment = torch.zeros(cols, cols, dtype=torch.float64, device=device)
    information = torch.zeros_like(moment) if fisher else None
    frozen = [p for p in model.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)  # gradients for the input embeddings only
    try:
        for ids in progress_bar(
            windows, f"calibrate: {len(windows)} windows of {windows.shape[1]} tokens", progress
        ):
            ids = ids[None].to(device)
            with torch.no_grad():
                looked_up = embedding(ids)
            x = looked_up.clone().requires_grad_(fisher)
            with torch.set_grad_enabled(fisher):
                h = body(inputs_embeds=x).last_hidden_state[0]
            moment += h.detach().double().T @ h.detach().double()
            if information is None:
                continue
            logp = torch.log_softmax(logits_of(model, h).float(), -1)
            with torch.no_grad():
                y = torch.multinomial(logp.exp(), 1, generator=generator)
            logp.gather(1, y).sum().backward()
            g = x.grad[0].double() * lookup_scale(embedding, ids[0], looked_up[0])
            information += g.T @ g
            del logp, x, h
    finally:
        for p in frozen:
            p.requires_grad_(True)
    positions = windows.numel()
    moment = (moment / positions).float().cpu()
    return moment, None if information is None else (information / positions).float().cpu()
