"""Small random checkpoints written with transformers, for end-to-end tests and the demo."""

from __future__ import annotations

from pathlib import Path


def write_checkpoint(
    path: Path,
    arch: str = "qwen2",
    tied: bool = False,
    vocab: int = 8192,
    hidden: int = 256,
    layers: int = 2,
    seed: int = 0,
) -> Path:
    import torch
    import transformers

    configs = {
        "qwen2": transformers.Qwen2Config,
        "llama": transformers.LlamaConfig,
    }
    config = configs[arch](
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=tied,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model_cls = {"qwen2": transformers.Qwen2ForCausalLM, "llama": transformers.LlamaForCausalLM}[
        arch
    ]
    model = model_cls(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return Path(path)
