"""`calibrate --engine vllm`: M measured inside a real vLLM engine (CPU backend) agrees with the
transformers path on the same windows."""

import subprocess
import sys

import pytest

from tests.checkpoints import write_tokenized_checkpoint
from vllm_embed_plugin import importance
from vllm_embed_plugin.tools import calibrate

pytestmark = pytest.mark.e2e


def test_vllm_engine_measures_the_same_second_moment(tmp_path):
    text = calibrate.default_corpus().read_text(encoding="utf-8")
    model = write_tokenized_checkpoint(tmp_path / "model", text)
    out = tmp_path / "m.safetensors"
    # Windows of 128 tokens prefilled in chunks of 48 tokens: chunked prefill must count each
    # token once. float32, so the two paths differ by float32 rounding only (in BF16, vLLM's
    # own dtype by default, they differed by 3.3e-3 on this model).
    args = ["calibrate", str(model), "--engine", "vllm", "--window", "128", "--positions", "512",
            "--dtype", "float32", "--max-num-batched-tokens", "48", "--out", str(out)]  # fmt: skip
    run = subprocess.run(
        [sys.executable, "-m", "vllm_embed_plugin.tools.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert "calibrate: 4 windows of 128 tokens, 512 positions" in run.stderr
    assert "Processed prompts" in run.stderr  # vLLM's progress bar
    assert f"VLLM_EMBED_IMPORTANCE={out}" in run.stdout
    meta = importance.read_meta(out)
    assert meta["engine"] == "vllm" and meta["positions"] == 512 and meta["cols"] == 256
    assert meta["tied"] is True and meta["rows"] == 512

    ours = importance.read(out)
    assert ours.input_fisher is None  # vLLM runs no backward pass
    ours = ours.second_moment
    theirs, _, _ = calibrate.measure(model, text, window=128, max_positions=512)
    error = ((ours - theirs).norm() / theirs.norm()).item()
    assert error < 1e-4, error
    # Not a trivially equal pair: the windows matter.
    other, _, _ = calibrate.measure(model, text[: len(text) // 3], window=128, max_positions=512)
    assert ((other - theirs).norm() / theirs.norm()).item() > 1e-2
