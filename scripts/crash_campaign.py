"""Crash-consistency campaign (issue 13): attack the snapshot files byte by byte, and crash a
real job at every named crash point, then restore it and check what recovery promised.

    python scripts/crash_campaign.py --json /tmp/campaign.json          # reduced (CI)
    python scripts/crash_campaign.py --json /tmp/campaign.json --full   # everything

Snapshot files (rollout_recovery/testing/campaign/snapshot_files.py): every byte prefix of
every file and a bit flip at every byte of the manifest, the sidecars and the ownership log;
data files get 64 evenly spread flips each (reduced) or one at every byte (`--full`). Outcome
per case: restored exactly, or refused and fell back saying why; silent corruption must be 0.

Crash points (rollout_recovery/testing/campaign/crash_points.py): a traced reference run of a
small prefix-level GRPO job, then cases that SIGKILL the job at a crash point, restore it,
finish it and check parity, exactly-once training, the engines' resume records and orphaned
files.
Reduced: three crashes in a row in one run under simulated power loss. `--full`: every point
alone, every point under power loss, and two runs of three crashes in a row.

Prints both tables and a summary (cases by class, restored exactly, refused safely, silent
corruption, rollouts lost, trained twice, time taken), writes them to --json, and exits 1 on
silent corruption or any crash-point violation.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_recovery import crashpoints
from rollout_recovery.testing.campaign.crash_points import CHAINS, run_crash_campaign
from rollout_recovery.testing.campaign.snapshot_files import (
    PARTITIONS,
    build_history,
    run_campaign,
    store_restorer,
)

REDUCED_DATA_FLIPS = 64


def snapshot_file_campaign(full: bool) -> dict:
    import ray

    from rollout_recovery.data_plane import StagingStore
    from rollout_recovery.runtime import init_ray

    init_ray("local", num_cpus=2, log_to_driver=False)
    store = StagingStore.create(num_shards=2, partitions=PARTITIONS)
    try:
        with tempfile.TemporaryDirectory(prefix="crash-campaign-") as tmp:
            history = build_history(store, str(Path(tmp) / "snapshots"))
            result = run_campaign(history, store_restorer(store),
                                  data_flips=None if full else REDUCED_DATA_FLIPS)  # fmt: skip
    finally:
        store.shutdown()
        ray.shutdown()
    mode = "full" if full else f"reduced ({REDUCED_DATA_FLIPS} flips per data file)"
    print(f"snapshot-file campaign, {mode}")
    print(result.table(), flush=True)
    for item in result.silent:
        print(f"SILENT CORRUPTION: {item['case']}: {item['detail']}", file=sys.stderr)
    return result.to_json()


def crash_point_campaign(full: bool, points: list[str] | None, workdir: Path, parallel: int):
    def progress(case) -> None:
        print(f"  {case.case}: {case.outcome} in {case.seconds:.0f}s", flush=True)
        for v in case.violations:
            print(f"    {v}", flush=True)

    if points is not None:
        chains, power_loss = [], True
    elif full:
        points, chains, power_loss = list(crashpoints.POINTS), list(CHAINS), True
    else:
        points, chains, power_loss = [], [CHAINS[0]], True
    print(f"crash-point campaign ({'full' if full else 'reduced'}) in {workdir}", flush=True)
    result = run_crash_campaign(workdir, points, power_loss, chains, parallel, progress,
                                reference_alongside=not full)  # fmt: skip
    print(result.table())
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="where to write the result")
    parser.add_argument("--full", action="store_true", help="the whole campaign")
    parser.add_argument("--only", choices=("files", "points"), help="run one campaign only")
    parser.add_argument("--points", help="crash points to run (comma-separated), each alone "
                        "and under power loss")  # fmt: skip
    parser.add_argument("--parallel", type=int, default=1, help="crash cases run at a time")
    parser.add_argument("--workdir", help="keep the crash runs here (default: a temporary "
                        "directory, kept only when a case fails)")  # fmt: skip
    args = parser.parse_args()
    logging.getLogger("rollout_recovery").setLevel(logging.ERROR)
    t0 = time.monotonic()
    out: dict = {"mode": "full" if args.full else "reduced"}
    failed = False
    if args.only != "points":
        files = snapshot_file_campaign(args.full)
        out["snapshot_files"] = files
        failed |= files["silent_corruption"] > 0
    if args.only != "files":
        points = args.points.split(",") if args.points else None
        for p in points or []:
            crashpoints.parse(p)  # an unknown name fails here, before any run
        workdir = Path(args.workdir or tempfile.mkdtemp(prefix="crash-points-"))
        workdir.mkdir(parents=True, exist_ok=True)
        result = crash_point_campaign(args.full, points, workdir, args.parallel)
        out["crash_points"] = result.to_json()
        bad = result.summary()["violations"] + result.summary()["not_reached"]
        failed |= bad > 0
        if bad == 0 and not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        elif bad:
            print(f"the failed cases' runs are kept in {workdir}", file=sys.stderr)
    out["seconds"] = round(time.monotonic() - t0, 1)
    out["summary"] = summary(out)
    print(json.dumps(out["summary"], indent=1))
    Path(args.json).write_text(json.dumps(out, indent=1))
    return 1 if failed else 0


def summary(out: dict) -> dict:
    """The campaign's headline figures, both parts together."""
    files = out.get("snapshot_files", {})
    points = out.get("crash_points", {}).get("summary", {})
    by_class = {k: sum(v.values()) for k, v in files.get("by_class", {}).items()}
    return {
        "cases_by_class": by_class | points.get("by_kind", {}),
        "restored_exactly": files.get("restored_exact", 0) + points.get("recovered_exact", 0),
        "refused_safely": files.get("refused_safely", 0) + files.get("refused_no_fallback", 0),
        "silent_corruption": files.get("silent_corruption", 0) + points.get("silent_corruption", 0),
        "crash_point_violations": points.get("violations", 0) + points.get("not_reached", 0),
        "rollouts_lost": points.get("rollouts_lost", 0),
        "trained_twice": points.get("trained_twice", 0),
        "committed_turns_decoded_again": points.get("committed_decoded_again", 0),
        "seconds": out["seconds"],
    }


if __name__ == "__main__":
    sys.exit(main())
