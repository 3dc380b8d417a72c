"""Crash-consistency campaign (issue 13): damage every file of a real snapshot, restore, and
count how each case ended. Silent corruption must be 0; the exit status is 1 otherwise.

    python scripts/crash_campaign.py --json /tmp/campaign.json          # reduced (CI)
    python scripts/crash_campaign.py --json /tmp/campaign.json --full   # every data byte too

The reduced campaign runs every byte prefix of every file and a bit flip at every byte of the
manifest and sidecars, but only 64 evenly spread bit flips per data file; `--full` flips a
bit at every byte of the data files as well.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout_recovery.campaign.snapshot_files import (
    PARTITIONS,
    build_history,
    run_campaign,
    store_restorer,
    write_json,
)
from rollout_recovery.data_plane import StagingStore
from rollout_recovery.runtime import init_ray

REDUCED_DATA_FLIPS = 64


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="where to write the result")
    parser.add_argument("--full", action="store_true", help="flip a bit at every data byte")
    args = parser.parse_args()
    logging.getLogger("rollout_recovery").setLevel(logging.ERROR)
    init_ray("local", num_cpus=2, log_to_driver=False)
    store = StagingStore.create(num_shards=2, partitions=PARTITIONS)
    try:
        with tempfile.TemporaryDirectory(prefix="crash-campaign-") as tmp:
            history = build_history(store, str(Path(tmp) / "snapshots"))
            result = run_campaign(
                history,
                store_restorer(store),
                data_flips=None if args.full else REDUCED_DATA_FLIPS,
            )
    finally:
        store.shutdown()
    mode = "full" if args.full else f"reduced ({REDUCED_DATA_FLIPS} flips per data file)"
    print(f"snapshot-file campaign, {mode}")
    print(result.table())
    write_json(result, args.json)
    for item in result.silent:
        print(f"SILENT CORRUPTION: {item['case']}: {item['detail']}", file=sys.stderr)
    return 1 if result.silent_corruption else 0


if __name__ == "__main__":
    sys.exit(main())
