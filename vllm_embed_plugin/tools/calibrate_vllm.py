"""Measure M = E[h h^T] inside a vLLM engine: `vllm-embed-plugin calibrate MODEL --engine vllm`.

For models too large for the transformers path on the CPU: vLLM loads the model on whatever
device it runs (GPU or CPU, split over `tensor_parallel_size` GPUs), and a forward hook on the
model's final norm sums h h^T in float64 inside each worker while vLLM prefills the same
windows `calibrate.measure` would use. The result is the same file.

- The plugin is off in that engine: M describes the original model's hidden state.
- Eager mode, no prefix caching, one generated token: every prompt token passes the final norm
  exactly once, in whatever prefill chunks vLLM schedules, and nothing else does. The worker
  counts what it summed; a count other than the windows' tokens is an error, never a figure.
- Tensor parallelism: the final norm's output is the whole hidden state on every rank (the
  residual stream is all-reduced before it), so rank 0's sum is M; the others are checked to
  agree with it.

The functions that run in the workers (`install_hook`, `collect`) are sent by
`LLM.apply_model`, which needs VLLM_ALLOW_INSECURE_SERIALIZATION=1 (set here).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import torch

from . import ToolError
from .calibrate import DEFAULT_POSITIONS, DEFAULT_WINDOW, is_tied, spread_windows

#: The attribute on the worker's model that holds the running sums while a hook is installed.
STATE = "_vllm_embed_calibration"


def final_norm(model: torch.nn.Module) -> torch.nn.Module:
    """The norm whose output the LM head multiplies: the last norm module outside the layers
    (`model.norm` for Llama, Qwen, Gemma and most decoders), in the language model of a
    multimodal one."""
    if hasattr(model, "get_language_model"):
        model = model.get_language_model()
    found = None
    for name, module in model.named_modules():
        parts = name.split(".")
        if any(p.isdigit() for p in parts) or not name:
            continue  # inside a decoder layer
        if "norm" in parts[-1] or parts[-1] == "ln_f":
            found = module
    if found is None:
        raise RuntimeError(f"{type(model).__name__}: no final norm found to hook")
    return found


def install_hook(model: torch.nn.Module) -> str:
    """In a worker: start summing h h^T (float64) of the final norm's output."""
    norm = final_norm(model)

    def hook(module, args, output):
        h = output[0] if isinstance(output, tuple) else output  # (out, residual) when fused
        h = h.reshape(-1, h.shape[-1]).double()
        state = getattr(model, STATE)
        state["sum"] = state["sum"] + h.T @ h if state["sum"] is not None else h.T @ h
        state["count"] += h.shape[0]

    setattr(model, STATE, {"sum": None, "count": 0, "handle": norm.register_forward_hook(hook)})
    return type(norm).__name__


def collect(model: torch.nn.Module) -> tuple[bytes, int]:
    """In a worker: remove the hook; (the float64 sum of h h^T [cols, cols] as raw bytes, which
    cross vLLM's RPC compactly, and the positions summed)."""
    state = getattr(model, STATE)
    state["handle"].remove()
    delattr(model, STATE)
    total = state["sum"]
    return (b"" if total is None else total.cpu().numpy().tobytes(), state["count"])


def _tensor(raw: bytes) -> torch.Tensor:
    flat = torch.frombuffer(bytearray(raw), dtype=torch.float64)
    cols = math.isqrt(flat.numel())
    return flat.view(cols, cols)


def _plugin_off() -> None:
    """The engine's processes inherit this environment: no VLLM_EMBED_* setting or config file
    reaches the plugin, so it leaves the model as it is."""
    from ..settings import ENV_PREFIX

    for key in [k for k in os.environ if k.startswith(ENV_PREFIX)]:
        del os.environ[key]
    os.environ[ENV_PREFIX + "FORMAT"] = "off"


def measure_vllm(
    model_path: str | Path,
    text: str,
    *,
    window: int = DEFAULT_WINDOW,
    max_positions: int = DEFAULT_POSITIONS,
    dtype: str = "auto",
    tensor_parallel_size: int = 1,
    max_num_batched_tokens: int | None = None,
    gpu_memory_utilization: float | None = None,
    progress: bool = False,
) -> tuple[torch.Tensor, dict]:
    """(M [cols, cols], metadata) as `calibrate.measure` returns them, measured in vLLM.
    `gpu_memory_utilization`: as vLLM's; by default vLLM's own on a GPU, and a quarter of the
    memory on the CPU backend (where vLLM's default reserves 92% of the machine's)."""
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    _plugin_off()
    from transformers import AutoConfig, AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    windows = spread_windows(tokenizer, text, window, max_positions // window)
    print(
        f"calibrate: {len(windows)} windows of {windows.shape[1]} tokens, "
        f"{windows.numel()} positions (--positions {max_positions} is a cap), in vLLM",
        file=sys.stderr,
        flush=True,
    )
    from vllm.platforms import current_platform

    extra = {}
    if max_num_batched_tokens is not None:
        extra["max_num_batched_tokens"] = max_num_batched_tokens
    if gpu_memory_utilization is None and current_platform.is_cpu():
        gpu_memory_utilization = 0.25
    if gpu_memory_utilization is not None:
        extra["gpu_memory_utilization"] = gpu_memory_utilization
    llm = LLM(
        model=str(model_path),
        dtype=dtype,
        tensor_parallel_size=tensor_parallel_size,
        max_model_len=windows.shape[1] + 1,
        enforce_eager=True,  # hooks run in eager mode only (not in compiled graphs or CUDA graphs)
        enable_prefix_caching=False,  # a cached prefix would skip its tokens' forward pass
        seed=0,
        **extra,
    )
    llm.apply_model(install_hook)
    llm.generate(
        [TokensPrompt(prompt_token_ids=ids.tolist()) for ids in windows],
        SamplingParams(max_tokens=1, detokenize=False),
        use_tqdm=progress,
    )
    ranks = [(_tensor(raw), n) for raw, n in llm.apply_model(collect)]
    total, count = ranks[0]
    if count != windows.numel():
        raise ToolError(
            f"the final norm saw {count} positions, not the {windows.numel()} of the windows: "
            "this model's forward pass is not one final-norm call per token"
        )
    for rank, (other, n) in enumerate(ranks[1:], 1):
        if n != count or not torch.allclose(other, total, rtol=1e-2, atol=1e-6 * total.abs().max()):
            raise ToolError(f"tensor-parallel rank {rank} saw another hidden state than rank 0")
    del llm
    config = AutoConfig.from_pretrained(str(model_path))
    meta = {
        "model": str(model_path),
        "rows": config.get_text_config().vocab_size,
        "cols": total.shape[0],
        "positions": count,
        "tied": is_tied(config),
        "engine": "vllm",
    }
    return (total / count).float(), meta
