"""The LM head's eager path (`kernels.linear` as vLLM calls it, outside its graphs): recorded
per number of rows and replayed (`kernels/head_graphs.py`), bit-identical to the direct
launch; direct wherever a graph does not apply. GPU cases skip without CUDA."""

from __future__ import annotations

import pytest
import torch

from vllm_embed_plugin import kernels
from vllm_embed_plugin.convert import quantize_table
from vllm_embed_plugin.formats import FORMATS
from vllm_embed_plugin.kernels import head_graphs

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _table(name: str, rows: int, cols: int, device: str):
    torch.manual_seed(0)
    weight = torch.randn(rows, cols, dtype=torch.bfloat16, device=device) * 0.02
    return FORMATS[name], quantize_table(weight, FORMATS[name])


def test_cpu_calls_never_record(monkeypatch):
    """On the CPU the graphs are never touched and the logits are the op's."""
    fmt, table = _table("int8", 96, 64, "cpu")
    graphs = kernels.HeadGraphs()
    monkeypatch.setattr(graphs, "logits", None)  # any use would raise
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    got = kernels.linear(fmt, table, x, 64, graphs=graphs)
    want = torch.ops.vllm_embed.linear(
        x, table.codes, table.scales, table.mins, kernels.register_format(fmt), 64
    )
    assert torch.equal(got, want)


def test_eager_body_writes_into_the_given_output():
    fmt, table = _table("int4", 80, 64, "cpu")
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    out = torch.full((5, 80), float("nan"), dtype=torch.bfloat16)
    got = kernels.linear_eager(fmt, table, x, 64, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(out, kernels.linear_eager(fmt, table, x, 64))


@cuda
@pytest.mark.parametrize("name", ["int8", "int6", "int5", "int4", "fp8"])
def test_replayed_head_is_bit_identical_to_the_direct_launch(name):
    rows, cols = 4099, 256
    fmt, table = _table(name, rows, cols, "cuda")
    graphs = kernels.HeadGraphs()
    # Growing batch sizes reallocate the static buffers; smaller ones replay earlier graphs.
    for m in (1, 3, 16, 40, 1, 200, 3, 256):
        for _ in range(2):  # the second call of a size replays its recorded graph
            x = torch.randn(m, cols, dtype=torch.bfloat16, device="cuda")
            got = kernels.linear(fmt, table, x, cols, graphs=graphs).clone()
            want = kernels.linear_eager(fmt, table, x, cols)
            assert torch.equal(got, want), (name, m)
    assert set(graphs._recorded) == {3, 200, 256}  # the buffers grew at 40 and at 200


@cuda
def test_a_new_table_records_anew_and_large_batches_launch_directly():
    fmt, table = _table("int8", 1000, 128, "cuda")
    _, other = _table("int8", 1000, 128, "cuda")
    other.codes.copy_(torch.flip(table.codes, dims=[0]))
    graphs = kernels.HeadGraphs()
    x = torch.randn(4, 128, dtype=torch.bfloat16, device="cuda")
    first = kernels.linear(fmt, table, x, 128, graphs=graphs).clone()
    second = kernels.linear(fmt, other, x, 128, graphs=graphs).clone()
    assert torch.equal(first, kernels.linear_eager(fmt, table, x, 128))
    assert torch.equal(second, kernels.linear_eager(fmt, other, x, 128))
    big = torch.randn(head_graphs.MAX_ROWS + 1, 128, dtype=torch.bfloat16, device="cuda")
    out = kernels.linear(fmt, table, big, 128, graphs=graphs)
    assert torch.equal(out, kernels.linear_eager(fmt, table, big, 128))
    assert head_graphs.MAX_ROWS + 1 not in graphs._recorded


@cuda
def test_inside_a_capture_the_head_launches_directly():
    """vLLM (or a drafter) capturing a graph that holds the head: the kernels go into that
    graph, not into one of the head's own."""
    fmt, table = _table("int8", 1000, 128, "cuda")
    graphs = kernels.HeadGraphs()
    x = torch.randn(2, 128, dtype=torch.bfloat16, device="cuda")
    kernels.linear(fmt, table, x, 128, graphs=graphs)  # compiled, and a graph for m=2
    graphs._recorded.clear()
    outer = torch.cuda.CUDAGraph()
    with torch.cuda.graph(outer):
        out = kernels.linear(fmt, table, x, 128, graphs=graphs)
    assert not graphs._recorded
    x.copy_(torch.randn_like(x))
    outer.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, kernels.linear_eager(fmt, table, x, 128))
