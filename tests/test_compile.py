"""The converted layer's forward as vLLM drives it: `torch.compile(fullgraph=True)` with the
token count dynamic, the first lookup inside the trace (cold), then warm calls at other
sizes without a recompile, then CUDA-graph capture and replay. Every result is bit-identical
to the eager forward.

On the CPU (CI) this covers the custom ops and the torch paths; with a GPU (the device) it
covers the Triton kernels, including the per-size tiling chosen inside the op.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import Parameter

from tests.test_machete import machete_runs
from vllm_embed_plugin.formats import HOST_FORMATS, make_format
from vllm_embed_plugin.formats.machete import MacheteLayout
from vllm_embed_plugin.method import CompactEmbeddingMethod

#: Tables in the layout of vLLM's Machete GEMM (a tied head on Hopper): the torch reference
#: on the CPU, vLLM's kernels on a Hopper GPU.
MACHETE = {
    "machete-int8": MacheteLayout(make_format("int8")),
    "machete-int4": MacheteLayout(make_format("int4", 64)),
}
FORMATS = ["int8", "int6", "int5", "int4", "fp8"] + (
    list(MACHETE) if machete_runs() or not torch.cuda.is_available() else []
)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# (tokens looked up, rows of logits) per call, on both sides of the kernels' size thresholds
# (lookup: 2048 tokens; tied GEMM: 1 row, <= 16, <= 64, more). vLLM first traces at its
# largest batch, then serves every smaller one from that graph.
SIZES = [(2100, 300), (3, 12), (5, 1), (64, 64)]


class Forward(torch.nn.Module):
    """What a model's forward does with the layer: the lookup, and the tied head's logits."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor):
        method = self.layer.quant_method
        return method.embedding(self.layer, ids), method.apply(self.layer, hidden)


def converted(name: str, device: str, rows: int = 4096, cols: int = 512) -> torch.nn.Module:
    layer = torch.nn.Module()
    g = torch.Generator().manual_seed(0)
    table = (torch.randn(rows, cols, generator=g) * 0.02).bfloat16().to(device)
    layer.weight = Parameter(table, requires_grad=False)
    fmt = HOST_FORMATS.get(name) or MACHETE.get(name) or make_format(name)
    layer.quant_method = CompactEmbeddingMethod(fmt, f"test {name}")
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def inputs(device: str, tokens: int, rows: int, layer: torch.nn.Module, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 4096, (tokens,), generator=g).to(device)
    hidden = torch.randn(rows, layer.embedding_cols, generator=g).bfloat16().to(device)
    return ids, hidden


def compiled(module: torch.nn.Module):
    """As vLLM compiles a forward (`vllm/compilation/wrapper.py`): one full graph, token
    dimensions marked dynamic by the caller, every guard dropped."""
    torch._dynamo.reset()
    return torch.compile(
        module,
        fullgraph=True,
        dynamic=False,
        options={"guard_filter_fn": lambda guards: [False for _ in guards]},
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", FORMATS)
def test_forward_compiles_cold_then_serves_every_size_bit_identical(name, device):
    layer = converted(name, device)
    forward = Forward(layer)
    fast = compiled(forward)
    for i, (tokens, rows) in enumerate(SIZES):
        ids, hidden = inputs(device, tokens, rows, layer, seed=i)
        if i == 0:
            # The first call traces, and the ops meet the kernels for the first time inside
            # the trace. Later sizes reuse that one graph (no guards): the size-dependent
            # choices must live inside the ops.
            torch._dynamo.mark_dynamic(ids, 0)
            torch._dynamo.mark_dynamic(hidden, 0)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            got = fast(ids, hidden)
        want = forward(ids, hidden)
        assert torch.equal(got[0], want[0]), f"lookup differs at {tokens} tokens"
        assert torch.equal(got[1], want[1]), f"logits differ at {rows} rows"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", FORMATS + ["host"])
def test_compiled_forward_captures_into_a_cuda_graph(name):
    layer = converted(name, "cuda")
    forward = Forward(layer)
    fast = compiled(forward)
    ids, hidden = inputs("cuda", 64, 8, layer)
    torch._dynamo.mark_dynamic(ids, 0)
    torch._dynamo.mark_dynamic(hidden, 0)
    fast(ids, hidden)  # compile and warm up outside the capture, as vLLM does
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fast(ids, hidden)
    # New inputs in the captured buffers, then replay.
    new_ids, new_hidden = inputs("cuda", 64, 8, layer, seed=7)
    ids.copy_(new_ids)
    hidden.copy_(new_hidden)
    graph.replay()
    torch.cuda.synchronize()
    want = forward(ids, hidden)
    assert torch.equal(captured[0], want[0])
    assert torch.equal(captured[1], want[1])


def test_op_fake_shapes_follow_inputs():
    """The fake implementations give vLLM's tracer the right shapes and dtypes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    layer = converted("int8", "cpu", rows=64, cols=128)
    with FakeTensorMode(allow_non_fake_inputs=True):
        ids = torch.zeros(2, 5, dtype=torch.long)
        hidden = torch.zeros(3, 128, dtype=torch.bfloat16)
        looked_up, logits = Forward(layer)(ids, hidden)
    assert looked_up.shape == (2, 5, 128) and looked_up.dtype == torch.bfloat16
    assert logits.shape == (3, 64) and logits.dtype == torch.bfloat16
