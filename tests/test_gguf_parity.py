"""`int8`, `int5` and `int4` at group 32 claim llama.cpp's rules (Q8_0, Q5_1, Q4_0): checked
against the quantizers of the `gguf` package (llama.cpp's own Python port).

Same layout and scale rules, so the dequantized tables agree except where a value lies within
rounding of a level boundary: there the two differ by exactly one level, because this
project rounds against the stored (float16) scale and gguf against the unrounded one. That
happens for under 1% of the values and never makes the table worse.
"""

from __future__ import annotations

import pytest
import torch

from vllm_embed_plugin.formats import make_format

gguf = pytest.importorskip("gguf")

CASES = [("int8", "Q8_0", 0.01), ("int5", "Q5_1", 0.006), ("int4", "Q4_0", 0.001)]


@pytest.mark.parametrize("name, qtype, max_share", CASES)
def test_format_reproduces_llama_cpp_quantizer(name, qtype, max_share):
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(256, 512, generator=g) * 0.02
    rows[3, 5] = 0.5  # an outlier, as real tables have
    fmt = make_format(name, group_size=32)
    packed = fmt.quantize(rows)
    ours = fmt.dequantize(packed, 512, torch.float32)
    kind = gguf.GGMLQuantizationType[qtype]
    theirs = torch.from_numpy(
        gguf.quants.dequantize(gguf.quants.quantize(rows.numpy(), kind), kind)
    ).reshape(rows.shape)
    # Difference in units of the group's step: 0 almost everywhere, one level at most.
    steps = (ours - theirs).abs() / packed.scales.float().repeat_interleave(32, dim=1)
    assert steps.max().item() <= 1 + 1e-3
    assert (steps > 1e-3).float().mean().item() <= max_share
    error = lambda table: ((table - rows) ** 2).mean().item()  # noqa: E731
    assert error(ours) <= error(theirs) * (1 + 1e-6)
