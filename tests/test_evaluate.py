"""The fidelity evaluation on a tiny random Llama (tied, small vocabulary) and a short text."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("gguf")

from vllm_embed_plugin.formats import IntFormat  # noqa: E402
from vllm_embed_plugin.tools import evaluate  # noqa: E402

TEXT = (
    "The licenses for most software and other practical works are designed to take away your "
    "freedom to share and change the works. By contrast, the license is intended to guarantee "
    "your freedom to share and change all versions of a program, to make sure it remains free "
    "software for all its users. When we speak of free software, we are referring to freedom, "
    "not price. "
) * 6


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A random 2-layer Llama with a tied ~200 x 64 table and a BPE tokenizer trained on TEXT."""
    path = tmp_path_factory.mktemp("tiny-llama")
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>"])
    bpe.train_from_iterator([TEXT], trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>"
    )
    tokenizer.save_pretrained(path)

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=bpe.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=1,
        initializer_range=0.1,
    )
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        # Wide enough for confident predictions (format errors show in the KLD), small enough
        # that the body does not amplify every input error into a different prediction.
        model.get_input_embeddings().weight.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return path


#: Two evaluation domains made of the same words in another order (the tiny tokenizer knows
#: only TEXT's pieces).
DOMAINS = {"plain": TEXT, "reversed": " ".join(reversed(TEXT.split()))}


def tiny_eval_args(model, corpus, out, *extra: str) -> list[str]:
    """`eval` arguments for the tiny model: two windows of 32 tokens, no progress bars."""
    return ["--model", str(model), "--corpus", str(corpus), *extra, "--window", "32",
            "--windows", "2", "--out", str(out), "--no-progress"]  # fmt: skip


@pytest.fixture(scope="module")
def run(tiny_model):
    torch.set_num_threads(2)
    return evaluate.FidelityRun(
        tiny_model,
        DOMAINS,
        window=32,
        windows=2,
        calibration=TEXT,
        calibration_window=32,
        calibration_positions=64,
        progress=False,
    )


def test_windows_domains_and_importance(run):
    assert run.tied and len(run.windows) == 4 and all(len(w) == 32 for w in run.windows)
    assert run.window_domain == ["plain", "plain", "reversed", "reversed"]
    assert run.positions == 128 and run.calibration_positions == 64
    assert run.windows_of("reversed") == [(64, 96), (96, 128)]
    m, s = run.measured.second_moment, run.measured.input_fisher
    assert m.shape == (64, 64) and bool((m.diagonal() > 0).all())
    # A tied model: the lookup's Fisher information is measured beside M.
    assert s.shape == (64, 64) and bool((s.diagonal() > 0).all())


def test_spread_is_over_windows_and_domains_are_apart():
    kld = torch.tensor([1.0, 3.0, 2.0, 2.0, 10.0, 30.0])
    agree = torch.tensor([True, False, True, True, True, True])
    stats = evaluate.mode_stats(kld, agree, [(0, 2), (2, 4)])
    assert stats.kld_mean == pytest.approx(2.0) and stats.window_klds == (2.0, 2.0)
    assert stats.spread == (2.0, 2.0) and stats.kld_std == 0 and stats.top1 == pytest.approx(0.75)
    both = evaluate.mode_stats(kld, agree, [(0, 2), (4, 6)])
    assert both.window_klds == (2.0, 20.0) and both.spread == (2.0, 20.0)
    assert both.kld_mean == pytest.approx(11.0) and both.kld_std == pytest.approx(12.7279, rel=1e-4)


def test_each_domain_has_its_own_figures(run):
    r = run.evaluate(evaluate.plugin_row(IntFormat("int4", 4, 32), run.cols))
    assert set(r.domains) == {"plain", "reversed"}
    for mode in ("input", "tied"):
        parts = [r.domain(d, mode) for d in ("plain", "reversed")]
        assert all(len(p.window_klds) == 2 for p in parts)
        # The whole is the mean of its (equal-sized) domains.
        assert getattr(r, mode).kld_mean == pytest.approx(
            sum(p.kld_mean for p in parts) / 2, rel=1e-5
        )
        assert getattr(r, mode).window_klds == parts[0].window_klds + parts[1].window_klds


def test_identity_is_exactly_zero(run):
    r = run.evaluate(evaluate.identity_row(run.cols))
    for mode in (r.input, r.tied):
        assert mode.kld_mean == 0 and mode.kld_p99 == 0 and mode.top1 == 1


def test_kld_grows_as_bits_shrink(run):
    int8 = run.evaluate(evaluate.plugin_row(IntFormat("int8", 8, 32), run.cols))
    int4 = run.evaluate(evaluate.plugin_row(IntFormat("int4", 4, 32), run.cols))
    q8 = run.evaluate(evaluate.llama_cpp_row("Q8_0", run.cols, shift=evaluate.SHIFT))
    assert 0 < int8.tied.kld_mean < 1e-3 and 0 < q8.tied.kld_mean < 1e-3
    assert int8.input.kld_mean <= int8.tied.kld_mean * 1.5
    assert int4.tied.kld_mean > 10 * int8.tied.kld_mean
    assert int4.tied.kld_p99 >= int4.tied.kld_mean
    assert int4.tied.top1 <= int8.tied.top1


def test_importance_weighted_fit_and_outlier_rows_run(run):
    base = IntFormat("int4", 4, 64, search=2)
    plain = run.evaluate(evaluate.plugin_row(base, run.cols))
    outliers = evaluate.outlier_row(base, 0.25, run.cols, weighted=True)
    assert outliers.bpw == pytest.approx(4.25 + 0.25 * (8.5 - 4.25 + 0.5))
    assert run.evaluate(outliers).tied.kld_mean < plain.tied.kld_mean


def test_k_quants_need_rows_of_256(run):
    row = evaluate.llama_cpp_row("Q4_K", run.cols)
    assert row.roundtrip is None and run.evaluate(row).tied is None


def test_main_writes_markdown_with_command(tiny_model, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    out = tmp_path / "docs" / "FIDELITY.md"
    argv = tiny_eval_args(tiny_model, corpus, out, "--grid", "quick")
    assert evaluate.main(argv, prog="vllm-embed-plugin eval") == 0
    text = out.read_text()
    assert "vllm-embed-plugin eval --model " + str(tiny_model) in text
    assert "| format | bpw | input KLD mean | input KLD p99 | input top-1 | tied KLD mean" in text
    assert "| format | bpw | corpus, tied | corpus, input |" in text
    assert "8-bit class" in text and "4-bit class" in text
    assert "| identity (check) | 16.00 | 0 | 0 | 100.00% | 0 | 0 | 100.00% |" in text
    assert "| identity (check) | 16.00 | 0 (0–0) | 0 (0–0) |" in text


def test_user_corpus_against_their_own_calibration_file(tiny_model, tmp_path):
    """`eval --corpus FILE --importance FILE`: the user's text and the user's M; the plugin
    rows and the targets table are built from them."""
    from vllm_embed_plugin import importance
    from vllm_embed_plugin.tools import calibrate

    mine = tmp_path / "mine.txt"
    mine.write_text(" ".join(reversed(TEXT.split())))
    m = calibrate.second_moment(torch.randn(256, 64) + 3 * torch.randn(64))
    calibration = importance.save(tmp_path / "m.safetensors", m, {"cols": 64})
    out = tmp_path / "FIDELITY.md"
    argv = tiny_eval_args(tiny_model, mine, out, "--importance", str(calibration))
    assert evaluate.main(argv) == 0
    text = out.read_text()
    assert (
        f"the calibration file `{calibration}`" in text
        and "column importance read from the file" in text
    )
    assert "| target | mine |" in text
    assert "| `int4` + file, tied <= 0.6x llama.cpp Q4_0 (tied KLD) | " in text


@pytest.mark.parametrize("flag", ["--corpus", "--importance"])
def test_a_missing_file_is_one_line(tiny_model, tmp_path, capsys, flag):
    argv = ["--model", str(tiny_model), flag, str(tmp_path / "nope.txt")]
    with pytest.raises(SystemExit) as exc:
        evaluate.main(argv)
    assert exc.value.code == 2
    assert capsys.readouterr().err == f"error: {flag} {tmp_path / 'nope.txt'}: no such file\n"


def test_packaged_texts_cover_the_domains_and_stay_apart():
    from vllm_embed_plugin.tools import calibrate

    domains = evaluate.packaged_domains()
    assert list(domains) == ["code", "prose", "chat", "de", "ru"]
    assert "def " in domains["code"] and "Assistant:" in domains["chat"]
    # Two languages beside English, one in a non-Latin script.
    assert "Sicherung" in domains["de"] and "река" in domains["ru"]
    assert (
        sum("\u0400" <= c <= "\u04ff" for c in domains["ru"]) > 0.6 * len(domains["ru"].split()) * 4
    )
    calibration = calibrate.default_corpus().read_text(encoding="utf-8")
    # Prose, code (Python and others), chat in several languages.
    for sample in (
        "GNU General Public License",
        "def ",
        "#include",
        "Assistant:",
        "¿",
        "你好",
        "Привет",
    ):
        assert sample in calibration
    # No evaluation line longer than a stock phrase appears in the calibration corpus.
    seen = {line.strip() for line in calibration.splitlines() if len(line.strip()) > 30}
    for text in domains.values():
        assert not seen & {line.strip() for line in text.splitlines()}
    # The packaged texts stay small (the calibration files beside them: test_real_models).
    data = calibrate.default_corpus().parent
    texts = [p for p in data.rglob("*") if p.is_file() and p.suffix != ".safetensors"]
    assert sum(p.stat().st_size for p in texts) < 200_000


def test_degrid_moves_values_off_the_q8_0_grid_by_at_most_half_a_step():
    gguf = pytest.importorskip("gguf")
    import numpy as np

    x = torch.randn(64, 128) * 0.05
    on_grid = (
        torch.from_numpy(
            gguf.quants.dequantize(
                gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q8_0),
                gguf.GGMLQuantizationType.Q8_0,
            ).copy()
        )
        .reshape(x.shape)
        .bfloat16()
        .float()
    )
    moved = evaluate.degrid(on_grid)
    assert torch.equal(moved, moved.bfloat16().float())
    half_step = on_grid.view(64, 4, 32).abs().amax(-1, keepdim=True) / 254
    delta = (moved - on_grid).view(64, 4, 32).abs()
    assert bool((delta <= half_step * 1.01 + moved.view(64, 4, 32).abs() / 256).all())
    # Large values keep their BF16 value when the noise is below half a BF16 ulp.
    assert (moved != on_grid).float().mean() > 0.5
    assert not np.shares_memory(moved.numpy(), on_grid.numpy())


def test_grids_build_for_any_row_length():
    for name in ("quick", "anchors", "full", "8bit", "plugin"):
        rows = evaluate.grid(name, 640)
        assert rows and all(r.bpw is None or r.bpw <= 16 for r in rows)
    assert {r.label for r in evaluate.grid("anchors", 640) if r.roundtrip is None} == {
        "llama.cpp Q6_K",
        "llama.cpp Q5_K",
        "llama.cpp Q4_K",
    }


def test_head_rows_keep_the_lookup_exact_and_render_their_targets(run):
    """The head-only column (an untied LM head, `head_format`): the hidden states are the
    reference's, only the logits read the lossy copy; its section renders the head targets."""
    from vllm_embed_plugin.tools.fidelity_report import ModelReport, Section, render_markdown

    identity = run.evaluate_head(evaluate.identity_row(run.cols))
    assert identity.head.kld_mean == 0 and identity.head.top1 == 1 and identity.tied is None
    int4 = evaluate.plugin_row(IntFormat("int4", 4, 32), run.cols)
    head = run.evaluate_head(int4).head
    # The same lossy table as input and head (tied) moves the logits more than as head alone.
    assert 0 < head.kld_mean < run.evaluate(int4).tied.kld_mean
    rows = evaluate.grid("head", run.cols)
    assert {r.key for r in rows} >= {"int8+head", "int5+head", "int4+head", "Q8_0 shifted"}
    results = [run.evaluate_head(r) for r in rows]
    section = Section("Untied LM head", results, run.positions, {"plain": 2, "reversed": 2}, 32,
                      64, False, 1.0, head=True)  # fmt: skip
    report = ModelReport("tiny", "tiny", run.rows, run.cols, True, [section])
    text = render_markdown([report], command="eval", corpus="tiny", shift=evaluate.SHIFT)
    assert "| format | bpw | plain | reversed | all: KLD mean | KLD p99 | top-1 |" in text
    assert "`int8` + file, head <= 0.9x llama.cpp Q8_0, blocks shifted 16 (head KLD)" in text
    assert "*llama.cpp Q6_K* | n/a (rows of 64 are not a multiple of 256)" in text


def test_every_flag_has_help_and_the_default_report_stays_out_of_docs():
    parser = evaluate.build_parser("vllm-embed-plugin eval")
    for action in parser._actions:
        assert action.help, action.option_strings
    out = parser.parse_args(["--model", "m"]).out
    assert out == evaluate.DEFAULT_OUT and not out.is_absolute() and out.parts == (out.name,)
    assert "current directory" in " ".join(parser.format_help().split())


def test_two_corpus_files_with_one_stem_are_a_clear_error(tiny_model, tmp_path):
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "chat.txt").write_text(TEXT)
    a, b = tmp_path / "a" / "chat.txt", tmp_path / "b" / "chat.txt"
    with pytest.raises(evaluate.ToolError, match=f"--corpus {a} and {b} would both be domain"):
        evaluate.main(tiny_eval_args(tiny_model, a, tmp_path / "r.md", "--corpus", str(b)))
    assert not (tmp_path / "r.md").exists()


def test_skip_leaves_rows_out_by_key_or_label():
    rows = evaluate.grid("plugin", 64)
    kept = [r.key for r in rows if evaluate.selected(r, None, ["int8", "fp8", "Q5_*"])]
    assert "int8" not in kept and "int8+tied" in kept and "fp8" not in kept
    assert "Q5_1" not in kept and "Q4_0" in kept and "Q8_0 shifted" in kept
    full = evaluate.grid("full", 64)
    kept = [r.label for r in full if evaluate.selected(r, None, ["outlier rows", "llama.cpp"])]
    assert kept and not any("outlier" in k or "llama.cpp" in k for k in kept)
    assert [r.label for r in full if evaluate.selected(r, "int6", [])] == ["int6 sym row"]


def test_report_rounds_honestly_and_shortens_home(tiny_model, tmp_path, monkeypatch):
    from vllm_embed_plugin.tools import fidelity_report

    assert fidelity_report.verdict(0.42, 0.6) == "0.42x, met"
    assert fidelity_report.verdict(1.004, 1.0) == "1.004x, **missed by < 1%**"
    assert fidelity_report.verdict(0.9049, 0.9) == "0.905x, **missed by < 1%**"
    assert fidelity_report.verdict(1.08, 0.9) == "1.08x, **missed by 20%**"
    assert fidelity_report.verdict(0.9, 0.9) == "0.90x, met"
    monkeypatch.setenv("HOME", str(tmp_path))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    out = tmp_path / "r.md"
    assert evaluate.main(tiny_eval_args(tiny_model, corpus, out, "--grid", "quick")) == 0
    text = out.read_text()
    assert "`~/corpus.txt`" in text and f"--out {tmp_path}" not in text and "--out ~/r.md" in text


def test_lookup_target_compares_the_input_kld_with_the_spread():
    from vllm_embed_plugin.tools.fidelity_report import lookup_verdict

    plain = evaluate.ModeStats(1.0e-4, 0, 1, (0.8e-4, 1.3e-4))
    assert lookup_verdict(evaluate.ModeStats(1.4e-4, 0, 1), plain).endswith(", met")
    assert lookup_verdict(evaluate.ModeStats(1.9e-4, 0, 1), plain).startswith("1.90x plain")
    assert "**missed**" in lookup_verdict(evaluate.ModeStats(1.9e-4, 0, 1), plain)
