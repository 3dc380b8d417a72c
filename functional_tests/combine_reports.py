"""Merge per-level parity reports into one: `combine_reports.py DIR LEVEL...` reads
DIR/<level>/parity.json and writes DIR/parity.json (`levels`, and every violation prefixed
with its level)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(out: Path, levels: list[str]) -> None:
    reports, violations = {}, []
    for level in levels:
        path = out / level / "parity.json"
        if not path.exists():
            violations.append(f"[{level}] no report (the check stopped early; see its logs)")
            continue
        reports[level] = json.loads(path.read_text())
        violations += [f"[{level}] {v}" for v in reports[level]["violations"]]
    (out / "parity.json").write_text(json.dumps({"levels": reports, "violations": violations},
                                                indent=2))  # fmt: skip


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
