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


def write_tokenized_checkpoint(path: Path, text: str, vocab: int = 512, seed: int = 0) -> Path:
    """A random 2-layer Llama (hidden 256, BF16, tied) with a byte-level BPE tokenizer trained
    on `text`: a model that the text tools (calibrate, eval) can run on real text."""
    import tokenizers
    import transformers

    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<unk>", "<s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator([text], trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="<s>"
    )
    tokenizer.add_bos_token = True
    tokenizer.save_pretrained(path)
    write_checkpoint(path, "llama", tied=True, vocab=bpe.get_vocab_size(), seed=seed)
    return Path(path)
