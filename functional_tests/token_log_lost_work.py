"""Work lost to a whole-job crash with the token log off and on, measured side by side.

Runs the prefix recovery check (recovery_check.py: reference, SIGKILL of the whole job at a
random moment after a snapshot, restore, parity and engine evidence) twice with the same kill
seed: once as configured, once with `token_capture.log_interval_tokens=K`. With the token log
on, the restore takes each call in flight from the newer of its snapshot cut and its token log
(controller/token_log_restore.py), and the check verifies against the engines' records that each
such call resumed from exactly the logged prefix. Work lost is what the engines decoded
before the kill and decoded again after the restore (docs/evidence.md).

    .venv/bin/python functional_tests/token_log_lost_work.py --out DIR [--token-log-tokens 16]
        [--interval 1] [--seed 7] [--kills 2] [--max-tokens 768] [recovery_check options ...]

Writes DIR/lost_work.json and prints the table. Exit 1 when either check fails.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CHECK = Path(__file__).resolve().parent / "recovery_check.py"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--token-log-tokens", type=int, default=16, help="K")
    ap.add_argument("--interval", type=float, default=1.0, help="snapshot interval (s)")
    ap.add_argument("--seed", type=int, default=7, help="kill delays (the same for both)")
    ap.add_argument("--kills", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=768, help="per call: long enough that "
                    "a step spans several snapshots")  # fmt: skip
    args, rest = ap.parse_known_args()
    common = ["--level", "prefix", "--interval", str(args.interval), "--seed", str(args.seed),
              "--kills", str(args.kills), "--max-tokens", str(args.max_tokens), *rest]  # fmt: skip
    runs = {
        "off": [],
        "on": [f"token_capture.log_interval_tokens={args.token_log_tokens}"],
    }
    rows, failed = {}, []
    for name, extra in runs.items():
        out = args.out / name
        proc = subprocess.run([sys.executable, str(CHECK), "--out", str(out), *common, *extra],
                              capture_output=True, text=True, check=False)  # fmt: skip
        (args.out / f"{name}.txt").parent.mkdir(parents=True, exist_ok=True)
        (args.out / f"{name}.txt").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            failed.append(name)
        report = (
            json.loads((out / "parity.json").read_text()) if (out / "parity.json").exists() else {}
        )
        lost = report.get("lost_work", [])
        rows[name] = {
            "passed": proc.returncode == 0,
            "lost_tokens": sum(lw.get("prefix", 0) for lw in lost),
            "lost_tokens_level_none": sum(lw.get("none", 0) for lw in lost),
            "decoded_before_crash": sum(lw.get("decoded_before_crash", 0) for lw in lost),
            "calls_in_flight_cut": sum(
                k.get("recoverable_cuts", 0) for k in report.get("kills", [])
            ),
            "token_log_extended_calls": sum(
                len(k.get("token_log", {})) for k in report.get("kills", [])
            ),
            "kills": len(lost),
        }
    body = {"token_log_tokens": args.token_log_tokens, "interval_s": args.interval,
            "seed": args.seed, "runs": rows}  # fmt: skip
    (args.out / "lost_work.json").write_text(json.dumps(body, indent=1))
    print(
        f"work lost to {args.kills} whole-job kills, snapshot every {args.interval} s, "
        f"token log every {args.token_log_tokens} tokens ({args.out}/lost_work.json)"
    )
    cols = ("passed", "kills", "decoded_before_crash", "lost_tokens", "lost_tokens_level_none",
            "token_log_extended_calls")  # fmt: skip
    print("token log  " + "  ".join(cols))
    for name, row in rows.items():
        print(f"{name:7}  " + "  ".join(str(row[c]) for c in cols))
    for name in failed:
        print(f"FAIL: the {name} check failed; see {args.out}/{name}.txt")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
