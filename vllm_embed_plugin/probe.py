"""Runs one real vLLM engine (CPU backend) in its own process and writes what it saw as JSON.

The plugin is never imported here by hand: vLLM loads it through its entry point in each of
its processes, under whatever VLLM_EMBED_* variables the caller set.

    python -m tests.engine_runner OUT.json --model DIR [--draft DIR] [--prompts JSON]
"""

from __future__ import annotations

import argparse
import json
import os


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--model", required=True)
    parser.add_argument("--draft")
    parser.add_argument("--prompts", default="[[1, 2, 3, 4, 5, 6, 7, 8]]", help="token-id prompts (JSON)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()

    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_embed_plugin.introspect import worker_report

    extra = {}
    if args.draft:
        extra["speculative_config"] = {"model": args.draft, "method": "draft_model", "num_speculative_tokens": 2}
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        gpu_memory_utilization=0.25,
        max_model_len=512,
        enforce_eager=True,
        tensor_parallel_size=args.tp,
        seed=0,
        **extra,
    )
    prompts = [TokensPrompt(prompt_token_ids=p) for p in json.loads(args.prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, detokenize=False, logprobs=5)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    cache = llm.llm_engine.vllm_config.cache_config
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "top5": [[sorted(step, key=lambda t: -step[t].logprob)[:5] for step in o.outputs[0].logprobs] for o in outputs],
        "workers": llm.collective_rpc(worker_report),
        "kv_cache_tokens": cache.num_gpu_blocks * cache.block_size,
    }
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
