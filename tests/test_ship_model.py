"""bench/ship_model.py: a checkpoint packed into parts comes back byte for byte, and a damaged
part is caught."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

_spec = importlib.util.spec_from_file_location(
    "ship_model", Path(__file__).resolve().parents[1] / "bench" / "ship_model.py"
)
ship_model = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ship_model)


def fake_checkpoint(root: Path) -> Path:
    model = root / "model"
    model.mkdir()
    weights = np.random.default_rng(0).standard_normal(50_000).astype(np.float32)
    bf16 = (weights.view(np.uint32) >> 16).astype(np.uint16)  # BF16 bit patterns
    (model / "model.safetensors").write_bytes(b"\x08" + b"\0" * 7 + b"{}      " + bf16.tobytes())
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    return model


def test_pack_then_unpack_gives_the_same_files(tmp_path):
    model = fake_checkpoint(tmp_path)
    ship_model.pack(model, tmp_path / "parts", first=5_000, size=20_000)
    parts = sorted((tmp_path / "parts").iterdir())
    assert len(parts) > 2 and parts[0].stat().st_size == 5_000
    ship_model.unpack(tmp_path / "parts", tmp_path / "out")
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (model / name).read_bytes()


def test_a_damaged_part_is_caught(tmp_path):
    model = fake_checkpoint(tmp_path)
    ship_model.pack(model, tmp_path / "parts", first=0, size=1 << 20)
    part = tmp_path / "parts" / "p0"
    blob = bytearray(part.read_bytes())
    i = blob.index(b'{"architectures"')
    blob[i + 3] ^= 1  # config.json travels uncompressed: flip one bit of it
    part.write_bytes(bytes(blob))
    with pytest.raises(SystemExit, match="config.json: SHA-256 differs"):
        ship_model.unpack(tmp_path / "parts", tmp_path / "out")
