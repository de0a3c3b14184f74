"""The vLLM quantize method on real tensors: conversion, fault handling, tied heads."""

from __future__ import annotations

import os

import psutil
import pytest
import torch
from torch.nn import Parameter

from vllm_embed_plugin import memory
from vllm_embed_plugin.convert import SCRATCH_BYTES_PER_ELEMENT
from vllm_embed_plugin.formats import ConversionError, IntFormat, make_format
from vllm_embed_plugin.method import CompactEmbeddingMethod


def make_layer(rows=512, cols=256, seed=0):
    layer = torch.nn.Module()
    g = torch.Generator().manual_seed(seed)
    layer.weight = Parameter(
        (torch.randn(rows, cols, generator=g) * 0.02).bfloat16(), requires_grad=False
    )
    return layer


def test_conversion_replaces_table_and_lookup_matches_reference():
    layer = make_layer()
    original = layer.weight.detach().clone()
    fmt = make_format("int8")
    method = CompactEmbeddingMethod(fmt, "test")
    assert memory.pending() == 1
    method.process_weights_after_loading(layer)
    assert memory.pending() == 0
    assert layer.weight.dtype == torch.uint8 and not layer.weight.requires_grad
    assert {n for n, _ in layer.named_parameters()} >= {"weight", "weight_scales"}
    ids = torch.tensor([[0, 5, 511], [7, 7, 3]])
    out = method.embedding(layer, ids)
    assert out.shape == (2, 3, 256) and out.dtype == torch.bfloat16
    reference = fmt.dequantize(fmt.quantize(original), 256, torch.bfloat16)
    assert torch.equal(out.view(-1, 256), reference[ids.view(-1)])


class FailingFormat(IntFormat):
    """Runs out of memory on the second chunk, as a large table might."""

    def quantize(self, rows, importance=None, round_group=None):
        calls = getattr(self, "calls", 0) + 1
        object.__setattr__(self, "calls", calls)  # a frozen dataclass, like every format
        if calls == 2:
            raise torch.OutOfMemoryError("injected: CUDA out of memory")
        return super().quantize(rows, importance, round_group)


def faulty_layers():
    nan = make_layer()
    nan.weight.data[100, 3] = float("nan")
    inf = make_layer()
    inf.weight.data[7] = float("inf")
    return {
        "nan-row": (nan, make_format("int8")),
        "inf-row": (inf, make_format("int8")),
        "oom-midway": (make_layer(), FailingFormat("int8", 8, None)),
    }


@pytest.mark.parametrize("case", ["nan-row", "inf-row", "oom-midway"])
def test_failed_conversion_with_fail_raises_and_leaves_layer_untouched(case, monkeypatch):
    layer, fmt = faulty_layers()[case]
    monkeypatch.setattr(
        "vllm_embed_plugin.convert.DEFAULT_SCRATCH_BYTES", 64 * 256 * SCRATCH_BYTES_PER_ELEMENT
    )
    before = layer.weight.detach().clone()
    method = CompactEmbeddingMethod(fmt, "embed", on_error="fail")
    with pytest.raises(ConversionError, match="left unchanged.*VLLM_EMBED_ON_ERROR=keep"):
        method.process_weights_after_loading(layer)
    assert layer.weight.dtype == torch.bfloat16
    assert torch.equal(layer.weight.view(torch.int16), before.view(torch.int16))
    assert not hasattr(layer, "weight_scales")
    assert memory.pending() == 0


@pytest.mark.parametrize("case", ["nan-row", "inf-row", "oom-midway"])
def test_failed_conversion_with_keep_serves_bf16(case, monkeypatch, caplog):
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    layer, fmt = faulty_layers()[case]
    monkeypatch.setattr(
        "vllm_embed_plugin.convert.DEFAULT_SCRATCH_BYTES", 64 * 256 * SCRATCH_BYTES_PER_ELEMENT
    )
    before = layer.weight.detach().clone()
    layer.quant_method = CompactEmbeddingMethod(fmt, "embed", on_error="keep")
    layer.quant_method.process_weights_after_loading(layer)
    assert isinstance(layer.quant_method, UnquantizedEmbeddingMethod)
    assert torch.equal(layer.weight.view(torch.int16), before.view(torch.int16))
    ids = torch.tensor([1, 2, 3])
    assert torch.equal(
        layer.quant_method.embedding(layer, ids).view(torch.int16), before[ids].view(torch.int16)
    )
    assert memory.pending() == 0


def test_all_zero_rows_convert_to_zero():
    layer = make_layer()
    layer.weight.data[10:20] = 0
    method = CompactEmbeddingMethod(make_format("int8"), "embed")
    method.process_weights_after_loading(layer)
    out = method.embedding(layer, torch.arange(10, 20))
    assert torch.equal(out, torch.zeros_like(out))


def test_repeated_loads_leak_neither_memory_nor_state():
    process = psutil.Process(os.getpid())

    def load_once():
        layer = make_layer(rows=16384, cols=512)  # 16 MiB BF16
        CompactEmbeddingMethod(make_format("int8"), "embed").process_weights_after_loading(layer)
        return layer

    load_once()
    start = process.memory_info().rss
    for _ in range(20):
        load_once()
    growth = process.memory_info().rss - start
    assert growth < 48 << 20, f"RSS grew {growth >> 20} MiB over 20 loads"
    assert memory.pending() == 0


def test_register_many_times_is_harmless(monkeypatch):
    from vllm.model_executor.custom_op import op_registry_oot

    import vllm_embed_plugin
    from vllm_embed_plugin.layer import CompactParallelLMHead, CompactVocabParallelEmbedding

    monkeypatch.setenv("VLLM_EMBED_FORMAT", "int8")
    for _ in range(5):
        vllm_embed_plugin.register()
    assert op_registry_oot["VocabParallelEmbedding"] is CompactVocabParallelEmbedding
    assert op_registry_oot["ParallelLMHead"] is CompactParallelLMHead


def test_lossless_format_keeps_the_loaded_dtype():
    """`host` stores the table as loaded: a float32 table stays float32, bit for bit."""
    from vllm_embed_plugin.formats import HOST_FORMATS

    layer = make_layer()
    layer.weight.data = layer.weight.data.float() + 1e-7  # values bf16 cannot hold
    original = layer.weight.detach().clone()
    method = CompactEmbeddingMethod(HOST_FORMATS["host"], "test")
    method._quantize = lambda weight: (method.fmt.quantize(weight), None)  # no pinned memory here
    method.process_weights_after_loading(layer)
    assert layer.weight.dtype == torch.float32
    ids = torch.tensor([0, 3, 511])
    assert torch.equal(method.embedding(layer, ids), original[ids])


def test_a_long_conversion_logs_its_progress(monkeypatch, caplog):
    """Chunked conversion (here: 4 chunks of 128 rows) logs how far it is, at most once per
    PROGRESS_SECONDS; with the interval at 0 every chunk but the last says so."""
    import logging

    monkeypatch.setattr("vllm_embed_plugin.method.PROGRESS_SECONDS", 0.0)
    monkeypatch.setattr(
        "vllm_embed_plugin.convert.DEFAULT_SCRATCH_BYTES", 128 * 256 * SCRATCH_BYTES_PER_ELEMENT
    )
    method = CompactEmbeddingMethod(make_format("int6"), "model.embed_tokens")
    with caplog.at_level(logging.INFO, logger="vllm.embed_plugin"):
        method.process_weights_after_loading(make_layer(rows=512))
    lines = [r.getMessage() for r in caplog.records if "rows (" in r.getMessage()]
    assert lines == [
        f"vllm-embed-plugin: model.embed_tokens: converting to int6: {done} of 512 rows "
        f"({done / 5.12:.0f}%), {line.rsplit(', ', 1)[1]}"
        for done, line in zip((128, 256, 384), lines)
    ]


def test_a_quick_conversion_logs_no_progress(caplog):
    import logging

    method = CompactEmbeddingMethod(make_format("int6"), "model.embed_tokens")
    with caplog.at_level(logging.INFO, logger="vllm.embed_plugin"):
        method.process_weights_after_loading(make_layer(rows=512))
    assert not [r for r in caplog.records if "rows (" in r.getMessage()]


def test_untied_head_converts_like_the_embedding_and_computes_biased_logits():
    """An untied LM head (`role` "lm_head") goes through the same conversion; its logits come
    from the packed table, rows rounded jointly against a calibration file, plus the bias
    vLLM's logits processor passes. Padding rows (zero, as vLLM's loader leaves them) give
    zero logits."""
    from vllm_embed_plugin.convert import quantize_table
    from vllm_embed_plugin.formats import ColumnImportance

    layer = make_layer(rows=512, cols=256, seed=3)
    layer.weight.data[500:] = 0  # vLLM pads the vocabulary with zero rows
    original = layer.weight.detach().clone()
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(2048, 256, generator=g)
    hidden[:, 7] += 20  # a massive-activation column
    moment = hidden.T @ hidden / hidden.shape[0]
    fmt = make_format("int4", weighted=True)
    importance = ColumnImportance.from_second_moment(moment, joint=True)
    method = CompactEmbeddingMethod(
        fmt, "target LM head lm_head", role="lm_head", importance=importance
    )
    method.process_weights_after_loading(layer)
    assert layer.weight.dtype == torch.uint8 and method.importance is None
    expected = quantize_table(original, fmt, importance=importance)
    assert torch.equal(layer.weight, expected.codes)
    x = torch.randn(5, 256, generator=g).bfloat16()
    bias = torch.randn(512, generator=g).bfloat16()
    logits = method.apply(layer, x, bias)
    table = fmt.dequantize(expected, 256, torch.float32)
    reference = x.float() @ table.T + bias.float()
    assert logits.shape == (5, 512)
    torch.testing.assert_close(logits.float(), reference, rtol=2e-2, atol=2e-2)
    assert torch.equal(method.apply(layer, x)[:, 500:], torch.zeros(5, 12, dtype=logits.dtype))
    # Joint rounding against the hidden states beats rounding each row alone, in the logits.
    plain = fmt.dequantize(quantize_table(original, make_format("int4")), 256, torch.float32)
    exact = hidden @ original.float().T
    assert (hidden @ table.T - exact).square().mean() < 0.8 * (
        hidden @ plain.T - exact
    ).square().mean()


@pytest.mark.parametrize(
    "role, tag, tied, converted",
    [
        ("target", "backbone", False, True),
        ("draft", "draft_model", False, True),  # a separate draft model owns its head
        ("draft", "eagle_head", False, False),  # vLLM swaps it for the target's head
        ("target", "backbone", True, False),  # tied: the embedding's table decides
    ],
)
def test_which_heads_head_format_converts(monkeypatch, caplog, role, tag, tied, converted):
    """The head's decision by role: the target's and a separate draft model's untied heads are
    converted; an EAGLE/MTP drafter's own head is not (vLLM replaces it with the target's,
    converted, head); a tied head is left to its embedding, with a log line."""
    import logging
    import types

    from vllm.compilation import backends
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    from vllm_embed_plugin import layer as layer_module
    from vllm_embed_plugin.log import _said
    from vllm_embed_plugin.settings import Decision

    decision = Decision("m", "int8", None, "default format", head_format="int4")
    config = types.SimpleNamespace(additional_config={})
    where = f"{role} LM head lm_head"
    table = layer_module._Table(config, role, decision, tied, where)
    monkeypatch.setattr(layer_module, "_vocabulary_table", lambda layer, kind: table)
    monkeypatch.setattr(backends, "model_tag", tag)
    _said.clear()
    head = types.SimpleNamespace(
        quant_method=UnquantizedEmbeddingMethod(), embedding_dim=256, params_dtype=torch.bfloat16
    )
    with caplog.at_level(logging.INFO, logger="vllm.embed_plugin"):
        method = layer_module.choose_head_method(head)
    assert (method is not None) == converted
    if converted:
        assert method.role == "lm_head" and method.fmt.name == "int4" and method.label == where
        assert config.additional_config["vllm_embed_plugin"][where]["format"] == method.fmt_key
        method.cancel()
    logs = " ".join(r.getMessage() for r in caplog.records)
    if tied:
        assert "follows format='int8'; head_format='int4' is not used" in logs
    if tag == "eagle_head":
        assert "left as vLLM builds it" in logs
