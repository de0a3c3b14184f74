"""Run one real vLLM engine in its own process and report what it saw, as JSON.

The plugin is never imported by hand here: vLLM loads it through its entry point in each of
its processes, under whatever VLLM_EMBED_* variables the caller set. Used by the demo and the
end-to-end tests.

    python -m vllm_embed_plugin.tools.probe OUT.json --model DIR [--chat TEXT | --prompts JSON] ...
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--model", required=True)
    parser.add_argument("--draft", help="a draft model for speculative decoding")
    parser.add_argument(
        "--chat", action="append", help="a user message (repeatable); needs a tokenizer"
    )
    parser.add_argument(
        "--text", action="append", help="a plain-text prompt to complete (repeatable)"
    )
    parser.add_argument(
        "--prompts", help="token-id prompts as JSON, for models without a tokenizer"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=8, help="0: load the model and report, no generation"
    )
    parser.add_argument(
        "--logprobs", type=int, default=5, help="logprobs kept per generated token (at most 20)"
    )
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument(
        "--score",
        action="append",
        default=[],
        help="a text file: report vLLM's top-k prompt logprobs at every position of "
        "its first windows (repeatable; needs a tokenizer)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="vLLM's torch.compile (and its compile cache) instead of eager mode",
    )
    args = parser.parse_args()

    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import LLM, SamplingParams

    from vllm_embed_plugin.tools.introspect import worker_report

    extra = {}
    if args.draft:
        extra["speculative_config"] = {
            "model": args.draft,
            "method": "draft_model",
            "num_speculative_tokens": 2,
        }
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=not (args.chat or args.text or args.score),
        dtype="bfloat16",
        gpu_memory_utilization=0.25,
        max_model_len=args.max_model_len,
        enforce_eager=not args.compile,
        tensor_parallel_size=args.tp,
        pipeline_parallel_size=args.pp,
        seed=0,
        **extra,
    )
    params = SamplingParams(
        temperature=0,
        max_tokens=max(1, args.max_tokens),
        logprobs=args.logprobs,
        detokenize=bool(args.chat or args.text),
    )
    if args.max_tokens == 0:  # load only
        outputs = []
    elif args.chat:
        outputs = llm.chat(
            [[{"role": "user", "content": text}] for text in args.chat], params, use_tqdm=False
        )
    elif args.text:
        outputs = llm.generate(args.text, params, use_tqdm=False)
    else:
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=p) for p in json.loads(args.prompts)]
        outputs = llm.generate(prompts, params, use_tqdm=False)
    cache = llm.llm_engine.vllm_config.cache_config
    result = {
        "texts": [o.outputs[0].text for o in outputs],
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "top5": [
            [sorted(step, key=lambda t: -step[t].logprob)[:5] for step in o.outputs[0].logprobs]
            for o in outputs
        ],
        # Per prompt, per generated token: [token id, logprob, text] of every token vLLM
        # returned logprobs for (its top `--logprobs` and the one chosen), most likely first.
        "steps": [
            [
                [
                    [token, entry.logprob, entry.decoded_token]
                    for token, entry in sorted(step.items(), key=lambda item: -item[1].logprob)
                ]
                for step in o.outputs[0].logprobs
            ]
            for o in outputs
        ],
        "workers": llm.collective_rpc(worker_report),
        "kv_cache_tokens": cache.num_gpu_blocks * cache.block_size,
        "scored": [
            position
            for path in args.score
            for position in score_text(llm, path, args.max_model_len)
        ],
    }
    Path(args.out).write_text(json.dumps(result))
    # Stop the engine before the interpreter stops: left to interpreter exit, vLLM's engine
    # monitor thread raced the teardown ("engine core exited unexpectedly", then "terminate
    # called without an active exception", exit code 250) in 2 of 4 demo runs.
    llm.llm_engine.engine_core.shutdown()


#: Logprobs kept per position by `--score`, windows per file, and tokens per window.
SCORE_TOP_K, SCORE_WINDOWS = 20, 3


def score_text(llm, path: str, max_model_len: int) -> list[list[list]]:
    """For every position of the first SCORE_WINDOWS windows of `path`: vLLM's top
    SCORE_TOP_K [token id, logprob] pairs for the next token, most likely first."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    ids = llm.get_tokenizer().encode(Path(path).read_text())
    width = min(256, max_model_len - 1)
    windows = [ids[i : i + width] for i in range(0, len(ids) - width + 1, width)][:SCORE_WINDOWS]
    params = SamplingParams(
        max_tokens=1, temperature=0, prompt_logprobs=SCORE_TOP_K, detokenize=False
    )
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=w) for w in windows], params, use_tqdm=False
    )
    positions = []
    for output in outputs:
        for step in output.prompt_logprobs[1:]:  # the first token has no prediction
            top = sorted(step.items(), key=lambda item: item[1].rank)[:SCORE_TOP_K]
            positions.append([[token, entry.logprob] for token, entry in top])
    return positions


def compare_scores(reference: list, candidate: list) -> dict:
    """Agreement of the most likely next token, and the mean KL(reference || candidate)
    estimated from the top-k logprobs alone: the reference's top k tokens, each scored by the
    candidate (a token missing from the candidate's top k gets its k-th logprob, the most it
    can have), plus one bucket for the rest of the probability."""
    import math

    agree, kl = 0, 0.0
    for ref, got in zip(reference, candidate):
        agree += ref[0][0] == got[0][0]
        got_lp = dict((token, lp) for token, lp in got)
        floor = got[-1][1]
        p_top = q_top = total = 0.0
        for token, lp in ref:
            q = got_lp.get(token, floor)
            p = math.exp(lp)
            total += p * (lp - q)
            p_top += p
            q_top += math.exp(q)
        rest_p, rest_q = max(1.0 - p_top, 1e-12), max(1.0 - q_top, 1e-12)
        kl += max(0.0, total + rest_p * math.log(rest_p / rest_q))
    n = max(1, min(len(reference), len(candidate)))
    return {"positions": n, "top1_agreement": agree / n, "mean_kl": kl / n}


@dataclass
class ProbeRun:
    returncode: int
    log: str
    result: dict | None

    def tables(self, model: str = "target", rank: int = 0) -> dict[str, dict]:
        report = self.result["workers"][rank][model]
        return {t["name"]: t for t in report["tables"]}

    def embedding(self, model: str = "target", rank: int = 0) -> dict:
        return next(t for t in self.tables(model, rank).values() if t["kind"] == "embedding")


def greedy_close(reference: dict, candidate: dict) -> list[str]:
    """Problems found comparing two greedy runs: where the sequences part, the candidate's
    token must be among the reference's top 5 at that step (a near tie of the reference, not
    a different model)."""
    problems = []
    for i, (ref, got) in enumerate(zip(reference["tokens"], candidate["tokens"])):
        split = next((k for k, (a, b) in enumerate(zip(ref, got)) if a != b), None)
        if split is not None and got[split] not in reference["top5"][i][split]:
            problems.append(f"prompt {i}: step {split} token {got[split]} not in reference top 5")
    return problems


def run_probe(
    out_dir: Path, name: str, env: dict[str, str], *args: str, timeout: int = 900
) -> ProbeRun:
    """Run `main` in a fresh process with `env` on top of a VLLM_EMBED_*-free environment."""
    out = Path(out_dir) / f"{name}.json"
    full_env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("VLLM_EMBED_") or k == "VLLM_EMBED_CACHE"
    }
    full_env.update(env)
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_embed_plugin.tools.probe", str(out), *args],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    log = proc.stdout + proc.stderr
    (Path(out_dir) / f"{name}.log").write_text(log)
    result = json.loads(out.read_text()) if proc.returncode == 0 and out.exists() else None
    return ProbeRun(proc.returncode, log, result)


if __name__ == "__main__":
    main()
