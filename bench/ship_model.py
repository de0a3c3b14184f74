"""Carry a real checkpoint to the offline GPU machine in parts that fit its 64 MiB transfer.

The device receives the checkout (and up to 64 MiB of ignored paths) per call and keeps /tmp
while warm, so a 270 MB model travels as a few parts, one per call, and is rebuilt there.
BF16 weights are split into their high and low bytes first: the high bytes (sign, exponent)
compress to about a third with xz, the low bytes hardly at all (SmolLM2: 269 MB -> 181 MB).

    python bench/ship_model.py pack ~/.cache/vllm-embed-plugin/models/smollm2 /tmp/parts \
        --first 22000000          # the first call also carries the 41 MB vLLM bundle
    # one device call per part: cp .smol/pN /tmp/parts/ (carry .smol)
    python3 bench/ship_model.py unpack /tmp/parts /tmp/smol/smollm2   # on the device

`unpack` checks every file's SHA-256 against the one `pack` recorded.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import sys
import tarfile
from pathlib import Path

import numpy as np

PART_BYTES = 62_000_000  # 64 MiB less the checkout (about 2.4 MB)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pack(model: Path, out: Path, first: int, size: int) -> None:
    buf = io.BytesIO()
    manifest = {}
    with tarfile.open(fileobj=buf, mode="w") as tar:

        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

        for path in sorted(p for p in model.iterdir() if p.is_file()):
            data = path.read_bytes()
            manifest[path.name] = sha256(data)
            if path.suffix == ".safetensors" and len(data) % 2 == 0:
                raw = np.frombuffer(data, np.uint8)
                add(path.name + ".hi.xz", lzma.compress(raw[1::2].tobytes(), preset=6))
                add(path.name + ".lo.xz", lzma.compress(raw[0::2].tobytes(), preset=0))
            else:
                add(path.name, data)
        add("manifest.json", json.dumps(manifest).encode())
    blob = buf.getvalue()
    out.mkdir(parents=True, exist_ok=True)
    bounds = [0, min(first or size, len(blob))]
    while bounds[-1] < len(blob):
        bounds.append(min(bounds[-1] + size, len(blob)))
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        (out / f"p{i}").write_bytes(blob[a:b])
        print(f"{out / f'p{i}'}: {b - a:,} B")
    print(f"{model.name}: {len(manifest)} files, {len(blob):,} B packed in {len(bounds) - 1} parts")


def unpack(parts: Path, dest: Path) -> None:
    names = sorted(parts.glob("p*"), key=lambda p: int(p.name[1:]))
    blob = b"".join(p.read_bytes() for p in names)
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    manifest = json.loads(files.pop("manifest.json"))
    for name, digest in manifest.items():
        if name in files:
            data = files[name]
        else:
            hi = np.frombuffer(lzma.decompress(files[name + ".hi.xz"]), np.uint8)
            lo = np.frombuffer(lzma.decompress(files[name + ".lo.xz"]), np.uint8)
            raw = np.empty(hi.size * 2, np.uint8)
            raw[0::2], raw[1::2] = lo, hi
            data = raw.tobytes()
        if sha256(data) != digest:
            raise SystemExit(f"{name}: SHA-256 differs from the packed file's")
        (dest / name).write_bytes(data)
    print(f"{dest}: {len(manifest)} files, SHA-256 checked")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="MODEL_DIR -> parts p0, p1, ... in OUT")
    p.add_argument("model", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--first", type=int, default=0, help="bytes of the first part (default: --size)")
    p.add_argument("--size", type=int, default=PART_BYTES, help="bytes of every other part")
    u = sub.add_parser("unpack", help="parts in PARTS -> the checkpoint in DEST")
    u.add_argument("parts", type=Path)
    u.add_argument("dest", type=Path)
    args = ap.parse_args()
    if args.cmd == "pack":
        pack(args.model.expanduser(), args.out, args.first, args.size)
    else:
        unpack(args.parts, args.dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
