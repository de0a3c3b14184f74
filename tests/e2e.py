"""Helpers for end-to-end tests: write checkpoints once, run real engines in subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [100, 200, 300, 400], [5000, 17, 9, 33, 2], [77, 78, 79]]


@dataclass
class EngineRun:
    returncode: int
    log: str
    result: dict | None

    def tables(self, model: str = "target", rank: int = 0) -> dict[str, dict]:
        report = self.result["workers"][rank][model]
        return {t["name"]: t for t in report["tables"]}

    def embedding(self, model: str = "target", rank: int = 0) -> dict:
        return next(t for t in self.tables(model, rank).values() if t["kind"] == "embedding")


def run_engine(out_dir: Path, name: str, env: dict[str, str], *args: str, timeout: int = 900) -> EngineRun:
    out = out_dir / f"{name}.json"
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_EMBED_")}
    full_env.update(env)
    full_env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.engine_runner", str(out), "--prompts", json.dumps(PROMPTS), *args],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    log = proc.stdout + proc.stderr
    (out_dir / f"{name}.log").write_text(log)
    result = json.loads(out.read_text()) if proc.returncode == 0 and out.exists() else None
    return EngineRun(proc.returncode, log, result)


def greedy_close(reference: dict, candidate: dict) -> list[str]:
    """Problems found comparing two greedy runs: the first token must match, and where the
    sequences part, the candidate's token must be among the reference's top 5 at that step
    (a near tie of the reference, not a different model)."""
    problems = []
    for i, (ref, got) in enumerate(zip(reference["tokens"], candidate["tokens"])):
        if ref[0] != got[0]:
            problems.append(f"prompt {i}: first token {got[0]} != {ref[0]}")
            continue
        split = next((k for k, (a, b) in enumerate(zip(ref, got)) if a != b), None)
        if split is not None and got[split] not in reference["top5"][i][split]:
            problems.append(f"prompt {i}: step {split} token {got[split]} not in reference top 5")
    return problems
