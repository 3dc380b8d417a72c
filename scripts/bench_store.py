"""Benchmark the StagingStore (and TransferQueue 0.1.11 on the same rows, when installed).

    .venv/bin/python scripts/bench_store.py --json bench_results/store.json

Measures put/get throughput for 1,000 rows x 4,096 tokens (ids + logprobs), snapshot and
restore time and throughput, the raw sequential write speed of the same disk in the same run
(write + fsync, interleaved with the snapshots), and the snapshot's size over its payload.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import ray

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench_common import write_result  # noqa: E402

from rollout_recovery.data_plane import (  # noqa: E402
    CHAIN_ROOT,
    ChunkRow,
    StagingStore,
    chain_digest,
    chunk_rows_to_table,
)


def make_rows(n_rows: int, n_tokens: int):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 150_000, (n_rows, n_tokens), dtype=np.int32)
    lps = -rng.random((n_rows, n_tokens), dtype=np.float32) * 5
    rows = [
        ChunkRow(
            key=f"rollout-{i:05d}/call-0/a0/c0",
            rollout_id=f"rollout-{i:05d}",
            model_call_id="call-0",
            attempt=0,
            chunk_seq=0,
            token_ids=ids[i],
            logprobs=lps[i],
            weight_version=0,
            prev_len=0,
            digest=chain_digest(CHAIN_ROOT, ids[i]),
        )
        for i in range(n_rows)
    ]
    return ids, lps, chunk_rows_to_table(rows)


def raw_write(path: Path, data: bytes) -> float:
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def bench_store(table, workdir: Path, repeats: int, shards: int) -> dict:
    payload = table.nbytes
    keys = table.column("key").to_pylist()
    store = StagingStore.create(num_shards=shards)
    store.put("rollout_staging", table)  # warm up actors and allocations
    put_s = timed(lambda: store.put("rollout_staging", table), repeats)
    got = {}

    def get():
        got["t"] = store.get("rollout_staging", keys)[0]

    get_s = timed(get, repeats)
    assert got["t"].equals(table), "get returned different rows"

    # Raw files stay until the end, like snapshot files: both then write into fresh page cache.
    blob = os.urandom(payload)
    snap_s, raw_s, uris = [], [], []
    for i in range(repeats):
        # Alternate which goes first so neither always meets the fresher page cache.
        if i % 2 == 0:
            raw_s.append(raw_write(workdir / f"raw-{i}.bin", blob))
        t = time.perf_counter()
        res = store.snapshot(str(workdir / "snaps"))
        snap_s.append(time.perf_counter() - t)
        uris.append(res.uri)
        if i % 2 == 1:
            raw_s.append(raw_write(workdir / f"raw-{i}.bin", blob))
    files_bytes = res.manifest.body.payload_bytes

    restore_s, fresh_stores = [], []
    for uri in uris:
        # Stores are killed only at the end: a dying actor's teardown would share the CPU.
        fresh = StagingStore.create(num_shards=shards)
        fresh_stores.append(fresh)
        t = time.perf_counter()
        fresh.restore(uri)
        restore_s.append(time.perf_counter() - t)
        check = fresh.get("rollout_staging", keys[:5])[0]
        assert check.equals(table.slice(0, 5)), "restore returned different rows"
    for s in [store, *fresh_stores]:
        s.shutdown()
    med = statistics.median
    return {
        "shards": shards,
        "payload_bytes": payload,
        "put_s": med(put_s),
        "get_s": med(get_s),
        "snapshot_s": med(snap_s),
        "restore_s": med(restore_s),
        "raw_write_s": med(raw_s),
        "snapshot_file_bytes": files_bytes,
        "samples": {"put": put_s, "get": get_s, "snapshot": snap_s, "restore": restore_s,
                    "raw_write": raw_s},
    }  # fmt: skip


def bench_transferqueue(ids, lps, workdir: Path, repeats: int) -> dict | None:
    """TransferQueue's put/get (whole-batch puts) and its checkpoint save/load.

    Save/load use a second instance filled one row per put: with whole-batch puts its
    checkpoint pickles every row together with the whole batch buffer (~1,000x the payload
    here), which does not finish. Only one TransferQueue instance can be open at a time.
    """
    try:
        from transferqueue_baseline import TransferQueueBaseline

        tq = TransferQueueBaseline(put_chunk_rows=None)
    except ImportError as err:
        print(f"[bench] TransferQueue baseline skipped: {err}", file=sys.stderr)
        return None
    payload = ids.nbytes + lps.nbytes
    put_s = timed(lambda: tq.put(ids, lps), 1)
    out = {}
    get_s = timed(lambda: out.__setitem__("r", tq.get()), repeats)
    assert np.array_equal(out["r"][0], ids) and np.array_equal(out["r"][1], lps)
    put_s += timed(lambda: tq.put(ids, lps), repeats - 1)  # more rows under new keys
    tq.close()

    tq = TransferQueueBaseline(put_chunk_rows=1)
    tq.put(ids, lps)
    save_s, saved = [], 0
    for i in range(repeats):
        t = time.perf_counter()
        saved = tq.save(str(workdir / f"tq-{i}"))
        save_s.append(time.perf_counter() - t)
    tq.close()
    load_s = []
    for i in range(min(repeats, 3)):  # each load needs a fresh instance (~6 s to start)
        fresh = TransferQueueBaseline()
        t = time.perf_counter()
        fresh.load(str(workdir / f"tq-{i}"))
        load_s.append(time.perf_counter() - t)
        if i == 0:
            got = fresh.get()
            assert np.array_equal(got[0], ids), "TransferQueue load returned different rows"
        fresh.close()
    med = statistics.median
    return {
        "payload_bytes": payload,
        "put_s": med(put_s),
        "get_s": med(get_s),
        "save_s": med(save_s),
        "load_s": med(load_s),
        "save_bytes": saved,
        "samples": {"put": put_s, "get": get_s, "save": save_s, "load": load_s},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True, help="where to write the results")
    ap.add_argument("--rows", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--dir", default=None, help="scratch directory on the disk to measure")
    ap.add_argument("--no-transferqueue", action="store_true")
    args = ap.parse_args()

    sys.path.insert(0, str(REPO / "scripts"))
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    workdir = Path(tempfile.mkdtemp(prefix="bench-store-", dir=args.dir))
    try:
        ids, lps, table = make_rows(args.rows, args.tokens)
        tokens = args.rows * args.tokens
        ours = bench_store(table, workdir, args.repeats, args.shards)
        tq = None if args.no_transferqueue else bench_transferqueue(ids, lps, workdir, args.repeats)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        ray.shutdown()

    gbs = lambda b, s: b / s / 1e9  # noqa: E731
    p = ours["payload_bytes"]
    rows = [
        ("put", gbs(p, ours["put_s"]), args.rows / ours["put_s"], tokens / ours["put_s"]),
        ("get", gbs(p, ours["get_s"]), args.rows / ours["get_s"], tokens / ours["get_s"]),
        ("snapshot (fsync)", gbs(ours["snapshot_file_bytes"], ours["snapshot_s"]), None, None),
        ("restore (verified)", gbs(ours["snapshot_file_bytes"], ours["restore_s"]), None, None),
        ("raw disk write+fsync", gbs(p, ours["raw_write_s"]), None, None),
    ]
    summary = {
        "put_gbps": rows[0][1],
        "get_gbps": rows[1][1],
        "snapshot_gbps": rows[2][1],
        "restore_gbps": rows[3][1],
        "raw_write_gbps": rows[4][1],
        "snapshot_over_raw": rows[2][1] / rows[4][1],
        "snapshot_bytes_over_payload": ours["snapshot_file_bytes"] / p,
        "put_rows_per_s": rows[0][2],
        "put_tokens_per_s": rows[0][3],
        "get_rows_per_s": rows[1][2],
        "get_tokens_per_s": rows[1][3],
    }
    print(f"\nStagingStore, {args.rows} rows x {args.tokens} tokens, {p / 1e6:.1f} MB payload, "
          f"{args.shards} shard(s), median of {args.repeats}")  # fmt: skip
    print(f"{'operation':<22}{'GB/s':>8}{'rows/s':>12}{'tokens/s':>14}{'seconds':>10}")
    secs = [
        ours["put_s"],
        ours["get_s"],
        ours["snapshot_s"],
        ours["restore_s"],
        ours["raw_write_s"],
    ]
    for (name, g, r, t), s in zip(rows, secs, strict=True):
        rs = f"{r:,.0f}" if r else "-"
        ts = f"{t:,.0f}" if t else "-"
        print(f"{name:<22}{g:>8.2f}{rs:>12}{ts:>14}{s:>10.4f}")
    print(f"snapshot / raw write speed: {summary['snapshot_over_raw']:.2f}")
    print(f"snapshot bytes / payload:   {summary['snapshot_bytes_over_payload']:.3f}")
    if tq:
        tp = tq["payload_bytes"]
        summary |= {
            "tq_put_gbps": gbs(tp, tq["put_s"]),
            "tq_get_gbps": gbs(tp, tq["get_s"]),
            "tq_save_gbps": gbs(tp, tq["save_s"]),
            "tq_load_gbps": gbs(tp, tq["load_s"]),
        }
        print("\nTransferQueue 0.1.11 on the same rows (ours / theirs)")
        print(f"{'operation':<22}{'ours GB/s':>10}{'TQ GB/s':>10}{'ratio':>8}")
        for name, a, b in [
            ("put", summary["put_gbps"], summary["tq_put_gbps"]),
            ("get", summary["get_gbps"], summary["tq_get_gbps"]),
            ("snapshot vs save", summary["snapshot_gbps"], summary["tq_save_gbps"]),
            ("restore vs load", summary["restore_gbps"], summary["tq_load_gbps"]),
        ]:
            summary[f"ratio_{name.split()[0]}"] = a / b
            print(f"{name:<22}{a:>10.2f}{b:>10.2f}{a / b:>8.2f}")
    result = {"args": vars(args), "summary": summary, "store": ours, "transferqueue": tq}
    write_result(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
