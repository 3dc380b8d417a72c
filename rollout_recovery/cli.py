"""`rollout-recovery`: the project's command line."""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
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

DEFAULT_CONFIG = "configs/grpo_tiny_cpu.yaml"
DEMO_PROMPT = "What is 2 + 3?"


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
    from rollout_recovery.tiny_model import build_tiny_model

    out = build_tiny_model(args.dir)
    print(f"tiny model written to {out}")
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollout-recovery",
        description="Crash-safe LLM RL rollouts: checkpoint in-flight vLLM generations on Ray.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "make-tiny-model",
        help="build the offline tiny Llama (same bytes every time) into DIR",
        description="Build a random-weight Llama with a locally trained byte-level BPE "
        "tokenizer and a chat template, loadable by vLLM and transformers.",
    )
    p.add_argument("dir", metavar="DIR", help="output directory")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    """Expected failures end in one line naming the cause and the fix: a configuration error
    exits 2; a refused restore, an existing run, a failed checkpoint write or an unusable
    checkpoint location exit 1. Nothing is deleted on any of them."""
    from rollout_recovery.errors import RecoveryError
    from rollout_recovery.storage import StorageError
    from rollout_recovery.training.checkpoint import TrainerCheckpointError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"rollout-recovery: {err}", file=sys.stderr)
        return 2
    except (RecoveryError, StorageError, TrainerCheckpointError) as err:
        print(f"rollout-recovery: {' '.join(str(err).split())}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
