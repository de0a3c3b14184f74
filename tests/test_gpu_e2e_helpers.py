"""The pure helpers of bench/gpu_e2e.py's mtp, selfdraft and host suites (the suites
themselves need a GPU)."""

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

_spec = importlib.util.spec_from_file_location(
    "gpu_e2e", Path(__file__).resolve().parents[1] / "bench" / "gpu_e2e.py"
)
gpu_e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_e2e)


def table(kind, **storages):
    return {"kind": kind, "storages": {n: list(s) for n, s in storages.items()}}


def test_shared_by_identity_wants_the_same_storage_not_equal_bytes():
    target = [
        table("embedding", weight=(1000, 64), weight_scales=(2000, 8)),
        table("lm_head", weight=(3000, 128)),
    ]
    shared = [table("embedding", weight=(1000, 64), weight_scales=(2000, 8))]
    assert gpu_e2e.shared_by_identity(target, shared) == {"embedding": True, "lm_head": None}
    # Same sizes (as a copy with equal bytes would have), other memory: not shared.
    copy = [
        table("embedding", weight=(5000, 64), weight_scales=(2000, 8)),
        table("lm_head", weight=(3000, 128)),
    ]
    assert gpu_e2e.shared_by_identity(target, copy) == {"embedding": False, "lm_head": True}


def test_unique_table_bytes_counts_a_shared_storage_once_and_host_tables_never():
    ready = {
        "workers": [
            {
                "target": {
                    "tables": [
                        table("embedding", weight=(1000, 64), weight_scales=(2000, 8)),
                        table("lm_head", weight=(3000, 128)),
                    ]
                },
                "draft": {
                    "tables": [
                        table("embedding", weight=(1000, 64), weight_scales=(2000, 8)),
                        table("lm_head", weight=(4000, 128)),
                    ]
                },
            }
        ]
    }
    assert gpu_e2e.unique_table_bytes(ready) == 64 + 8 + 128 + 128
    ready["workers"][0]["target"]["tables"][1]["on_host"] = True
    ready["workers"][0]["draft"] = None
    assert gpu_e2e.unique_table_bytes(ready) == 64 + 8


def test_acceptance_reads_what_spec_counters_records():
    """The counters go through spec_counters as vLLM reports them (names with the 'vllm:'
    prefix, a vector for the per-position counts), so the two helpers agree on the keys."""

    def llm(drafts: int, accepted: int, per_pos: list[int]):
        metrics = [
            SimpleNamespace(name="vllm:spec_decode_num_draft_tokens", value=drafts),
            SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=accepted),
            SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=per_pos),
            SimpleNamespace(name="vllm:num_requests_running", value=3),
        ]
        return SimpleNamespace(get_metrics=lambda: metrics)

    before = gpu_e2e.spec_counters(llm(30, 20, [9, 7, 4]))
    after = gpu_e2e.spec_counters(llm(330, 260, [99, 90, 71]))
    got = gpu_e2e.acceptance(before, after)
    assert got["draft_tokens"] == 300 and got["accepted_tokens"] == 240
    assert got["rate"] == pytest.approx(0.8)
    assert got["accepted_per_position"] == [90, 83, 67]
    assert gpu_e2e.acceptance({}, {})["rate"] is None


def test_the_dummy_qwen3_config_is_a_generating_model(tmp_path):
    path = gpu_e2e.dummy_qwen3(tmp_path / "q", 1024, 64, 128, heads=4)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]  # else vLLM starts a pooling engine
    assert config["tie_word_embeddings"] is False


def test_kv_gain_and_the_summary_table():
    off = {"init_s": 50.0, "table_bytes": 3000, "kv_bytes": 10_000, "decode_b1": [100.0, 110.0]}
    int8 = {
        "init_s": 51.0,
        "table_bytes": 2000,
        "kv_bytes": 10_990,
        "decode_b1": [104.5, 105.5],
        "shared": {"embedding": True, "lm_head": True},
        "acceptance": {"accepted_tokens": 94, "draft_tokens": 99, "rate": 94 / 99},
        "unknown_env_warnings": [],
    }
    assert gpu_e2e.kv_gain(off, int8) == pytest.approx(0.99)
    assert gpu_e2e.kv_gain(off, off) is None
    failed = {"error": "mtp-int4: engine exited (rc=1)"}
    lines = gpu_e2e.suite_table(
        "mtp", {"shape": [248320, 2048], "configs": {"off": off, "int8": int8, "int4": failed}}
    )
    text = "\n".join(lines)
    assert "## mtp 248,320 x 2,048" in text
    row = next(x for x in lines if x.startswith("| int8 |"))
    assert "99.0%" in row and "True / True" in row and "94/99 = 94.9%" in row
    assert "105 (1.000; 104-106)" in row  # median (ratio to off; slowest-fastest repeat)
    assert "| int4 | failed: mtp-int4: engine exited (rc=1) |" in lines


def test_the_spec_suite_is_a_table_with_the_kv_gain_over_both_models_bytes():
    """A separate draft model: the KV gain is over the bytes both models' tables free."""
    counters = {"spec_decode_num_draft_tokens": 360, "spec_decode_num_accepted_tokens": 0}
    off = dict(init_s=38.5, kv_tokens=100, kv_bytes=10_000, target_bytes=4000, draft_bytes=2000)
    int8 = dict(init_s=40.3, kv_tokens=130, kv_bytes=12_970, target_bytes=2000, draft_bytes=1000)
    int8["conversion_log"] = ["draft embedding draft_model.model.embed_tokens: ... -> int8"]
    int8["unknown_env_warnings"] = []
    out = {
        "env": {},
        "draft_model": {
            "formats": {"off": dict(off, spec=counters), "int8": dict(int8, spec=counters)}
        },
    }
    lines = gpu_e2e.summarize(out).splitlines()
    row = next(x for x in lines if x.startswith("| int8 |"))
    assert row == "| int8 | 40.3 | 2,000 | 1,000 | 130 | 99.0% | 0 / 360 | 0 |"
    assert "- int8: draft embedding draft_model.model.embed_tokens: ... -> int8" in lines


def test_the_summary_survives_a_bf16_engine_that_never_started():
    """The main suite's BF16 engine failing (too little memory for its share) left no baseline;
    the summary then crashed on it and hid the failure itself."""
    out = {
        "env": {},
        "untied": {"shape": [151936, 4096], "kv_bytes_per_token": 147456, "formats": {}},
        "failures": ["untied: untied-off: engine exited (rc=1)"],
    }
    text = gpu_e2e.summarize(out)
    assert "No finished BF16 engine" in text
    assert "- untied: untied-off: engine exited (rc=1)" in text


def test_engine_logs_have_names_every_file_transfer_keeps():
    """Engine names hold '+' and '=' (int8+head=int8); a log named so did not come back from
    the GPU machine, which hid why that engine failed."""
    path = gpu_e2e.log_file(Path("logs"), "untied-int8+head=int8")
    assert path == Path("logs") / "untied-int8_head_int8.log"


@pytest.mark.parametrize("target_too", [False, True])
def test_selfdraft_env_converts_the_drafter_alone_or_both(tmp_path, monkeypatch, target_too):
    from vllm_embed_plugin.settings import load_settings

    target = tmp_path / "smol"
    target.mkdir()
    draft = gpu_e2e.draft_alias(target)
    assert gpu_e2e.selfdraft_env("off", draft, target_too) == {}
    for key, value in gpu_e2e.selfdraft_env("int4", draft, target_too).items():
        monkeypatch.setenv(key, value)
    settings = load_settings()
    assert settings.decide(str(draft)).format == "int4"
    assert settings.decide(str(target)).format == ("int4" if target_too else "off")
