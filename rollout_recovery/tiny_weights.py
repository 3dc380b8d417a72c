"""Random weights for the offline tiny models, the same bytes on every build: each tensor from
one seeded generator in sorted-name order (norms start at one), never from how a transformers
version happens to initialise its modules."""

from __future__ import annotations

from pathlib import Path


def write_seeded_weights(
    shapes: dict[str, tuple[int, ...]], seed: int, init_std: float, path: Path
) -> None:
    """Write `shapes`' tensors (float32, N(0, init_std), norms one) as one safetensors file."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name in sorted(shapes):
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shapes[name], dtype=torch.float32)
        else:
            tensors[name] = torch.randn(shapes[name], generator=gen, dtype=torch.float32) * init_std
    save_file(tensors, str(path), metadata={"format": "pt"})
