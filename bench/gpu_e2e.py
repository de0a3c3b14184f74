#!/usr/bin/env python3
"""End to end on a GPU: real vLLM (CUDA build) with its defaults -- torch.compile and CUDA
graphs on, no enforce_eager -- plugin off and on, in the same run.

    python bench/gpu_e2e.py --suite main --out OUT          # untied + tied models, throughput
    python bench/gpu_e2e.py --suite spec --out OUT          # a separate draft model
    python bench/gpu_e2e.py --suite mtp --quick             # MTP drafter sharing the table
    python bench/gpu_e2e.py --suite selfdraft --quick       # draft = target: acceptance
    python bench/gpu_e2e.py --suite host --quick            # host formats under CUDA graphs
    python bench/gpu_e2e.py --suite eagle                   # EAGLE-3 dummy head (optional)
    python bench/gpu_e2e.py --suite mtp --quick --mtp-head-format int8   # ... head on too
    python bench/gpu_e2e.py --suite main --only untied --formats off,int8,int8+head=int8
    python bench/gpu_e2e.py --suite main --quick            # tiny shapes, about 8 minutes
    python bench/gpu_e2e.py ... --tensor-parallel-size 2    # every engine on 2 GPUs

Random-weight checkpoints are written with transformers (initializer range 0.02, so logits
have structure and greedy agreement means something). Each configuration is one engine in a
child process of its own; the children of a model stay up together, so the timed runs of
plugin off and on are interleaved and repeated (median and spread reported), each after a
warm-up at the same batch. Engines start one after the other, so vLLM's memory profiling of
one never sees another's start.

What is measured per engine: vocabulary-table bytes in GPU memory (inside the worker),
vLLM's KV-cache size in tokens, start-up time, greedy agreement with BF16 (8 prompts x 16
tokens, the top-5 criterion of the CPU tests), decode tokens/s at batch 1 and 64, prefill
tokens/s for an 8k-token prompt. Results go to OUT/gpu_e2e.json and a Markdown summary to
OUT/gpu_e2e.md. Needs vLLM's CUDA build (and this package installed beside it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

# Offline and quiet; NVLink multicast off as the device's notes ask.
BASE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "NCCL_NVLS_ENABLE": "0",
    "PYTHONUNBUFFERED": "1",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
}

GREEDY_PROMPTS = 8
GREEDY_TOKENS = 16


# -- models ----------------------------------------------------------------------------------


def model_specs(quick: bool) -> dict[str, dict]:
    """name -> transformers config arguments (Qwen3 architecture)."""
    if quick:
        return {
            "untied": dict(vocab=32768, hidden=512, layers=2, tied=False, heads=8, kv_heads=4),
            "tied": dict(vocab=65536, hidden=256, layers=2, tied=True, heads=4, kv_heads=2),
            "spec-target": dict(vocab=32768, hidden=512, layers=2, tied=False, heads=8, kv_heads=4),
            "spec-draft": dict(vocab=32768, hidden=256, layers=1, tied=False, heads=4, kv_heads=2),
        }
    return {
        # Qwen3-8B's shape (151,936 x 4,096 table, 36 layers): a decode step takes milliseconds.
        "untied": dict(
            vocab=151936,
            hidden=4096,
            layers=36,
            tied=False,
            intermediate=12288,
            heads=32,
            kv_heads=8,
        ),
        # Gemma 3's table shape (262,144 x 2,560), tied, on Qwen3 layers.
        "tied": dict(
            vocab=262144, hidden=2560, layers=12, tied=True, intermediate=9728, heads=20, kv_heads=4
        ),
        "spec-target": dict(vocab=151936, hidden=2048, layers=8, tied=False),
        "spec-draft": dict(vocab=151936, hidden=1024, layers=1, tied=False),
    }


def build_model(root: Path, name: str, spec: dict) -> Path:
    """A random Qwen3 checkpoint plus a word-level tokenizer (written once)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config

    path = root / name
    if (path / "config.json").exists():
        return path
    vocab = spec["vocab"]
    hidden = spec["hidden"]
    heads = spec.get("heads", 16)
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=spec.get("intermediate", 3 * hidden),
        num_hidden_layers=spec["layers"],
        num_attention_heads=heads,
        num_key_value_heads=spec.get("kv_heads", 8),
        head_dim=128 if hidden >= 2048 else hidden // heads,
        max_position_embeddings=16384,
        tie_word_embeddings=spec["tied"],
        initializer_range=0.02,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(1234)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model
    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<unk>",
    ).save_pretrained(path)
    return path


def kv_bytes_per_token(path: Path) -> int:
    config = json.loads((path / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2


# -- one engine, in its own process ------------------------------------------------------------


def child(cfg: dict) -> None:
    """Start one engine, report it, then serve timing requests from stdin (JSON lines)."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_embed_plugin.tools.introspect import worker_report

    started = time.perf_counter()
    kwargs = dict(
        model=cfg["model"],
        dtype="bfloat16",
        seed=0,
        skip_tokenizer_init=True,
        gpu_memory_utilization=cfg["gpu_util"],
        max_model_len=cfg["max_model_len"],
        max_num_seqs=cfg["max_num_seqs"],
        enable_prefix_caching=False,
        tensor_parallel_size=cfg["tp"],
        disable_log_stats=False,
    )
    if cfg.get("attention"):
        kwargs["attention_config"] = {"backend": cfg["attention"]}
    if cfg.get("speculative"):
        kwargs["speculative_config"] = cfg["speculative"]
    if cfg.get("hf_overrides"):
        kwargs["hf_overrides"] = cfg["hf_overrides"]
    if cfg.get("load_format"):
        kwargs["load_format"] = cfg["load_format"]
    kwargs.update(cfg.get("engine_args") or {})
    llm = LLM(**kwargs)
    cache = llm.llm_engine.vllm_config.cache_config
    report = llm.collective_rpc(worker_report)
    try:
        kv_bytes = llm.collective_rpc(kv_cache_bytes)[0]
    except Exception:  # noqa: BLE001 - a report, never a failure
        kv_bytes = None
    emit(
        {
            "event": "ready",
            "init_s": time.perf_counter() - started,
            "kv_tokens": cache.num_gpu_blocks * cache.block_size,
            "kv_bytes": kv_bytes,
            "workers": report,
            "gpu_bytes_allocated": torch.cuda.memory_allocated()
            if torch.cuda.is_available()
            else 0,
        }
    )
    rng = random.Random(0)
    vocab = cfg["vocab"]

    def prompts(n: int, length: int) -> list:
        return [
            TokensPrompt(prompt_token_ids=[rng.randrange(3, vocab) for _ in range(length)])
            for _ in range(n)
        ]

    for line in sys.stdin:
        request = json.loads(line)
        op = request["op"]
        if op == "quit":
            break
        if op == "greedy":
            fixed = random.Random(1)
            batch = [
                TokensPrompt(
                    prompt_token_ids=[fixed.randrange(3, vocab) for _ in range(24 + 8 * i)]
                )
                for i in range(GREEDY_PROMPTS)
            ]
            params = SamplingParams(
                temperature=0,
                max_tokens=GREEDY_TOKENS,
                logprobs=5,
                ignore_eos=True,
                detokenize=False,
            )
            outs = llm.generate(batch, params, use_tqdm=False)
            emit(
                {
                    "event": "greedy",
                    "tokens": [list(o.outputs[0].token_ids) for o in outs],
                    "top5": [
                        [
                            sorted(step, key=lambda t: -step[t].logprob)[:5]
                            for step in o.outputs[0].logprobs
                        ]
                        for o in outs
                    ],
                    "spec": spec_counters(llm),
                }
            )
            continue
        if op == "profile":
            # Decode steps with every LM-head call timed inside the worker (host time and GPU
            # span), then once more under torch.profiler for the kernels of the whole step.
            from vllm_embed_plugin.tools.introspect import head_profile_start, head_profile_stop

            params = SamplingParams(
                temperature=0, max_tokens=request["tokens"], ignore_eos=True, detokenize=False
            )
            llm.generate(prompts(request["batch"], 32), params, use_tqdm=False)  # warm-up
            report = {}
            for kernels in (False, True):
                llm.collective_rpc(head_profile_start, args=(kernels,))
                t0 = time.perf_counter()
                llm.generate(prompts(request["batch"], 32), params, use_tqdm=False)
                elapsed = time.perf_counter() - t0
                stats = llm.collective_rpc(head_profile_stop)[0]
                if kernels:
                    report["traced"] = {"seconds": elapsed, **stats}
                else:
                    report.update(seconds=elapsed, steps=request["tokens"], **stats)
            emit({"event": "profile", **report})
            continue
        if op == "accept":
            emit({"event": "accept", **accept_run(llm, vocab, request)})
            continue
        # Timed: decode (batch prompts of 32 tokens, `tokens` new tokens each) or prefill
        # (one prompt of `length` tokens, one new token). A warm-up at the same shape first.
        if op == "decode":
            shape = (request["batch"], 32, request["tokens"])
        else:
            shape = (1, request["length"], 1)
        batch, length, new = shape
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, detokenize=False)
        if request.get("warmup"):
            llm.generate(prompts(batch, length), params, use_tqdm=False)
        work = prompts(batch, length)
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        t0 = time.perf_counter()
        llm.generate(work, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        processed = batch * new if op == "decode" else batch * length
        emit({"event": "timed", "op": op, "seconds": elapsed, "tokens_per_s": processed / elapsed})


def spec_counters(llm) -> dict:
    """Speculative-decoding counters from vLLM's metrics (empty without a drafter)."""
    wanted = {
        "vllm:spec_decode_num_drafts",
        "vllm:spec_decode_num_draft_tokens",
        "vllm:spec_decode_num_accepted_tokens",
        "vllm:spec_decode_num_accepted_tokens_per_pos",
    }
    out = {}
    try:
        for metric in llm.get_metrics():
            if metric.name in wanted:
                # Counters carry `value`; the per-position vector `values`.
                value = getattr(metric, "value", None)
                out[metric.name.split(":")[1]] = getattr(metric, "values", value)
    except Exception as exc:  # noqa: BLE001 - metrics are a report, never a failure
        out["error"] = repr(exc)
    return out


#: Lines of an engine's log that a start-up failure quotes.
ERROR_LINES = 30


def log_file(log_dir: Path, name: str) -> Path:
    """An engine's log: its name with only [A-Za-z0-9._-] (engine names hold '+' and '=', which
    some file transfers drop)."""
    return log_dir / (re.sub(r"[^A-Za-z0-9._-]", "_", name) + ".log")


def emit(message: dict) -> None:
    print("E2E_JSON " + json.dumps(message), flush=True)


class Engine:
    """The driver's handle on one child engine."""

    def __init__(self, name: str, cfg: dict, env: dict, log_dir: Path):
        self.name = name
        self.log_path = log_file(log_dir, name)
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_EMBED_")}
        full_env.update(BASE_ENV)
        full_env.update(env)
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--child", json.dumps(cfg)],
            env=full_env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        self.ready = self._wait("ready")

    def _wait(self, event: str) -> dict:
        for line in self.proc.stdout:
            self.log.write(line)
            if line.startswith("E2E_JSON "):
                message = json.loads(line[len("E2E_JSON ") :])
                if message["event"] == event:
                    self.log.flush()
                    return message
        self.log.flush()
        # The log's last lines in the message: the JSON keeps them where the log is not kept.
        tail = "".join(self.log_text().splitlines(keepends=True)[-ERROR_LINES:])
        raise RuntimeError(
            f"{self.name}: engine exited (rc={self.proc.wait()}); see {self.log_path}; its last "
            f"lines:\n{tail}"
        )

    def ask(self, request: dict, event: str) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._wait(event)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except Exception:  # noqa: BLE001
                self.proc.kill()
        self.log.close()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


# -- the driver --------------------------------------------------------------------------------


def compile_cache_use(log: str) -> dict:
    """Which vLLM compile-cache entries (hash directories) a start wrote or read: a start
    must never read an entry written for other plugin settings."""
    import re

    dirs = sorted(
        set(re.findall(r"torch_compile_cache/(?:torch_aot_compile/)?([0-9a-f]{10,})", log))
    )
    loaded = bool(re.search(r"Directly load", log))
    return {"compile_cache_dirs": dirs, "compile_cache_loaded": loaded}


def table_gpu_bytes(ready: dict, model: str = "target") -> int:
    """Bytes of vocabulary tables in GPU memory on rank 0: a table shared by a tied head
    counted once, a host-format table (a view of pinned host memory) not at all."""
    report = ready["workers"][0][model]
    if report is None:
        return 0
    return report["vocab_bytes"] - sum(t["bytes"] for t in report["tables"] if t.get("on_host"))


def split_head_format(config: str) -> tuple[str, dict[str, str]]:
    """'int8+head=int5' -> ('int8', {VLLM_EMBED_HEAD_FORMAT: int5}): a configuration whose
    untied LM head has its own format (issue 25); any other configuration as it is."""
    config, _, head_format = config.partition("+head=")
    return config, ({"VLLM_EMBED_HEAD_FORMAT": head_format} if head_format else {})


def plugin_env(config: str) -> dict[str, str]:
    """The plugin's settings for one configuration: 'off', a format, or 'format/head kernel'
    (e.g. 'int8/plugin': int8 with the tied head on the plugin's kernels, not Machete), each
    optionally with '+head=FORMAT' for an untied head ('off+head=int8': the head alone); a
    trailing '@nographs' (before any '+head=') launches the head through its op, without the
    head's CUDA graphs (the path before them)."""
    config, head_env = split_head_format(config)
    config, _, variant = config.partition("@")
    fmt, _, head = config.partition("/")
    env = {} if fmt == "off" else {"VLLM_EMBED_FORMAT": fmt}
    if head:
        env["VLLM_EMBED_HEAD_KERNEL"] = head
    if variant == "nographs":
        env["VLLM_EMBED_NO_HEAD_GRAPHS"] = "1"
    elif variant:
        raise SystemExit(f"unknown variant {variant!r} in {config!r}@{variant}: only 'nographs'")
    return {**env, **head_env}


def measure_model(
    args, name: str, path: Path, formats: list[str], spec: dict, out: dict, log_dir: Path, save
) -> None:
    from vllm_embed_plugin.tools.probe import greedy_close

    base = dict(
        model=str(path),
        vocab=spec["vocab"],
        gpu_util=args.gpu_util,
        tp=args.tensor_parallel_size,
        max_model_len=args.prefill + 512,
        max_num_seqs=64,
        attention=args.attention,
    )
    engines: dict[str, Engine] = {}
    results = out.setdefault(
        name,
        {
            "shape": [spec["vocab"], spec["hidden"]],
            "tied": spec["tied"],
            "kv_bytes_per_token": kv_bytes_per_token(path),
            "formats": {},
        },
    )
    try:
        for fmt in formats:
            print(f"[{name}] starting {fmt}", flush=True)
            engine = Engine(
                f"{name}-{fmt.replace('/', '+').replace('@', '-')}", base, plugin_env(fmt), log_dir
            )
            engines[fmt] = engine
            log = engine.log_text()
            results["formats"][fmt] = {
                "init_s": engine.ready["init_s"],
                "kv_tokens": engine.ready["kv_tokens"],
                "table_gpu_bytes": table_gpu_bytes(engine.ready),
                "tables": engine.ready["workers"][0]["target"]["tables"],
                "conversion_log": conversion_lines(log.splitlines()),
                "graph_breaks": log.count("Graph break"),
                **compile_cache_use(log),
            }
            print(
                f"[{name}] {fmt}: init {engine.ready['init_s']:.1f} s, KV {engine.ready['kv_tokens']:,} tokens",
                flush=True,
            )
            save()
        for fmt, engine in engines.items():
            greedy = engine.ask({"op": "greedy"}, "greedy")
            results["formats"][fmt]["greedy"] = greedy
        reference = results["formats"].get("off", {}).get("greedy")
        for fmt in formats if reference else ():  # agreement needs the BF16 engine in this run
            greedy = results["formats"][fmt]["greedy"]
            same = sum(
                a == b for r, g in zip(reference["tokens"], greedy["tokens"]) for a, b in zip(r, g)
            )
            results["formats"][fmt]["agreement"] = {
                "equal_tokens": same,
                "total": GREEDY_PROMPTS * GREEDY_TOKENS,
                "top5_problems": greedy_close(reference, greedy),
            }
        # Timings: every request shape, plugin off and on interleaved, repeated.
        requests = [
            ("decode_b1", {"op": "decode", "batch": 1, "tokens": args.decode_tokens}),
            ("decode_b64", {"op": "decode", "batch": 64, "tokens": args.decode_tokens}),
            ("prefill", {"op": "prefill", "length": args.prefill}),
        ]
        for label, request in requests:
            for engine in engines.values():
                engine.ask({**request, "warmup": True}, "timed")
            for rep in range(args.reps):
                order = list(engines.items()) if rep % 2 == 0 else list(engines.items())[::-1]
                for fmt, engine in order:
                    timed = engine.ask(request, "timed")
                    results["formats"][fmt].setdefault(label, []).append(timed["tokens_per_s"])
            print(
                f"[{name}] {label}: "
                + ", ".join(
                    f"{fmt} {statistics.median(results['formats'][fmt][label]):,.0f} tok/s"
                    for fmt in engines
                ),
                flush=True,
            )
            save()
        if args.profile:
            profile_model(args, name, engines, results, save)
    finally:
        for engine in engines.values():
            engine.close()


PROFILE_BATCHES = (1, 64)


def profile_model(args, name: str, engines: dict, results: dict, save) -> None:
    """Where a decode step's time goes, per format against BF16 ('off'): the step (wall time
    over a fixed number of decode steps), the LM head's GPU span and host time (timed inside
    the worker), and the rest. Interleaved and repeated like the timings; a kernel trace of
    one more run per engine lists the kernels behind the rest."""
    for batch in PROFILE_BATCHES:
        label = f"profile_b{batch}"
        request = {"op": "profile", "batch": batch, "tokens": args.decode_tokens}
        for rep in range(args.reps):
            order = list(engines.items()) if rep % 2 == 0 else list(engines.items())[::-1]
            for fmt, engine in order:
                report = engine.ask(request, "profile")
                results["formats"][fmt].setdefault(label, []).append(report)
        print(
            f"[{name}] {label}: "
            + "; ".join(f"{fmt} {_profile_row(results['formats'][fmt][label])}" for fmt in engines),
            flush=True,
        )
        save()


def _profile_row(reports: list[dict]) -> str:
    step = statistics.median(r["seconds"] / r["steps"] * 1e6 for r in reports)
    gpu = statistics.median(r["head_gpu_us_median"] for r in reports)
    cpu = statistics.median(r["head_cpu_us_median"] for r in reports)
    return f"step {step:.0f} us, head GPU {gpu:.0f} us, head CPU {cpu:.0f} us"


def profile_split(results: dict, fmt: str, batch: int) -> dict | None:
    """The per-step difference of `fmt` against 'off' at `batch`, split into the head's GPU
    span, its host time and the rest (medians over the repeats; spread of the step)."""
    label = f"profile_b{batch}"
    base, runs = results["formats"]["off"].get(label), results["formats"][fmt].get(label)
    if not base or not runs:
        return None

    def med(reports, key):
        return statistics.median(key(r) for r in reports)

    steps = [r["seconds"] / r["steps"] * 1e6 for r in runs]
    step = statistics.median(steps)
    step_off = med(base, lambda r: r["seconds"] / r["steps"] * 1e6)
    gpu = med(runs, lambda r: r["head_gpu_us_median"])
    gpu_off = med(base, lambda r: r["head_gpu_us_median"])
    cpu = med(runs, lambda r: r["head_cpu_us_median"])
    cpu_off = med(base, lambda r: r["head_cpu_us_median"])
    kernels = runs[-1].get("traced", {}).get("gpu_kernel_us_total")
    kernels_off = base[-1].get("traced", {}).get("gpu_kernel_us_total")
    return {
        "step_us": step,
        "step_us_spread": [min(steps), max(steps)],
        "step_us_off": step_off,
        "speed_vs_off": step_off / step,
        "delta_step_us": step - step_off,
        "delta_head_gpu_us": gpu - gpu_off,
        "delta_head_cpu_us": cpu - cpu_off,
        "delta_rest_us": (step - step_off) - (gpu - gpu_off),
        "delta_kernels_per_step_us": (kernels - kernels_off) / runs[-1]["steps"]
        if kernels is not None and kernels_off is not None
        else None,
        "head_gpu_us": gpu,
        "head_cpu_us": cpu,
        "head_gpu_us_off": gpu_off,
        "head_cpu_us_off": cpu_off,
    }


def conversion_lines(log: list[str]) -> list[str]:
    """The plugin's "... table -> FORMAT ..." lines of an engine log, without their prefix."""
    return [
        x.split("vllm-embed-plugin: ", 1)[1]
        for x in log
        if "table ->" in x and "vllm-embed-plugin: " in x
    ]


def unknown_env_warnings(log: list[str]) -> list[str]:
    """vLLM's "Unknown vLLM environment variable" warnings in an engine log (issue 26)."""
    return [x for x in log if "Unknown vLLM environment variable" in x]


def measure_spec(args, specs: dict, root: Path, out: dict, log_dir: Path) -> None:
    """A separate draft model, both models converted; then an MTP drafter sharing the table."""
    from vllm_embed_plugin.tools.probe import greedy_close

    target = build_model(root, "spec-target", specs["spec-target"])
    draft = build_model(root, "spec-draft", specs["spec-draft"])
    base = dict(
        model=str(target),
        vocab=specs["spec-target"]["vocab"],
        gpu_util=args.gpu_util,
        tp=args.tensor_parallel_size,
        max_model_len=2048,
        max_num_seqs=16,
        attention=args.attention,
        speculative={"model": str(draft), "method": "draft_model", "num_speculative_tokens": 3},
    )
    results = out.setdefault("draft_model", {"formats": {}})
    for fmt in ("off", "int8"):
        env = {"VLLM_EMBED_FORMAT": fmt} if fmt != "off" else {}
        engine = Engine(f"draft-{fmt}", base, env, log_dir)
        try:
            greedy = engine.ask({"op": "greedy"}, "greedy")
            log = engine.log_text().splitlines()
            results["formats"][fmt] = {
                "init_s": engine.ready["init_s"],
                "kv_tokens": engine.ready["kv_tokens"],
                "kv_bytes": engine.ready.get("kv_bytes"),
                "target_bytes": table_gpu_bytes(engine.ready, "target"),
                "draft_bytes": table_gpu_bytes(engine.ready, "draft"),
                "conversion_log": conversion_lines(log),
                "unknown_env_warnings": unknown_env_warnings(log),
                "draft_tables": (engine.ready["workers"][0]["draft"] or {}).get("tables"),
                "greedy": greedy,
                "spec": greedy["spec"],
            }
        finally:
            engine.close()
    if "off" in results["formats"] and "int8" in results["formats"]:
        results["top5_problems"] = greedy_close(
            results["formats"]["off"]["greedy"], results["formats"]["int8"]["greedy"]
        )


# -- speculative decoding and host tables (issue 26): --suite mtp | selfdraft | host --------------


def kv_cache_bytes(worker) -> int:
    """Bytes of KV cache this worker allocated: attention and, in a hybrid model, the
    linear-attention state, which come out of the same budget (tensors of a packed layout
    share one allocation)."""
    tensors = worker.model_runner.kv_cache_config.kv_cache_tensors
    packed = [t.size for t in tensors if getattr(t, "block_stride", 0)]
    own = [t.size for t in tensors if not getattr(t, "block_stride", 0)]
    return sum(own) + max(packed, default=0)


def accept_run(llm, vocab: int, request: dict) -> dict:
    """Greedy generation on fixed random prompts; vLLM's spec-decode counters before and after."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    fixed = random.Random(2)
    batch = [
        TokensPrompt(prompt_token_ids=[fixed.randrange(3, vocab) for _ in range(32)])
        for _ in range(request["prompts"])
    ]
    params = SamplingParams(
        temperature=0, max_tokens=request["tokens"], ignore_eos=True, detokenize=False
    )
    before = spec_counters(llm)
    outs = llm.generate(batch, params, use_tqdm=False)
    return {
        "before": before,
        "after": spec_counters(llm),
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
    }


def acceptance(before: dict, after: dict) -> dict:
    """Draft tokens proposed and accepted between two readings of vLLM's counters."""

    # spec_counters keys are vLLM's metric names without the "vllm:" prefix.
    def delta(key: str) -> int:
        return (after.get(f"spec_decode_{key}") or 0) - (before.get(f"spec_decode_{key}") or 0)

    drafted, accepted = delta("num_draft_tokens"), delta("num_accepted_tokens")
    per_pos = [
        a - b
        for a, b in zip(
            after.get("spec_decode_num_accepted_tokens_per_pos") or [],
            before.get("spec_decode_num_accepted_tokens_per_pos") or [],
        )
    ]
    return {
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "rate": accepted / drafted if drafted else None,
        "accepted_per_position": per_pos,
    }


def _storages(table: dict) -> set[int]:
    return {ptr for ptr, _ in table["storages"].values()}


def shared_by_identity(target_tables: list[dict], draft_tables: list[dict]) -> dict:
    """For the drafter's embedding and LM head: True when every tensor of it (codes, scales,
    mins) lives in the storage of the target's table of the same kind, False when it is a
    table of its own (even one with equal bytes), None when the drafter has no such table."""
    result = {}
    for kind in ("embedding", "lm_head"):
        drafts = [t for t in draft_tables if t["kind"] == kind]
        targets = [_storages(t) for t in target_tables if t["kind"] == kind]
        result[kind] = (
            all(any(_storages(d) == t for t in targets) for d in drafts) if drafts else None
        )
    return result


def unique_table_bytes(ready: dict) -> int:
    """GPU bytes of the vocabulary tables of the target and the drafter (rank 0), each storage
    counted once: a drafter table that is the target's adds nothing; a host table is not in
    GPU memory."""
    sizes = {}
    for model in ("target", "draft"):
        for table in (ready["workers"][0].get(model) or {}).get("tables", []):
            if not table.get("on_host"):
                sizes.update(dict(table["storages"].values()))
    return sum(sizes.values())


def kv_gain(off: dict, on: dict) -> float | None:
    """KV-cache bytes gained over table bytes freed, against the BF16 engine."""
    freed = off["table_bytes"] - on["table_bytes"]
    if not freed or off.get("kv_bytes") is None or on.get("kv_bytes") is None:
        return None
    return (on["kv_bytes"] - off["kv_bytes"]) / freed


def suite_budget(args) -> dict:
    """Timing sizes of the mtp, selfdraft and host suites: `--quick` keeps their shapes (they
    are the measurement) and vLLM's CUDA-graph sizes, and cuts repeats and tokens, to fit
    about 8 minutes per suite."""
    if not args.quick:
        return dict(reps=args.reps, decode_tokens=args.decode_tokens, prefill=args.prefill)
    return dict(
        reps=min(args.reps, 3),
        decode_tokens=min(args.decode_tokens, 64),
        prefill=min(args.prefill, 4096),
    )


def suite_formats(args, default: tuple[str, ...]) -> list[str]:
    """The formats an mtp, selfdraft or host run starts: `--suite-formats`, else the suite's."""
    return [f for f in args.suite_formats.split(",") if f] or list(default)


def start_suite_engines(name: str, base: dict, configs: dict, log_dir: Path, results: dict):
    """Start one engine per configuration (one after the other) and record what each start
    showed; an engine that fails is reported with its log's tail and left out."""
    import re

    engines = {}
    for label, env in configs.items():
        print(f"[{name}] starting {label}", flush=True)
        try:
            engine = Engine(f"{name}-{label}", base, env, log_dir)
        except RuntimeError as exc:
            results[label] = {"error": str(exc)}  # it quotes the log's last lines
            print(f"[{name}] {label} FAILED: {exc}", flush=True)
            continue
        engines[label] = engine
        log = engine.log_text()
        log_lines = log.splitlines()
        ready = engine.ready
        workers = ready["workers"][0]
        loading = re.findall(r"Model loading took ([\d.]+) GiB", log)
        results[label] = {
            "init_s": ready["init_s"],
            "kv_tokens": ready["kv_tokens"],
            "kv_bytes": ready.get("kv_bytes"),
            "table_bytes": unique_table_bytes(ready),
            "model_loading_gib": float(loading[0]) if loading else None,
            "target_tables": workers["target"]["tables"],
            "draft_tables": (workers.get("draft") or {}).get("tables"),
            "shared": shared_by_identity(
                workers["target"]["tables"], (workers.get("draft") or {}).get("tables") or []
            )
            if workers.get("draft")
            else None,
            "conversion_log": conversion_lines(log_lines),
            "share_log": [x for x in log_lines if "Sharing target model" in x],
            "unknown_env_warnings": unknown_env_warnings(log_lines),
            "graph_breaks": log.count("Graph break"),
        }
        # Printed as it comes, so a run cut short still shows it.
        print(
            f"[{name}] {label}: init {ready['init_s']:.1f} s, KV {ready['kv_tokens']:,} tokens "
            f"({ready.get('kv_bytes')} B), tables {results[label]['table_bytes']:,} B, "
            f"shared {results[label]['shared']}, "
            f"{len(results[label]['unknown_env_warnings'])} unknown-variable warnings",
            flush=True,
        )
    return engines


def time_suite_engines(name: str, engines: dict, requests: list, reps: int, results: dict):
    """Every request shape on every engine, warmed up, then interleaved and repeated."""
    for label, request in requests:
        for engine in engines.values():
            engine.ask({**request, "warmup": True}, "timed")
        for rep in range(reps):
            order = list(engines.items()) if rep % 2 == 0 else list(engines.items())[::-1]
            for config, engine in order:
                timed = engine.ask(request, "timed")
                results[config].setdefault(label, []).append(timed["tokens_per_s"])
        print(
            f"[{name}] {label}: "
            + ", ".join(f"{c} {statistics.median(results[c][label]):,.0f} tok/s" for c in engines),
            flush=True,
        )


def close_all(engines: dict) -> None:
    for engine in engines.values():
        engine.close()


def build_mtp_config(root: Path) -> tuple[Path, int]:
    """A Qwen3.5-style (hybrid: linear attention, then full) config with one MTP layer, and its
    vocabulary. No weights are written: the engines load vLLM's dummy weights."""
    vocab, hidden = 248320, 2048
    path = root / "qwen35-mtp"
    path.mkdir(parents=True, exist_ok=True)
    text = dict(
        model_type="qwen3_5_text",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=6144,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        full_attention_interval=4,
        max_position_embeddings=8192,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        mtp_num_hidden_layers=1,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        bos_token_id=1,
        eos_token_id=2,
    )
    vision = dict(
        model_type="qwen3_5",
        depth=1,
        hidden_size=256,
        intermediate_size=512,
        num_heads=4,
        out_hidden_size=hidden,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        in_channels=3,
        num_position_embeddings=2304,
        deepstack_visual_indexes=[],
    )
    config = dict(
        architectures=["Qwen3_5ForConditionalGeneration"],
        model_type="qwen3_5",
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=False,
        image_token_id=vocab - 3,
        video_token_id=vocab - 2,
        vision_start_token_id=vocab - 4,
        vision_end_token_id=vocab - 5,
    )
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path, vocab


#: Engine arguments a Qwen3.5-style checkpoint needs on the device bundle (vLLM 0.26): the
#: text model alone (else vLLM looks for an image processor), and the Triton GDN prefill (the
#: bundle has no FlashInfer).
QWEN35_ENGINE_ARGS = {"language_model_only": True, "gdn_prefill_backend": "triton"}


def measure_mtp_suite(args, root: Path, out: dict, log_dir: Path) -> None:
    """MTP drafter (vLLM shares the target's embedding and LM head with it): BF16, int8 and
    int4, each with MTP on. Dummy weights: acceptance means nothing here (see selfdraft)."""
    budget = suite_budget(args)
    path, vocab = build_mtp_config(root)
    base = dict(
        model=str(path),
        vocab=vocab - 8,
        gpu_util=args.gpu_util,
        tp=args.tensor_parallel_size,
        max_model_len=2048,
        max_num_seqs=64,
        attention=args.attention,
        load_format="dummy",
        speculative={"method": "mtp", "num_speculative_tokens": 1},
        engine_args=QWEN35_ENGINE_ARGS,
    )
    results = out.setdefault("mtp", {"shape": [vocab, 2048], "configs": {}})["configs"]
    formats = suite_formats(args, ("off", "int8", "int4")) + list(mtp_head_configs(args))
    configs = {fmt: plugin_env(fmt) for fmt in formats}
    engines = start_suite_engines("mtp", base, configs, log_dir, results)
    try:
        requests = [
            ("decode_b1", {"op": "decode", "batch": 1, "tokens": budget["decode_tokens"]}),
            ("decode_b64", {"op": "decode", "batch": 64, "tokens": budget["decode_tokens"]}),
        ]
        time_suite_engines("mtp", engines, requests, budget["reps"], results)
    finally:
        close_all(engines)


def draft_alias(target: Path) -> Path:
    """The same checkpoint under another name (a symlink beside it), so that the allowlist
    (`VLLM_EMBED_MODELS`) converts the drafter alone."""
    draft = target.with_name(target.name + "-as-draft")
    if not draft.exists():
        draft.symlink_to(target.name)
    return draft


def selfdraft_env(fmt: str, draft: Path, target_too: bool) -> dict:
    """The plugin's variables for a self-draft engine: FMT for the drafter alone (the
    allowlist names its alias), or with `target_too` for target and drafter alike, as a user
    who sets one format for every model runs them."""
    if fmt == "off":
        return {}
    return {"VLLM_EMBED_FORMAT": fmt} | ({} if target_too else {"VLLM_EMBED_MODELS": draft.name})


def measure_selfdraft(args, specs: dict, root: Path, out: dict, log_dir: Path) -> None:
    """Draft model = target (`draft_model`), only the drafter converted (or, with
    `--selfdraft-target-too`, both): its acceptance against the target, for BF16, int8 and
    int4. A tied checkpoint with transformers' random init (range 0.02), so the drafter's
    lookup and its logits both read the converted table, and greedy tokens are not ties of
    flat logits."""
    spec = (
        dict(vocab=65536, hidden=1024, layers=4, tied=True, heads=8, kv_heads=4)
        if args.quick
        else dict(vocab=151936, hidden=2048, layers=8, tied=True)
    )
    target = build_model(root, "selfdraft-quick" if args.quick else "selfdraft", spec)
    draft = draft_alias(target)
    base = dict(
        model=str(target),
        vocab=spec["vocab"],
        gpu_util=args.gpu_util,
        tp=args.tensor_parallel_size,
        max_model_len=2048,
        max_num_seqs=64,
        attention=args.attention,
        speculative={"model": str(draft), "method": "draft_model", "num_speculative_tokens": 3},
    )
    results = out.setdefault("selfdraft", {"shape": [spec["vocab"], spec["hidden"]], "configs": {}})
    results = results["configs"]
    configs = {
        fmt: selfdraft_env(fmt, draft, args.selfdraft_target_too)
        for fmt in suite_formats(args, ("off", "int8", "int4"))
    }
    engines = start_suite_engines("selfdraft", base, configs, log_dir, results)
    try:
        for fmt, engine in engines.items():
            request = {"op": "accept", "prompts": args.accept_prompts, "tokens": 64}
            run = engine.ask(request, "accept")
            results[fmt]["acceptance"] = acceptance(run["before"], run["after"])
            results[fmt]["tokens"] = run["tokens"]
            print(f"[selfdraft] {fmt}: acceptance {results[fmt]['acceptance']}", flush=True)
    finally:
        close_all(engines)


def measure_host(args, root: Path, out: dict, log_dir: Path) -> None:
    """The host formats inside vLLM on the GPU: start-up (with CUDA-graph capture), decode,
    prefill and KV against BF16. The Qwen3-8B table and head (151,936 x 4,096) on 8 layers, so
    the engines start in about a minute; dummy weights, since nothing here needs a trained
    model (host is lossless: its greedy tokens must equal BF16's)."""

    budget = suite_budget(args)
    path = dummy_qwen3(root / "host-dummy", 151936, 4096, 12288, heads=32, pad_token_id=0)
    base = dict(
        model=str(path),
        vocab=151936,
        gpu_util=args.gpu_util,
        tp=args.tensor_parallel_size,
        max_model_len=budget["prefill"] + 512,
        max_num_seqs=64,
        attention=args.attention,
        load_format="dummy",
    )
    results = out.setdefault("host", {"shape": [151936, 4096], "configs": {}})["configs"]
    configs = {fmt: plugin_env(fmt) for fmt in suite_formats(args, ("off", "host", "host-int8"))}
    engines = start_suite_engines("host", base, configs, log_dir, results)
    try:
        for fmt, engine in engines.items():
            results[fmt]["greedy"] = engine.ask({"op": "greedy"}, "greedy")
        if "off" in engines and "host" in engines:
            reference = results["off"]["greedy"]["tokens"]
            results["host"]["greedy_equal_to_bf16"] = (
                results["host"]["greedy"]["tokens"] == reference
            )
        requests = [
            ("decode_b1", {"op": "decode", "batch": 1, "tokens": budget["decode_tokens"]}),
            ("decode_b64", {"op": "decode", "batch": 64, "tokens": budget["decode_tokens"]}),
            ("prefill", {"op": "prefill", "length": budget["prefill"]}),
        ]
        time_suite_engines("host", engines, requests, budget["reps"], results)
    finally:
        close_all(engines)


def dummy_qwen3(path: Path, vocab: int, hidden: int, ffn: int, heads: int, **extra) -> Path:
    """An 8-layer untied Qwen3 config (no weights: vLLM's dummy load) at `path`, once."""
    from transformers import Qwen3Config

    if not (path / "config.json").exists():
        Qwen3Config(
            # Without it vLLM resolves the bare Qwen3Model and starts a pooling engine.
            architectures=["Qwen3ForCausalLM"],
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=ffn,
            num_hidden_layers=8,
            num_attention_heads=heads,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=16384,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
            **extra,
        ).save_pretrained(path)
    return path


def measure_eagle(args, root: Path, out: dict, log_dir: Path) -> None:
    """An EAGLE-3 drafter with dummy weights on a dummy Qwen3 target, BF16 and int8: whether
    vLLM shares the target's table and head with it (a drafter that loaded no embedding or head
    of its own). Optional: reported as failed where vLLM cannot run it."""

    vocab, hidden = 151936, 2048
    target = dummy_qwen3(root / "eagle-target-dummy", vocab, hidden, 6144, heads=16)
    head = root / "eagle3-head-dummy"
    head.mkdir(parents=True, exist_ok=True)
    (head / "config.json").write_text(
        json.dumps(
            dict(
                architectures=["LlamaForCausalLMEagle3"],
                model_type="llama",
                vocab_size=vocab,
                draft_vocab_size=vocab,
                hidden_size=hidden,
                target_hidden_size=hidden,
                intermediate_size=6144,
                num_hidden_layers=1,
                num_attention_heads=16,
                num_key_value_heads=8,
                head_dim=128,
                max_position_embeddings=16384,
                rms_norm_eps=1e-6,
                rope_theta=1000000.0,
                tie_word_embeddings=False,
                torch_dtype="bfloat16",
            )
        )
    )
    base = dict(
        model=str(target),
        vocab=vocab,
        gpu_util=args.gpu_util,
        tp=args.tensor_parallel_size,
        max_model_len=2048,
        max_num_seqs=16,
        attention=args.attention,
        load_format="dummy",
        speculative={"model": str(head), "method": "eagle3", "num_speculative_tokens": 3},
    )
    results = out.setdefault("eagle", {"shape": [vocab, hidden], "configs": {}})["configs"]
    engines = start_suite_engines(
        "eagle", base, {fmt: plugin_env(fmt) for fmt in ("off", "int8")}, log_dir, results
    )
    close_all(engines)


def suite_table(name: str, suite: dict) -> list[str]:
    """A compact Markdown table of one of the mtp, selfdraft and host suites."""
    configs = suite["configs"]
    off = configs.get("off", {})
    lines = [
        f"## {name} {suite['shape'][0]:,} x {suite['shape'][1]:,}",
        "",
        "| config | start-up s | tables B | KV B gained / table B freed | shared emb / head "
        "| acceptance | decode b1 (vs off) | decode b64 (vs off) | prefill (vs off) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for config, r in configs.items():
        if "error" in r:
            lines.append(f"| {config} | failed: {r['error'][:160]} |")
            continue
        gain = kv_gain(off, r) if off and "error" not in off else None
        shared = r.get("shared") or {}
        accept = r.get("acceptance") or {}
        cells = [
            config,
            f"{r['init_s']:.1f}",
            f"{r['table_bytes']:,}",
            "-" if gain is None else f"{gain:.1%}",
            f"{shared.get('embedding')} / {shared.get('lm_head')}" if shared else "-",
            f"{accept['accepted_tokens']}/{accept['draft_tokens']} = {accept['rate']:.1%}"
            if accept.get("rate") is not None
            else "-",
        ]
        for label in ("decode_b1", "decode_b64", "prefill"):
            values, reference = r.get(label), off.get(label)
            if not values:
                cells.append("-")
                continue
            med = statistics.median(values)
            ratio = f"{med / statistics.median(reference):.3f}; " if reference else ""
            cells.append(f"{med:,.0f} ({ratio}{min(values):,.0f}-{max(values):,.0f})")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for config, r in configs.items():
        if "error" in r:
            continue
        # What converting a drafter table costs (issue 26): its time, and vLLM's own figure
        # for the memory the loaded models (target and drafter) hold.
        drafts = [x for x in r.get("conversion_log", []) if x.startswith("draft")]
        lines.append(
            f"- {config}: vLLM's model loading took {r.get('model_loading_gib')} GiB"
            + (f"; drafter: {'; '.join(drafts)}" if drafts else "")
            + (
                f"; {len(r['share_log'])} 'Sharing target model' lines"
                if r.get("share_log")
                else ""
            )
        )
    unknown = sum(len(r.get("unknown_env_warnings") or []) for r in configs.values())
    lines += ["", f"Unknown-variable warnings in these engines' logs: {unknown}.", ""]
    return lines


def mtp_head_configs(args) -> tuple[str, ...]:
    """The MTP engine's extra configurations for `--mtp-head-format` ('int8+head=FORMAT')."""
    return (f"int8+head={args.mtp_head_format}",) if args.mtp_head_format else ()


def summarize(out: dict) -> str:
    lines = [
        "# GPU end-to-end run",
        "",
        f"```\n{json.dumps(out.get('env', {}), indent=1)}\n```",
        "",
    ]
    for name in ("untied", "tied"):
        model = out.get(name)
        if not model:
            continue
        # Without a finished BF16 engine (it failed to start) the other rows have no baseline.
        off = model["formats"].get("off")
        if not off or "agreement" not in off:
            lines += [
                f"## {name}",
                "",
                "No finished BF16 engine: no ratios (see the failures).",
                "",
            ]
            continue
        lines += [
            f"## {name} {model['shape'][0]:,} x {model['shape'][1]:,}",
            "",
            "| format | table GPU bytes | KV tokens | KV gain / bytes freed | start-up s | greedy equal | top-5 problems "
            "| decode b1 tok/s (vs off) | decode b64 (vs off) | prefill (vs off) |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for fmt, r in model["formats"].items():
            if "agreement" not in r:
                lines.append(f"| {fmt} | (incomplete: {json.dumps(_strip(r))[:200]}) |")
                continue
            freed = off["table_gpu_bytes"] - r["table_gpu_bytes"]
            gained = (r["kv_tokens"] - off["kv_tokens"]) * model["kv_bytes_per_token"]
            cells = [
                fmt,
                f"{r['table_gpu_bytes']:,}",
                f"{r['kv_tokens']:,}",
                f"{gained / freed:.1%}" if freed else "-",
                f"{r['init_s']:.1f}",
                f"{r['agreement']['equal_tokens']}/{r['agreement']['total']}",
                str(len(r["agreement"]["top5_problems"])),
            ]
            for label in ("decode_b1", "decode_b64", "prefill"):
                values = r.get(label) or []
                if not values:
                    cells.append("-")
                    continue
                med = statistics.median(values)
                ratio = med / statistics.median(off[label])
                cells.append(f"{med:,.0f} ({ratio:.3f}; {min(values):,.0f}-{max(values):,.0f})")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        lines += profile_lines(model)
    for name in NEW_SUITES:
        if name in out:
            lines += suite_table(name, out[name])
    if out.get("failures"):
        lines += ["## Failures", ""] + [f"- {f}" for f in out["failures"]] + [""]
    if "draft_model" in out:
        lines += spec_table(out["draft_model"])
    return "\n".join(lines)


def spec_table(spec: dict) -> list[str]:
    """`--suite spec` (a separate draft model) as a Markdown table: both models' vocabulary
    tables, the KV cache gained over the bytes both free, and vLLM's spec-decode counters."""
    formats = spec["formats"]
    off = formats.get("off") or {}
    lines = [
        "## draft_model (a separate draft model)",
        "",
        "| format | start-up s | target tables B | draft tables B | KV tokens | KV B gained / "
        "table B freed | accepted / drafted | unknown-variable warnings |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for fmt, r in formats.items():
        gain = None
        if off and r.get("kv_bytes") is not None and off.get("kv_bytes") is not None:
            freed = off["target_bytes"] + off["draft_bytes"] - r["target_bytes"] - r["draft_bytes"]
            gain = (r["kv_bytes"] - off["kv_bytes"]) / freed if freed else None
        counters = r.get("spec") or {}
        accepted = counters.get("spec_decode_num_accepted_tokens")
        drafted = counters.get("spec_decode_num_draft_tokens")
        cells = [
            fmt,
            f"{r['init_s']:.1f}",
            f"{r['target_bytes']:,}",
            f"{r['draft_bytes']:,}",
            f"{r['kv_tokens']:,}",
            "-" if gain is None else f"{gain:.1%}",
            "-" if drafted is None else f"{accepted} / {drafted}",
            "-" if r.get("unknown_env_warnings") is None else str(len(r["unknown_env_warnings"])),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for fmt, r in formats.items():
        for line in r.get("conversion_log") or []:
            lines.append(f"- {fmt}: {line}")
    lines += ["", f"Top-5 problems against BF16: {len(spec.get('top5_problems') or [])}.", ""]
    return lines


def profile_lines(model: dict) -> list[str]:
    """The profile split (`--profile`) as a Markdown table, or nothing."""
    rows = []
    for batch in PROFILE_BATCHES:
        for fmt in model["formats"]:
            split = profile_split(model, fmt, batch) if fmt != "off" else None
            if split is None:
                continue
            rows.append(
                f"| {batch} | {fmt} | {split['step_us']:.0f} ({split['step_us_spread'][0]:.0f}-"
                f"{split['step_us_spread'][1]:.0f}) vs {split['step_us_off']:.0f} "
                f"({split['speed_vs_off']:.3f}x) | {split['delta_step_us']:+.0f} | "
                f"{split['head_gpu_us']:.0f} vs {split['head_gpu_us_off']:.0f} "
                f"({split['delta_head_gpu_us']:+.0f}) | {split['head_cpu_us']:.0f} vs "
                f"{split['head_cpu_us_off']:.0f} ({split['delta_head_cpu_us']:+.0f}) | "
                f"{split['delta_rest_us']:+.0f} | "
                + (
                    f"{split['delta_kernels_per_step_us']:+.0f}"
                    if split["delta_kernels_per_step_us"] is not None
                    else "-"
                )
                + " |"
            )
    if not rows:
        return []
    return [
        "Decode step split against BF16 (us per step; medians of the repeats):",
        "",
        "| batch | format | step us (spread) vs off | step delta | head GPU span vs off (delta) "
        "| head host time vs off (delta) | rest of the step delta | GPU kernel time per step "
        "delta (trace) |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]


def _strip(value):
    """The summary without the bulky per-token lists."""
    if isinstance(value, dict):
        return {
            k: _strip(v)
            for k, v in value.items()
            if k not in ("tokens", "top5", "greedy", "digests")
        }
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


#: --suite name -> function(args, specs, models root, results, log folder).
NEW_SUITES = {
    "mtp": lambda args, specs, root, out, logs: measure_mtp_suite(args, root, out, logs),
    "selfdraft": measure_selfdraft,
    "host": lambda args, specs, root, out, logs: measure_host(args, root, out, logs),
    "eagle": lambda args, specs, root, out, logs: measure_eagle(args, root, out, logs),
}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument(
        "--suite",
        choices=["main", "spec", "all", *NEW_SUITES],
        default="main",
        help="all = main + spec; mtp, selfdraft, host and eagle run alone",
    )
    parser.add_argument(
        "--only", default="", help="comma-separated models of the main suite (untied, tied)"
    )
    parser.add_argument(
        "--formats",
        default="off,int8,int4,host",
        help="formats for the untied model; 'FMT+head=HFMT' also converts its LM head "
        "(e.g. int8+head=int8, off+head=int8)",
    )
    parser.add_argument(
        "--tied-formats",
        default="off,int8/plugin,int8/machete,int4",
        help="'format/kernel' also sets VLLM_EMBED_HEAD_KERNEL",
    )
    parser.add_argument(
        "--mtp-head-format",
        default="",
        help="also run the MTP model with int8 and its untied head in this format "
        "(head_format); '' = not",
    )
    parser.add_argument(
        "--suite-formats",
        default="",
        help="formats the mtp, selfdraft or host suite starts, instead of its own list (a "
        "subset fits a shorter device call; KV gains need 'off' in the same or an earlier run)",
    )
    parser.add_argument(
        "--accept-prompts",
        type=int,
        default=16,
        help="selfdraft: prompts of 64 greedy tokens each that acceptance is counted over",
    )
    parser.add_argument(
        "--selfdraft-target-too",
        action="store_true",
        help="selfdraft: convert the target as well as the drafter (default: the drafter alone)",
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_e2e_out"))
    parser.add_argument("--models", default="/tmp/gpu_e2e_models")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="main, spec: tiny shapes, checks the script, measures nothing; mtp, selfdraft, "
        "host: their shapes, fewer repeats and CUDA-graph sizes (about 8 minutes each)",
    )
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument(
        "--gpu-util",
        type=float,
        default=0.2,
        help="share of GPU memory per engine; the engines of a suite run side by side (0.2 fits "
        "on an H200; the main suite's untied model needs 0.42 on an 80 GB H100)",
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--prefill", type=int, default=8192)
    parser.add_argument(
        "--attention", default="TRITON_ATTN", help="vLLM attention backend ('' = vLLM's choice)"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also split each decode step's time (head GPU, head host time, the rest) "
        f"against BF16 at batches {PROFILE_BATCHES}",
    )
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return 0

    out_dir = Path(args.out)
    log_dir = out_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    root = Path(args.models)
    specs = model_specs(args.quick)
    if args.quick and args.suite not in NEW_SUITES:
        args.prefill = min(args.prefill, 1024)
        args.reps = min(args.reps, 2)
        args.decode_tokens = min(args.decode_tokens, 16)
    import torch
    import vllm

    out = {
        "env": {
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "tensor_parallel_size": args.tensor_parallel_size,
            "reps": args.reps,
            "decode_tokens": args.decode_tokens,
            "prefill": args.prefill,
            "argv": sys.argv[1:],
        }
    }
    result_path = out_dir / f"gpu_e2e_{args.suite}.json"
    failures = []
    only = [m for m in args.only.split(",") if m]
    if args.suite in ("main", "all"):
        for name, formats in (("untied", args.formats), ("tied", args.tied_formats)):
            if only and name not in only:
                continue
            started = time.perf_counter()
            path = build_model(root, name, specs[name])
            print(f"[{name}] checkpoint ready in {time.perf_counter() - started:.1f} s", flush=True)
            try:
                measure_model(
                    args,
                    name,
                    path,
                    formats.split(","),
                    specs[name],
                    out,
                    log_dir,
                    save=lambda: result_path.write_text(json.dumps(out)),
                )
            except Exception as exc:  # noqa: BLE001 - report, and go on to the next model
                failures.append(f"{name}: {exc}")
            result_path.write_text(json.dumps(out))
    if args.suite in ("spec", "all"):
        try:
            measure_spec(args, specs, root, out, log_dir)
        except Exception as exc:  # noqa: BLE001
            failures.append(f"spec: {exc}")
    if args.suite in NEW_SUITES:
        try:
            NEW_SUITES[args.suite](args, specs, root, out, log_dir)
        except Exception as exc:  # noqa: BLE001
            failures.append(f"{args.suite}: {exc}")
    out["failures"] = failures
    result_path.write_text(json.dumps(out))
    summary = summarize(out)
    (out_dir / f"gpu_e2e_{args.suite}.md").write_text(summary)
    print(summary)
    for failure in failures:
        print("FAILED:", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
