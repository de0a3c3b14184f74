"""Helpers for end-to-end tests."""

from __future__ import annotations

import json

from vllm_embed_plugin.tools.probe import greedy_close, run_probe  # noqa: F401 (used by tests)

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [100, 200, 300, 400], [5000, 17, 9, 33, 2], [77, 78, 79]]


def run_engine(out_dir, name, env, *args, timeout=900):
    """A real engine on random-weight token prompts (checkpoints without a tokenizer)."""
    return run_probe(out_dir, name, env, "--prompts", json.dumps(PROMPTS), *args, timeout=timeout)
