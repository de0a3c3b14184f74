"""What each format would save for a model, computed from its `config.json` alone.

Freed bytes become KV cache: extra tokens = freed bytes / KV bytes per token, where the KV
bytes per token come from the model's own layout (layers, KV heads, head size, KV dtype).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..formats import FORMATS, make_format

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
#: `--kv-cache-dtype` values, by vLLM's names ("auto": the model's dtype).
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")


def load_config(model: str | Path) -> dict:
    """config.json from a model directory or the file itself; multimodal configs yield their
    text config."""
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{model}: no config.json (give a model directory or a config.json)"
        )
    config = json.loads(path.read_text())
    return config.get("text_config", config) | {"_top": config}


@dataclass(frozen=True)
class KvLayout:
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    sliding_layers: int = 0
    sliding_window: int | None = None

    @property
    def bytes_per_token(self) -> int:
        """K and V for every layer (sliding-window layers counted like full ones: a token
        inside the window costs the same)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


def kv_layout(config: dict, kv_dtype: str | None = None) -> KvLayout:
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    if kv_dtype in (None, "auto"):
        kv_dtype = None
    dtype = kv_dtype or config.get("torch_dtype") or config.get("dtype") or "bfloat16"
    layer_types = config.get("layer_types") or []
    return KvLayout(
        layers=config["num_hidden_layers"],
        kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        dtype_bytes=DTYPE_BYTES.get(dtype, 2),
        sliding_layers=sum(1 for t in layer_types if "sliding" in t),
        sliding_window=config.get("sliding_window"),
    )


def kv_tokens(freed_bytes: int, kv_bytes_per_token: int) -> int:
    """The KV-cache tokens that `freed_bytes` buy, whole tokens only."""
    return max(0, freed_bytes) // max(1, kv_bytes_per_token)


@dataclass(frozen=True)
class PlanRow:
    format: str
    description: str
    table_bytes: int
    freed_bytes: int
    extra_kv_tokens: int
    extra_sequences: float


def plan(
    config: dict, max_model_len: int, tensor_parallel: int = 1, kv_dtype: str | None = None
) -> tuple[dict, list[PlanRow]]:
    """Per-GPU savings of each format for this model (tied tables are stored once). An untied
    model gets a second row per format, "FMT+head": the embedding and the LM head both in FMT
    (`head_format`), so both tables' freed bytes count toward the KV cache."""
    rows = -(-config["vocab_size"] // 64) * 64  # vLLM pads the vocabulary to 64
    rows_per_rank = rows // tensor_parallel
    cols = config["hidden_size"]
    tied = bool(config.get("tie_word_embeddings", config["_top"].get("tie_word_embeddings", False)))
    layout = kv_layout(config, kv_dtype)
    kv_per_rank = max(1, layout.bytes_per_token // tensor_parallel)
    bf16 = rows_per_rank * cols * 2
    result = [PlanRow("off", "BF16 (vLLM default)", bf16, 0, 0, 0.0)]
    for name in FORMATS:
        fmt = make_format(name)
        packed = fmt.nbytes(rows_per_rank, cols)
        freed = bf16 - packed
        tokens = kv_tokens(freed, kv_per_rank)
        result.append(
            PlanRow(name, fmt.describe(cols), packed, freed, tokens, tokens / max_model_len)
        )
    if not tied:
        for row in result[1:]:
            tokens = 2 * row.freed_bytes // kv_per_rank
            result.append(
                PlanRow(
                    f"{row.format}+head",
                    f"{row.description}; embedding and LM head (head_format={row.format})",
                    2 * row.table_bytes,
                    2 * row.freed_bytes,
                    tokens,
                    tokens / max_model_len,
                )
            )
    info = {
        "table": f"{rows} x {cols}"
        + (f" ({rows_per_rank} rows per rank)" if tensor_parallel > 1 else ""),
        "tied": tied,
        "kv_bytes_per_token": kv_per_rank,
        "layout": layout,
    }
    return info, result
