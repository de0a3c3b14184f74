"""Look inside a loaded vLLM model (run in the worker through `LLM.apply_model`)."""

from __future__ import annotations

import torch


def digest(tensor: torch.Tensor) -> str:
    """A fingerprint of a tensor's bytes, to compare a table in the worker with one built here."""
    import hashlib

    data = tensor.detach().contiguous().cpu().view(torch.uint8).numpy()
    return hashlib.sha256(data.tobytes()).hexdigest()[:16]


def embedding_report(model: torch.nn.Module) -> dict:
    """The model's vocabulary tables (embeddings and LM heads): how each is stored and its
    bytes, plus every float tensor shaped like a vocabulary table, wherever it lives."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    tables = []
    vocab_shapes = set()
    table_tensors = {}
    for name, module in model.named_modules():
        if not isinstance(module, VocabParallelEmbedding):
            continue
        tensors = {n: t for n, t in module.named_parameters(recurse=False)}
        table_tensors.update({t.data_ptr(): t for t in tensors.values()})
        tables.append(
            {
                "name": name,
                "kind": "lm_head" if isinstance(module, ParallelLMHead) else "embedding",
                "class": type(module).__name__,
                "method": type(module.quant_method).__name__,
                # How the plugin's logs name a converted table, by role (None: not converted).
                "label": getattr(module.quant_method, "label", None),
                "format": getattr(getattr(module.quant_method, "fmt", None), "name", None),
                "rows": module.num_embeddings_per_partition,
                "cols": module.embedding_dim,
                "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
                # A host-format table is a device view of pinned host memory: no GPU bytes.
                "on_host": hasattr(module, "host_tensors"),
                "tensors": {n: [list(t.shape), str(t.dtype)] for n, t in tensors.items()},
                "digests": {n: digest(t) for n, t in tensors.items()},
                # Equal across two modules: the very same storage (a drafter's shared head).
                "data_ptrs": {n: t.data_ptr() for n, t in tensors.items()},
            }
        )
        vocab_shapes.add((module.num_embeddings_per_partition, module.embedding_dim))
    seen = set()
    float_vocab_tables = []
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]:
        key = tensor.data_ptr()
        if key in seen or not tensor.is_floating_point():
            continue
        seen.add(key)
        if tuple(tensor.shape) in vocab_shapes:
            float_vocab_tables.append(name)
    total = 0
    seen.clear()
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return {
        "tables": tables,
        # Bytes of all vocabulary tables, a tensor shared by a tied head counted once.
        "vocab_bytes": sum(t.numel() * t.element_size() for t in table_tensors.values()),
        "float_vocab_tables": float_vocab_tables,
        "model_bytes": total,
    }


def worker_report(worker) -> dict:
    """`embedding_report` of the target and, if any, the speculative-decoding draft, for
    `LLM.collective_rpc` (one entry per worker, so per tensor-parallel rank)."""
    runner = worker.model_runner
    drafter = getattr(runner, "drafter", None)
    draft_model = getattr(drafter, "model", None)
    return {
        "rank": getattr(worker, "rank", 0),
        "target": embedding_report(runner.model),
        "draft": embedding_report(draft_model) if draft_model is not None else None,
    }
