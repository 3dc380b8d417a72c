"""Shared by the benchmark scripts."""

from __future__ import annotations

import json
from pathlib import Path


def write_result(path: str, result: dict) -> None:
    """Write a benchmark's JSON result (creating the folder) and say where."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {path}")
