"""What model produced a run's tokens: digests that a restore compares before loading anything.

A snapshot's in-flight calls were decoded by particular weights; continuing them with other
weights (another checkpoint of the same shape, say) would silently mix two policies in one
training sample. So every snapshot records

- `base`: the configured model (its path and a digest of its weights, config and tokenizer),
- `weight_version` and `weights_sha256`: the weights being served (a digest of the pushed
  tensors; None while the base weights are served),

and every trainer checkpoint records the digest of its model tensors. The digest is canonical:
sha256 over the tensors sorted by name, each as name, dtype, shape and raw bytes, read from
safetensors headers, so the same tensors give the same digest whichever file holds them.

`resolve_model_path` turns the configured `policy.model_path` into what vLLM and the trainer
load: the directory of the offline tiny model for `tiny://<name>`, a hub name for
`hf://<org>/<name>`, or the local directory as configured.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable
from pathlib import Path

from rollout_recovery.config import HUB_MODEL_SCHEME, TINY_MODEL_SCHEME

DOMAIN = b"rollout_recovery/weights/v1\x00"
_IDENTITY_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
_CACHE: dict[tuple, str] = {}


def _tensors(blob: memoryview, prefix: str) -> Iterable[tuple[str, str, list[int], memoryview]]:
    (size,) = struct.unpack("<Q", blob[:8])
    header = json.loads(bytes(blob[8 : 8 + size]))
    header.pop("__metadata__", None)
    base = 8 + size
    for name, info in header.items():
        if name.startswith(prefix):
            start, end = info["data_offsets"]
            yield name[len(prefix) :], info["dtype"], info["shape"], blob[base + start : base + end]


def weights_digest(blobs: Iterable[bytes | memoryview], prefix: str = "") -> str:
    """The canonical digest of the tensors (names starting with `prefix`, which is removed) in
    one or more safetensors files given as bytes."""
    tensors = sorted(
        (t for blob in blobs for t in _tensors(memoryview(blob), prefix)), key=lambda t: t[0]
    )
    if not tensors:
        raise ValueError("no tensors to digest")
    h = hashlib.sha256(DOMAIN)
    for name, dtype, shape, data in tensors:
        meta = json.dumps([name, dtype, shape]).encode()
        h.update(struct.pack("<Q", len(meta)) + meta)
        h.update(struct.pack("<Q", len(data)))
        h.update(data)
    return h.hexdigest()


def directory_weights_digest(model_dir: str | Path, cache: bool = False) -> str:
    """The digest of every *.safetensors file in a model directory. `cache`: for a model that
    does not change (the base model), remember it by file size and modification time, so a
    large model is read once per process."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    key = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    if not cache or key not in _CACHE:
        _CACHE[key] = weights_digest(f.read_bytes() for f in files)
    return _CACHE[key]


def base_model_identity(model_path: str, resolved_dir: str | None) -> dict:
    """{"path", "sha256"}: the configured model and a digest of its weights, config and
    tokenizer files. A hub model resolved on the serving node has no local files here; it is
    identified by its name only (sha256 None)."""
    if resolved_dir is None or not os.path.isdir(resolved_dir):
        return {"path": model_path, "sha256": None}
    h = hashlib.sha256(directory_weights_digest(resolved_dir, cache=True).encode())
    for name in _IDENTITY_FILES:
        f = Path(resolved_dir) / name
        if f.is_file():
            h.update(name.encode() + b"\x00" + hashlib.sha256(f.read_bytes()).digest())
    return {"path": model_path, "sha256": h.hexdigest()}


def resolve_model_path(model_path: str) -> str:
    """Turn a validated `policy.model_path` into something vLLM's `--model` accepts. The tiny
    model is built (once, cached) on the node that asks, so import its builder only then."""
    if model_path.startswith(TINY_MODEL_SCHEME):
        from rollout_recovery.tiny_model import ensure_tiny_model, tiny_spec

        return str(ensure_tiny_model(spec=tiny_spec(model_path.removeprefix(TINY_MODEL_SCHEME))))
    if model_path.startswith(HUB_MODEL_SCHEME):
        return model_path.removeprefix(HUB_MODEL_SCHEME)
    return model_path
