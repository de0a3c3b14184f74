"""Helpers for end-to-end tests."""

from __future__ import annotations

import json

from vllm_embed_plugin.probe import run_probe

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [100, 200, 300, 400], [5000, 17, 9, 33, 2], [77, 78, 79]]


def run_engine(out_dir, name, env, *args, timeout=900):
    """A real engine on random-weight token prompts (checkpoints without a tokenizer)."""
    return run_probe(out_dir, name, env, "--prompts", json.dumps(PROMPTS), *args, timeout=timeout)


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
