"""Run one real vLLM engine in its own process and report what it saw, as JSON.

The plugin is never imported by hand here: vLLM loads it through its entry point in each of
its processes, under whatever VLLM_EMBED_* variables the caller set. Used by the demo and the
end-to-end tests.

    python -m vllm_embed_plugin.probe OUT.json --model DIR [--chat TEXT | --prompts JSON] ...
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
    parser.add_argument("--chat", action="append", help="a user message (repeatable); needs a tokenizer")
    parser.add_argument("--text", action="append", help="a plain-text prompt to complete (repeatable)")
    parser.add_argument("--prompts", help="token-id prompts as JSON, for models without a tokenizer")
    parser.add_argument("--max-tokens", type=int, default=8, help="0: load the model and report, no generation")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--compile", action="store_true",
                        help="vLLM's torch.compile (and its compile cache) instead of eager mode")
    args = parser.parse_args()

    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import LLM, SamplingParams

    from vllm_embed_plugin.introspect import worker_report

    extra = {}
    if args.draft:
        extra["speculative_config"] = {"model": args.draft, "method": "draft_model", "num_speculative_tokens": 2}
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=not (args.chat or args.text),
        dtype="bfloat16",
        gpu_memory_utilization=0.25,
        max_model_len=args.max_model_len,
        enforce_eager=not args.compile,
        tensor_parallel_size=args.tp,
        pipeline_parallel_size=args.pp,
        seed=0,
        **extra,
    )
    params = SamplingParams(temperature=0, max_tokens=max(1, args.max_tokens), logprobs=5, detokenize=bool(args.chat or args.text))
    if args.max_tokens == 0:  # load only
        outputs = []
    elif args.chat:
        outputs = llm.chat([[{"role": "user", "content": text}] for text in args.chat], params, use_tqdm=False)
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
        "top5": [[sorted(step, key=lambda t: -step[t].logprob)[:5] for step in o.outputs[0].logprobs] for o in outputs],
        "workers": llm.collective_rpc(worker_report),
        "kv_cache_tokens": cache.num_gpu_blocks * cache.block_size,
    }
    Path(args.out).write_text(json.dumps(result))


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


def run_probe(out_dir: Path, name: str, env: dict[str, str], *args: str, timeout: int = 900) -> ProbeRun:
    """Run `main` in a fresh process with `env` on top of a VLLM_EMBED_*-free environment."""
    out = Path(out_dir) / f"{name}.json"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_EMBED_") or k == "VLLM_EMBED_CACHE"}
    full_env.update(env)
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_embed_plugin.probe", str(out), *args],
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
