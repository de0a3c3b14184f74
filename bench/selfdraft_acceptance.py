"""Self-draft acceptance on a real model, on whatever device vLLM runs (the CPU backend too): the
model as its own draft model (`draft_model`, 3 speculative tokens), the target in BF16 and only
the drafter converted (or, with --target-too, both, as one format set for every model does),
greedy continuations of held-out text. A random model's flat logits make greedy choices near
ties (bench/gpu_e2e.py --suite selfdraft); a trained model's do not.

    python bench/selfdraft_acceptance.py smollm2 --formats off,int8,int4,int8+file,int4+file

One engine per format, one after the other; prints one line per format and a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))


def child(cfg: dict) -> None:
    from gpu_e2e import acceptance, spec_counters
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_embed_plugin.tools.calibrate import special_prefix
    from vllm_embed_plugin.tools.evaluate import HELDOUT_FILES

    tok = AutoTokenizer.from_pretrained(cfg["target"])
    prompts = []
    for path in HELDOUT_FILES:
        ids = tok(path.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
        step = max(1, (len(ids) - cfg["prompt"]) // cfg["per_file"])
        prefix = special_prefix(tok)  # e.g. <bos>, as the model saw text in training
        prompts += [
            prefix + ids[i * step : i * step + cfg["prompt"]] for i in range(cfg["per_file"])
        ]
    llm = LLM(
        model=cfg["target"],
        dtype="bfloat16",
        seed=0,
        max_model_len=cfg["prompt"] + cfg["tokens"] + 16,
        gpu_memory_utilization=cfg["memory"],
        disable_log_stats=False,
        speculative_config={
            "model": cfg["draft"],
            "method": "draft_model",
            "num_speculative_tokens": 3,
        },
    )
    params = SamplingParams(temperature=0, max_tokens=cfg["tokens"], ignore_eos=True)
    before = spec_counters(llm)
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    print("ACCEPT " + json.dumps(acceptance(before, spec_counters(llm))), flush=True)


def packaged_importance(model: str) -> Path:
    from vllm_embed_plugin.tools import DATA_DIR

    path = DATA_DIR / "importance" / f"{model}.safetensors"
    if not path.exists():
        raise SystemExit(f"no packaged calibration file for {model!r}: pass --importance")
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "model", nargs="?", help="a real model name (smollm2, gemma3-270m) or a checkpoint"
    )
    ap.add_argument("--formats", default="off,int8,int4")
    ap.add_argument(
        "--importance",
        default="",
        help="calibration file for formats written FMT+file (default: the packaged one of "
        "the model, if any)",
    )
    ap.add_argument("--per-file", type=int, default=4, help="prompts per held-out file")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--memory", type=float, default=0.25, help="gpu_memory_utilization")
    ap.add_argument(
        "--target-too",
        action="store_true",
        help="convert the target as well as the drafter (default: the drafter alone)",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return 0
    if not args.model:
        ap.error("the model is required")
    from gpu_e2e import draft_alias, selfdraft_env

    from vllm_embed_plugin.tools import real_models

    target = Path(real_models.resolve(args.model))
    draft = draft_alias(target)
    cfg = dict(
        target=str(target),
        draft=str(draft),
        per_file=args.per_file,
        prompt=args.prompt,
        tokens=args.tokens,
        memory=args.memory,
    )
    results = {}
    for fmt in args.formats.split(","):
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_EMBED_")}
        name, _, extra = fmt.partition("+")
        env.update(selfdraft_env(name, draft, args.target_too))
        if extra == "file":
            env["VLLM_EMBED_IMPORTANCE"] = args.importance or str(packaged_importance(args.model))
        proc = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(cfg)],
            env=env,
            capture_output=True,
            text=True,
        )
        lines = [x for x in proc.stdout.splitlines() if x.startswith("ACCEPT ")]
        if proc.returncode or not lines:
            print(f"{fmt}: failed (rc={proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
            continue
        results[fmt] = json.loads(lines[-1][len("ACCEPT ") :])
        log = proc.stdout + proc.stderr
        converted = [x for x in log.splitlines() if "table ->" in x]
        r = results[fmt]
        print(
            f"{fmt}: accepted {r['accepted_tokens']} of {r['draft_tokens']} drafted "
            f"({r['rate']:.1%}), per position {r['accepted_per_position']}; "
            f"{len(converted)} table(s) converted",
            flush=True,
        )
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
