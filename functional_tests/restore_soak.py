"""Repeat the prefix check's restore under the suite's concurrent load, and count hangs.

    .venv/bin/python functional_tests/restore_soak.py --out DIR [--repeats 20]
        [--load turn,gateway] [--restore-timeout 600] [--kept DIR] [--pythonpath DIR] [--json F]

1. the kept run: the functional suite's prefix check (tests/functional's PREFIX and SMALL
   arguments: the notes agent, two SIGKILLs, the token log on), once, unless --kept names one
   already made (a check's --out with its saved/ state);
2. the load: the suite's checks that run beside the prefix check (--load; default the turn
   check on S3 and the gateway check), each started again whenever it ends, until the restores
   are done;
3. the restores: `recovery_check.py --from-kill KEPT` --repeats times, one after another,
   each given --restore-timeout s: the killed run's last phase (`train --restore` to the end)
   and the parity and engine-evidence checks on it.

Each restore is `passed`, `failed` (its one line), or `hung` (past its time: killed with every
process carrying its mark, functional_tests/processes.py). `--pythonpath DIR` runs the
restores' package from DIR (e.g. a worktree of an older commit) to see whether a change fixed
a hang. Prints a table and the totals; writes them to --json; exits 1 if any restore did not
pass.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from processes import MARK_ENV, kill_marked  # noqa: E402

CHECK = REPO / "functional_tests" / "recovery_check.py"


def suite_args() -> dict[str, list[str]]:
    """The functional suite's check arguments (tests/functional/test_recovery_functional.py),
    so the soak runs exactly what the suite runs."""
    path = REPO / "tests" / "functional" / "test_recovery_functional.py"
    spec = importlib.util.spec_from_file_location("suite_functional", path)
    suite = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite)
    return {name: [*args, *suite.SMALL] for name, args in suite.RUNS.items()
            if name not in suite.SCRIPTS}  # fmt: skip


class Job:
    """One check process with a mark of its own (everything it starts carries it)."""

    def __init__(self, name: str, args: list[str], out: Path, env: dict | None = None) -> None:
        self.name, self.out = name, out
        self.mark = f"soak-{name}-{secrets.token_hex(4)}"
        self.log = out.with_suffix(".log")
        self.t0 = time.monotonic()
        with open(self.log, "w") as fh:
            self.proc = subprocess.Popen(
                [sys.executable, str(CHECK), "--out", str(out), *args],
                stdout=fh, stderr=subprocess.STDOUT, cwd=REPO,
                env=os.environ | (env or {}) | {MARK_ENV: self.mark},
            )  # fmt: skip

    def wait(self, timeout: float | None = None) -> str:
        """passed, failed or hung (then killed with everything it started)."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_marked(self.mark)
            self.proc.wait()
            return "hung"
        return "passed" if code == 0 else "failed"

    def stop(self) -> None:
        kill_marked(self.mark)
        self.proc.wait()

    def last_line(self) -> str:
        lines = [ln for ln in self.log.read_text(errors="replace").splitlines() if ln.strip()]
        return lines[-1][-240:] if lines else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--load", default="turn,gateway", help="suite checks run beside ('' none)")
    ap.add_argument("--restore-timeout", type=float, default=600)
    ap.add_argument("--kept", type=Path, help="a prefix check's --out to restore again")
    ap.add_argument("--pythonpath", help="run the restores' package from this directory")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs = suite_args()
    t0 = time.monotonic()
    kept = args.kept
    if kept is None:
        kept = args.out / "kept"
        print(f"[soak] the kept run: the prefix check into {kept}", flush=True)
        job = Job("kept", runs["prefix"], kept)
        if job.wait(timeout=1500) != "passed":
            sys.exit(f"FAIL: the prefix check that makes the kept run failed: {job.last_line()}")
    load_names = [n for n in args.load.split(",") if n]
    load: dict[str, Job] = {}
    load_rounds = {n: 0 for n in load_names}

    def keep_loading() -> None:
        for name in load_names:
            if name not in load or load[name].proc.poll() is not None:
                load_rounds[name] += 1
                load[name] = Job(name, runs[name], args.out / f"load-{name}-{load_rounds[name]}")

    env = {"PYTHONPATH": args.pythonpath} if args.pythonpath else None
    rows = []
    try:
        for i in range(1, args.repeats + 1):
            keep_loading()
            out = args.out / f"restore-{i:02d}"
            job = Job(f"restore{i}", ["--from-kill", str(kept), *runs["prefix"]], out, env)
            while job.proc.poll() is None and time.monotonic() - job.t0 < args.restore_timeout:
                keep_loading()
                time.sleep(1)
            outcome = job.wait(timeout=0.1)
            row = {"restore": i, "outcome": outcome, "wall_s": round(time.monotonic() - job.t0, 1),
                   "load": sorted(n for n, j in load.items() if j.proc.poll() is None),
                   "line": "" if outcome == "passed" else job.last_line()}  # fmt: skip
            rows.append(row)
            print(f"[soak] restore {i:2d}: {outcome:6s} {row['wall_s']:6.1f} s  "
                  f"beside {','.join(row['load']) or '-'}  {row['line']}", flush=True)  # fmt: skip
    finally:
        for job in load.values():
            job.stop()
    totals = {o: sum(r["outcome"] == o for r in rows) for o in ("passed", "failed", "hung")}
    walls = sorted(r["wall_s"] for r in rows)
    result = {"repeats": args.repeats, "kept": str(kept), "load": load_names,
              "load_rounds": load_rounds, "pythonpath": args.pythonpath,
              "restore_timeout_s": args.restore_timeout, **totals,
              "wall_s_median": walls[len(walls) // 2] if walls else None,
              "wall_s_max": walls[-1] if walls else None,
              "soak_s": round(time.monotonic() - t0, 1), "restores": rows}  # fmt: skip
    print(f"[soak] {args.repeats} restores beside {load_names}: {totals['passed']} passed, "
          f"{totals['failed']} failed, {totals['hung']} hung; wall median "
          f"{result['wall_s_median']} s, max {result['wall_s_max']} s; load checks run "
          f"{load_rounds}; {result['soak_s']:.0f} s in all")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if totals["passed"] == args.repeats else 1


if __name__ == "__main__":
    sys.exit(main())
