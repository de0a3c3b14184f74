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
    assert "use it" in recommendation("int8", same, tied=True)
    assert "calibration file" in recommendation("int4", moved, tied=True)
    assert "GROUP_SIZE=32" in recommendation("int4", moved, tied=False)


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
