import json

import pytest

from tests.checkpoints import write_checkpoint
from vllm_embed_plugin.formats import make_format
from vllm_embed_plugin.tools.cli import main


def test_check_prints_decisions_with_the_plugins_settings(monkeypatch, capsys):
    monkeypatch.setenv("VLLM_EMBED_FORMAT", "int8")
    monkeypatch.setenv("VLLM_EMBED_MODELS", "Qwen/*")
    assert main(["check", "Qwen/Qwen3-8B", "meta/llama"]) == 0
    out = capsys.readouterr().out
    assert "model 'Qwen/Qwen3-8B': int8 (default format)" in out
    assert "model 'meta/llama': not in allowlist, untouched" in out


def test_check_reports_the_head_by_role(tmp_path, monkeypatch, capsys):
    untied = write_checkpoint(tmp_path / "untied", vocab=4096, hidden=128, layers=1)
    tied = write_checkpoint(tmp_path / "tied", vocab=4096, hidden=128, layers=1, tied=True)
    monkeypatch.setenv("VLLM_EMBED_HEAD_FORMAT", "int5")
    assert main(["check", str(untied), str(tied)]) == 0
    out = capsys.readouterr().out
    assert f"model '{untied}': embedding off, untied LM head int5 (default format)" in out
    assert "  LM head: untied, converted to 'int5' (head_format)" in out
    assert "  LM head: tied to the embedding, so it follows format='off'" in out


def test_check_reports_bad_settings_and_fails(monkeypatch, capsys):
    monkeypatch.setenv("VLLM_EMBED_FORMAT", "int3")
    assert main(["check"]) == 2
    assert "VLLM_EMBED_FORMAT='int3'" in capsys.readouterr().err


def test_plan_uses_the_models_kv_layout(tmp_path, capsys):
    config = {
        "vocab_size": 151936,
        "hidden_size": 4096,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["plan", str(tmp_path), "--max-model-len", "8192"]) == 0
    out = capsys.readouterr().out
    kv_per_token = 2 * 36 * 8 * 128 * 2  # K and V, layers, KV heads, head size, BF16
    assert f"{kv_per_token} bytes per token" in out
    freed = 151936 * 4096 * 2 - make_format("int8").nbytes(151936, 4096)
    line = next(x for x in out.splitlines() if x.startswith("int8 "))
    assert f"{freed // kv_per_token:,}" in line
    # Untied: with head_format the head's bytes count too.
    both = next(x for x in out.splitlines() if x.startswith("int8+head "))
    assert f"{2 * freed // kv_per_token:,}" in both and f"{2 * freed / (1 << 30):.3f}" in both
    # No GPU here, no --gpu-memory-gib: the share is of a 24 GiB card, and it says so.
    assert "GPU memory: 24.0 GiB (no GPU here: a 24 GiB card; set --gpu-memory-gib)" in out
    assert f"{100 * freed / (24 << 30):.1f}%" in line
    assert main(["plan", str(tmp_path), "--gpu-memory-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "GPU memory: 80.0 GiB (--gpu-memory-gib)" in out
    line = next(x for x in out.splitlines() if x.startswith("int8 "))
    assert f"{100 * freed / (80 << 30):.1f}%" in line


def test_plan_reads_a_written_checkpoint(tmp_path, capsys):
    path = write_checkpoint(tmp_path / "m", vocab=4096, hidden=128, layers=1, tied=True)
    assert main(["plan", str(path / "config.json")]) == 0
    assert "tied (one table serves both)" in capsys.readouterr().out


def test_version(capsys):
    import vllm_embed_plugin

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"vllm-embed-plugin {vllm_embed_plugin.__version__}"


def test_check_prints_the_vllm_found_and_the_entry_point(monkeypatch, capsys):
    import vllm

    monkeypatch.setenv("VLLM_EMBED_FORMAT", "int8")
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    assert f"vllm: {vllm.__version__} (distribution vllm" in out
    assert f"vLLM {vllm.__version__}: supported" in out and "the plugin can act on it" in out
    assert (
        "entry point: vllm.general_plugins embed = vllm_embed_plugin:register (vllm-embed-plugin"
        in out
    )
    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    monkeypatch.setenv("VLLM_EMBED_UNTESTED_VLLM", "off")
    monkeypatch.setenv("VLLM_PLUGINS", "other")
    assert main(["check"]) == 0
    out = capsys.readouterr().out
    assert "vLLM 0.99.0 is newer than the newest release the plugin was tested on" in out
    assert "VLLM_EMBED_UNTESTED_VLLM=off: the plugin stays inactive" in out
    assert "VLLM_PLUGINS='other' does not name 'embed': vLLM will not load this plugin" in out


def test_calibrate_names_a_missing_corpus_in_one_line(tmp_path, capsys):
    from vllm_embed_plugin.tools.cli import main

    missing = tmp_path / "nope.txt"
    assert main(["calibrate", "smollm2", "--corpus", str(missing)]) == 2
    assert capsys.readouterr().err == f"error: --corpus {missing}: no such file\n"


def test_eval_names_a_missing_corpus_in_one_line(tmp_path, capsys):
    from vllm_embed_plugin.tools.cli import main

    missing = tmp_path / "nope.txt"
    with pytest.raises(SystemExit) as exc:
        main(["eval", "--model", "smollm2", "--corpus", str(missing)])
    assert exc.value.code == 2
    assert capsys.readouterr().err == f"error: --corpus {missing}: no such file\n"


def test_plan_names_a_missing_model_in_one_line(tmp_path, capsys):
    from vllm_embed_plugin.tools.cli import main

    missing = tmp_path / "no-model"
    assert main(["plan", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {missing}: no config.json (give a model directory or a config.json)\n"


@pytest.mark.parametrize("command", ["calibrate", "eval --model", "demo --model"])
def test_a_mistyped_model_path_is_one_line(command, tmp_path, capsys):
    """Neither a directory nor a real model's name: one line naming it and what would do."""
    from vllm_embed_plugin.tools.cli import main

    missing = tmp_path / "mistyped"
    assert main([*command.split(), str(missing)]) == 2
    captured = capsys.readouterr()
    assert captured.err == (
        f"error: {missing}: no such checkpoint directory, and not a real model name "
        "(smollm2, gemma3-270m)\n"
    )
    assert captured.out == ""


def test_an_unknown_real_model_is_one_line(capsys):
    from vllm_embed_plugin.tools.cli import main

    assert main(["prepare-model", "smollm3"]) == 2
    assert (
        capsys.readouterr().err
        == "error: unknown real model 'smollm3'; known: smollm2, gemma3-270m\n"
    )


def test_plan_takes_vllms_kv_cache_dtype_names(tmp_path, capsys):
    import json

    from vllm_embed_plugin.tools.cli import main

    config = {
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "vocab_size": 8192,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    per_token = {}
    for dtype in ("auto", "fp8_e4m3"):
        assert main(["plan", str(tmp_path), "--kv-cache-dtype", dtype]) == 0
        out = capsys.readouterr().out
        per_token[dtype] = int(out.split("KV cache: ")[1].split(" bytes")[0])
    assert per_token == {"auto": 2 * 2 * 2 * 64 * 2, "fp8_e4m3": 2 * 2 * 2 * 64 * 1}


def test_demo_quality_figures_from_top_k_logprobs():
    import math

    from vllm_embed_plugin.tools.demo import recommendation
    from vllm_embed_plugin.tools.probe import compare_scores

    ref = [[[1, math.log(0.7)], [2, math.log(0.2)]], [[5, math.log(0.9)], [6, math.log(0.05)]]]
    same = compare_scores(ref, ref)
    assert same == {"positions": 2, "top1_agreement": 1.0, "mean_kl": 0.0}
    # Position 2's top token changes: agreement halves and the KL is the coarse KL there.
    other = [ref[0], [[6, math.log(0.6)], [5, math.log(0.3)]]]
    moved = compare_scores(ref, other)
    expected = 0.9 * math.log(0.9 / 0.3) + 0.05 * math.log(0.05 / 0.6) + 0.05 * math.log(0.05 / 0.1)
    assert moved["top1_agreement"] == 0.5
    assert math.isclose(moved["mean_kl"], expected / 2)
    # A tied model is judged by the format with its calibration file.
    tied = recommendation("int8", {"int8": moved, "int8 + file": same}, True, "m.safetensors")
    assert "int8 with a calibration file keeps this model's predictions" in tied
    assert "VLLM_EMBED_FORMAT=int8 VLLM_EMBED_IMPORTANCE=m.safetensors" in tied
    assert "Without the file int8 same next token 50.0%, 48.0 points short of 98%" in tied
    missed = recommendation("int4", {"int4": moved, "int4 + file": moved}, True, "m.safetensors")
    assert missed.startswith("Recommendation: int4 + file does NOT clear the bar: ")
    assert f"mean KL {expected / 2:.2e}, {expected / 2 / 1e-3:.1f}x the 1e-03 bar" in missed
    assert "GROUP_SIZE=32" in recommendation("int4", {"int4": moved}, False, None)


def _demo_run(vocab_bytes, kv_tokens, answers, scored):
    """A probe result as the demo reads it; `answers`: per prompt, [(token, text, logprob,
    [(other token, text, logprob), ...]), ...]."""
    return {
        "texts": ["".join(step[1] for step in answer) for answer in answers],
        "tokens": [[step[0] for step in answer] for answer in answers],
        "steps": [
            [
                sorted([[t, lp, x], *[[o, olp, ox] for o, ox, olp in rest]], key=lambda e: -e[1])
                for t, x, lp, rest in answer
            ]
            for answer in answers
        ],
        "workers": [{"target": {"vocab_bytes": vocab_bytes}}],
        "kv_cache_tokens": kv_tokens,
        "scored": scored,
    }


def test_demo_report_shows_each_run_the_bytes_freed_and_where_answers_part():
    """The demo's printout from three runs: quality over the same positions, the KV tokens the
    freed bytes buy at the model's own KV bytes per token (not vLLM's CPU figure), and for
    each answer that parts from BF16's the token and BF16's logprob gap there."""
    import math
    import re
    from pathlib import Path

    from vllm_embed_plugin.tools import demo
    from vllm_embed_plugin.tools.plan import kv_layout

    # SmolLM2's KV layout, derived from its config: 30 x 2 x 3 x 64 x 2 bytes.
    config = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3}
    layout = kv_layout(config | {"hidden_size": 576, "torch_dtype": "bfloat16"})
    assert layout.bytes_per_token == 23040
    n = len(demo.PROMPTS)
    same = [[(7, "Paris", -0.1, [(8, " Lyon", -3.0)])]] * n
    near_tie = [(9, "The", -1.72, [(10, "L", -1.97)]), (7, " capital", -0.2, [])]
    parted = [(10, "L", -0.5, [(9, "The", -0.9)]), (11, "'", -0.3, [])]
    far = [(9, "The", -0.01, [(12, "A", -6.5)])]
    away = [(13, "Zut", -0.2, [])]
    scored = [[[5, math.log(0.9)], [6, math.log(0.05)]]] * 200
    worse = [[[6, math.log(0.6)], [5, math.log(0.3)]]] * 5 + scored[5:]
    runs = {
        "off": _demo_run(56_623_104, 224_256, [near_tie, far, *same[2:]], scored),
        "int8": _demo_run(29_196_288, 229_888, [parted, away, *same[2:]], worse),
        "int8 + file": _demo_run(29_196_288, 229_760, [near_tie, far, *same[2:]], scored),
    }
    out = demo.report(Path("smollm2"), True, layout, runs, "int8", Path("s.safetensors"), "here")
    assert "23,040 bytes per token (30 layers x 2 (K and V) x 3 KV heads x 64 x 2 B)" in out
    assert "against BF16 over the same 200 positions" in out
    assert re.search(r"int8 +97\.5% +\S+\n  int8 \+ file +100\.0% +0\.00e\+00", out)
    # The gain credited to the format: bytes freed / KV bytes per token, within 1%.
    freed = 56_623_104 - 29_196_288
    memory = out.split("\nmemory:")[1]
    row = next(x for x in memory.splitlines() if x.strip().startswith("int8 + file ")).split()
    credited, vllm_change = int(row[-3].replace(",", "")), row[-1]
    assert int(row[-4].replace(",", "")) == freed
    assert abs(credited - freed / 23040) <= 0.01 * freed / 23040
    assert vllm_change == "(+5,504)" and "share of RAM minus the worker's resident" in out
    assert "int8          6 of 8 the same" in out and "int8 + file   8 of 8 the same" in out
    assert (
        "int8          token 1: 'L' where BF16 chose 'The' (BF16 logprobs -1.72 and -1.97: "
        "a gap of 0.25 nats)"
    ) in out
    # A token below BF16's top logprobs: the gap is at least down to the lowest one shown.
    assert "token 1: 'Zut' where BF16 chose 'The' (BF16: -0.01 against below -6.50" in out
    assert out.splitlines()[-1].startswith(
        "Recommendation: int8 with a calibration file keeps this model's predictions"
    )


def test_demo_prompts_are_not_calibration_text():
    from vllm_embed_plugin.tools import calibrate, demo

    corpus = calibrate.default_corpus().read_text(encoding="utf-8")
    assert len(demo.PROMPTS) >= 6 and not [p for p in demo.PROMPTS if p in corpus]


def test_demo_names_where_its_calibration_file_was_measured(tmp_path):
    """The shipped file was measured on the calibration corpus; a file measured on the
    evaluation text is called out (its figures would flatter it)."""
    import hashlib

    import torch

    from vllm_embed_plugin import importance
    from vllm_embed_plugin.tools import demo
    from vllm_embed_plugin.tools.evaluate import HELDOUT_FILES
    from vllm_embed_plugin.tools.real_models import packaged_importance

    shipped = demo.provenance(packaged_importance("smollm2"))
    assert shipped.endswith(
        "positions of the packaged calibration corpus, which shares no text "
        "with the evaluation text"
    )
    digest = hashlib.sha256(HELDOUT_FILES[0].read_bytes()).hexdigest()
    bad = importance.save(
        tmp_path / "bad.safetensors", torch.eye(4), {"positions": 9, "corpus_sha256": digest}
    )
    assert "THE EVALUATION TEXT ITSELF" in demo.provenance(bad)


def test_every_flag_of_every_subcommand_has_help():
    import argparse

    from vllm_embed_plugin.tools.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in sub.choices.items():
        for action in command._actions:
            if name not in ("eval", "demo"):  # their own parsers (test_evaluate) read all
                assert action.help, (name, action.option_strings or action.dest)
    positions = next(a for a in sub.choices["calibrate"]._actions if a.dest == "positions")
    assert "a cap" in positions.help and "the count measured is printed" in positions.help


def test_calibrate_flags_belong_to_their_engine(capsys):
    from vllm_embed_plugin.tools.cli import main

    assert main(["calibrate", "no-such-model", "--engine", "vllm", "--device", "cuda"]) == 2
    assert "--device and --threads belong to --engine transformers" in capsys.readouterr().err
    assert main(["calibrate", "no-such-model", "-tp", "2"]) == 2
    assert "belong to --engine vllm" in capsys.readouterr().err
