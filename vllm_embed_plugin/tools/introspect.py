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
                # Where each tensor's memory starts, and its size: two tables with the same
                # storages are one table (a drafter sharing the target's), not equal copies.
                "storages": {
                    n: [t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()]
                    for n, t in tensors.items()
                },
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
    # vLLM's V1 model runner holds the drafter as `drafter`, its V2 runner as `speculator`.
    drafter = getattr(runner, "drafter", None) or getattr(runner, "speculator", None)
    draft_model = getattr(drafter, "model", None)
    return {
        "rank": getattr(worker, "rank", 0),
        "target": embedding_report(runner.model),
        "draft": embedding_report(draft_model) if draft_model is not None else None,
    }


#: State of `head_profile_start` / `head_profile_stop` in a worker process.
_HEAD_PROFILE: dict = {}


def head_profile_start(worker, kernels: bool = False) -> None:
    """Time every LM-head call of this worker from now on (for `LLM.collective_rpc`): host
    time of `compute_logits` (perf_counter, no synchronisation) and its GPU span (CUDA events
    around it). With `kernels`, also a torch.profiler trace of every GPU kernel, CUDA-graph
    replays included, for the split of the rest of the step."""
    import time

    state = _HEAD_PROFILE
    model = worker.model_runner.model
    if state.get("model") is not model:
        original = model.compute_logits

        def timed(*args, **kwargs):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            out = original(*args, **kwargs)
            host = time.perf_counter() - t0
            end.record()
            state["calls"].append((host, start, end, args[0].shape[0] if args else 0))
            return out

        model.compute_logits = timed  # an instance attribute: vLLM calls model.compute_logits
        state["model"] = model
    state["calls"] = []
    state["profiler"] = None
    if kernels:
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        state["profiler"] = torch.profiler.profile(activities=activities)
        state["profiler"].__enter__()


def head_profile_stop(worker, top: int = 12) -> dict:
    """What `head_profile_start` measured since: LM-head calls with their host and GPU time
    (us, mean and median), and with a kernel trace the GPU time of all kernels and the `top`
    kernels by time (us in all)."""
    import statistics

    torch.cuda.synchronize()
    state = _HEAD_PROFILE
    calls = state.get("calls", [])
    host = [c[0] * 1e6 for c in calls]
    gpu = [c[1].elapsed_time(c[2]) * 1e3 for c in calls]
    report = {
        "head_calls": len(calls),
        "head_rows": sorted({c[3] for c in calls}),
        "head_cpu_us_mean": statistics.fmean(host) if host else None,
        "head_cpu_us_median": statistics.median(host) if host else None,
        "head_gpu_us_mean": statistics.fmean(gpu) if gpu else None,
        "head_gpu_us_median": statistics.median(gpu) if gpu else None,
    }
    profiler = state.get("profiler")
    if profiler is not None:
        profiler.__exit__(None, None, None)
        state["profiler"] = None
        kernels = sorted(
            (
                (e.key, e.self_device_time_total, e.count)
                for e in profiler.key_averages()
                if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total
            ),
            key=lambda k: -k[1],
        )
        report["gpu_kernel_us_total"] = sum(k[1] for k in kernels)
        report["top_kernels"] = [
            {"name": name[:90], "us": us, "count": count} for name, us, count in kernels[:top]
        ]
    state["calls"] = []
    return report
