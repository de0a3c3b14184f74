"""Timing and table helpers shared by the GPU benchmarks (bench_kernels, bench_gemm,
bench_machete, bench_head): each benchmark imports this module, none imports another's
helpers, so there is no import circle between them."""

from __future__ import annotations

import os
import pickle
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vllm_embed_plugin.formats import Fp8Format  # noqa: E402
from vllm_embed_plugin.formats.base import PackedRows, TableFormat  # noqa: E402

# -- timing ------------------------------------------------------------------------------------


def graph_time_us(fn, replays: int = 200, per_graph: int = 1) -> float:
    """Mean time of fn() in replays of a graph holding `per_graph` calls of it, after warm-up.
    per_graph > 1 (small batches) takes the CPU's graph-launch rate out of the number."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    graph.reset()
    return start.elapsed_time(end) * 1000 / (replays * per_graph)


def lookup_time(fn, n: int, replays: int = 200) -> float:
    """Per-lookup time of fn() at n tokens: up to 256 tokens, graphs of 20 lookups and 50
    replays (1000 lookups, the time inside a captured forward); larger n one per graph."""
    return graph_time_us(fn, 50, 20) if n <= 256 else graph_time_us(fn, replays)


def event_time_us(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps


def median_time(fn, m: int, runs: int = 3) -> float:
    """GPU time of fn() at m rows: the median of `runs` graph-replay means."""
    replays = 100 if m <= 64 else (30 if m <= 256 else 5)
    return statistics.median(graph_time_us(fn, replays) for _ in range(runs))


def cpu_time_us(fn, calls: int = 100, runs: int = 3) -> float:
    """Host time of one eager fn() call, the launch cost alone: the GPU is held busy by a
    sleep kernel queued first, so no call waits on the GPU (the median of `runs` runs)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        # About 1 ms of GPU clock per call, far more than any call's host time.
        torch.cuda._sleep(int(calls * 2e6))
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) * 1e6 / calls)
        torch.cuda.synchronize()
    return statistics.median(times)


# -- tables ----------------------------------------------------------------------------------


def random_packed(fmt: TableFormat, rows: int, cols: int, device="cuda", pin=False) -> PackedRows:
    """Random codes and plausible scales (a std-0.02 table's), much faster than quantizing;
    `pin`: made on the GPU, then copied into pinned host memory."""
    p = fmt.empty(rows, cols, device)
    gen_dev = device
    step = 1 << 15
    for s in range(0, rows, step):
        codes = torch.randint(
            0, 256, p.codes[s : s + step].shape, dtype=torch.uint8, device=gen_dev
        )
        if isinstance(fmt, Fp8Format):  # no NaN codes (S.1111.111)
            codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes)
        p.codes[s : s + step].copy_(codes)
    levels = 127 if isinstance(fmt, Fp8Format) else max(1, 2 ** (getattr(fmt, "bits", 8) - 1) - 1)
    p.scales.copy_((torch.rand(p.scales.shape, device=gen_dev) * 0.5 + 0.75) * (0.06 / levels))
    if p.mins is not None:
        p.mins.copy_(-(torch.rand(p.mins.shape, device=gen_dev) * 0.02 + 0.05))
    if pin:
        p = p.map(lambda t: torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t))
    return p


def md_table(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


# -- parallel pre-compilation of the Triton variants (same shapes -> same specialisations) ----


def _compile_job(job) -> bool:
    """Compile one variant in a process of its own: a Triton crash (an LLVM ERROR aborts the
    process, it raises nothing) then fails this variant only."""
    code = (
        "import pickle, sys; from timing import _compile; _compile(pickle.load(sys.stdin.buffer))"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code],
            input=pickle.dumps(job),
            capture_output=True,
            timeout=900,
            cwd=os.path.dirname(__file__),
        )
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


def _compile(job):
    kind, fmt, cols, n, rows, config = job
    torch.cuda.init()
    from vllm_embed_plugin.kernels import triton_linear, triton_lookup

    if kind == "lookup":
        table = random_packed(fmt, 2, cols)
        ids = torch.zeros(n, dtype=torch.int64, device="cuda")
        triton_lookup.lookup(fmt, table, ids, cols, torch.bfloat16, config=config)
    else:
        table = random_packed(fmt, rows, cols)
        x = torch.zeros(n, cols, dtype=torch.bfloat16, device="cuda")
        triton_linear.linear(fmt, table, x, cols, config=config)
    torch.cuda.synchronize()
    return True


def precompile(jobs, workers=12) -> list[bool]:
    """Compile `jobs` in parallel (one process each); whether each compiled. A variant that
    failed must not be run in this process: Triton may abort it."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        ok = list(pool.map(_compile_job, jobs))
    print(
        f"precompiled {len(jobs)} variants in {time.perf_counter() - t0:.1f} s, "
        f"{ok.count(False)} failed",
        flush=True,
    )
    return ok


#: Issue 24's GPU targets (ratio to BF16) by format, for M = 1, M <= 16, M = 64, M <= 256.
TARGETS = {
    "int8": (0.55, 0.60, 0.70, 1.0),
    "int4": (0.35, 0.40, 0.55, 1.0),
    "int5": (0.60, 0.60, 0.80, 1.0),
    "int6": (0.60, 0.60, 0.80, 1.0),
    "fp8": (None, None, None, 1.0),
}


def gpu_target(name: str, m: int) -> float | None:
    """Issue 24's ratio to BF16 for format `name` at M rows of x (M = 4096: 1.05)."""
    t1, t16, t64, t256 = TARGETS[name]
    if m == 1:
        return t1
    if m <= 16:
        return t16
    if m == 64:
        return t64
    if m <= 256:
        return t256
    return 1.05
