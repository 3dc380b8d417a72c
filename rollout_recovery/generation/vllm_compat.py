"""Every read or write of vLLM state that is not public API is in this file.

Upgrading vLLM starts here. Cutting and resuming in-flight calls needs vLLM 0.32's frontend
state (what a resume needs: docs/design.md §8), none of which vLLM promises to keep, so all of
it sits behind one gate and one table:

- `check_supported()` is the one gate: the vLLM series this file was written against, and a
  Python with the GIL (progress reads copy vLLM's append-only lists outside the engine's
  lock). The engine host calls it before it builds an engine.
- `PRIVATE_SURFACE` lists every private attribute touched here; `missing_attributes()` checks
  them on a live engine (tests/engine/test_vllm_compat.py), so an upgrade fails in one place
  with one message.
- One named function per hook or read (`hook_output_processor`, `wrap_generate`,
  `install_parent_death_signal`, `RequestProgress`, `primed_state`, ...). The installers
  refuse a vLLM without what they hook with `VllmMismatch`, naming the attribute and the
  supported series; the per-step reads stay bare and rely on the table's test.
  `install_engine_hooks` is the entry point that installs the hooks on a built engine, in
  their one order.

vLLM is imported inside functions only: the driver imports this module without vLLM.
Public API (`AsyncLLM.generate/abort/pause_generation/check_health/shutdown`, `SamplingParams`,
`vllm.outputs`, the OpenAI app launchers) is used where it is needed, not here.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import importlib
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, NamedTuple, Protocol

import numpy as np

SUPPORTED_VLLM_SERIES = "0.32."


class VllmMismatch(RuntimeError):
    """The installed vLLM (or Python) is not what this file was written against."""


# ---------------------------------------------------------------------------- the gate


def check_supported(version: str | None = None, gil_enabled: bool | None = None) -> str:
    """The installed vLLM's version, once it is in the supported series and the GIL is on;
    `VllmMismatch` otherwise. `version` and `gil_enabled` default to the running ones."""
    if version is None:
        import vllm

        version = vllm.__version__
    if not version.startswith(SUPPORTED_VLLM_SERIES):
        raise VllmMismatch(
            f"rollout_recovery reads vLLM {SUPPORTED_VLLM_SERIES}x private state; found vLLM "
            f"{version}. Install the pinned version (scripts/setup.sh, or the `gpu` extra); "
            "porting to another vLLM starts in rollout_recovery/generation/vllm_compat.py"
        )
    if gil_enabled is None:
        gil_enabled = getattr(sys, "_is_gil_enabled", lambda: True)()
    if not gil_enabled:
        raise VllmMismatch(
            "rollout_recovery needs a Python with the GIL: progress reads copy vLLM's "
            "append-only token and logprob lists outside the engine's lock; run a standard "
            "CPython build"
        )
    return version


def _mismatch(owner: str, attribute: str) -> VllmMismatch:
    version = getattr(sys.modules.get("vllm"), "__version__", "unknown")
    return VllmMismatch(
        f"vLLM {version} has no {owner}.{attribute}, which rollout_recovery needs "
        f"(written for vLLM {SUPPORTED_VLLM_SERIES}x; see generation/vllm_compat.py)"
    )


def _require(obj: Any, owner: str, attribute: str) -> Any:
    try:
        return getattr(obj, attribute)
    except AttributeError:
        raise _mismatch(owner, attribute) from None


def _import(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise _mismatch(module, name) from None


# ---------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Touch:
    """One private vLLM attribute this file reads, writes or calls, and what for."""

    owner: str
    attribute: str
    use: str


PRIVATE_SURFACE: tuple[Touch, ...] = (
    Touch("AsyncLLM", "output_processor", "hook_output_processor, output_tokenizer"),
    Touch("AsyncLLM", "output_handler", "cancel_output_handler (shutdown)"),
    Touch("AsyncLLM", "generate", "wrap_generate replaces it on the instance"),
    Touch("OutputProcessor", "add_request", "hook_output_processor"),
    Touch("OutputProcessor", "process_outputs", "hook_output_processor"),
    Touch("OutputProcessor", "abort_requests", "hook_output_processor"),
    Touch("OutputProcessor", "request_states", "hook_output_processor (live request ids)"),
    Touch("OutputProcessor", "tokenizer", "output_tokenizer (the detokenizers' tokenizer)"),
    Touch("EngineCoreRequest", "request_id", "AddedRequest"),
    Touch("EngineCoreRequest", "external_req_id", "AddedRequest"),
    Touch("EngineCoreRequest", "sampling_params", "AddedRequest"),
    Touch("EngineCoreRequest", "prompt_token_ids", "AddedRequest"),
    Touch("EngineCoreOutput", "request_id", "Step"),
    Touch("EngineCoreOutput", "new_token_ids", "Step"),
    Touch("EngineCoreOutput", "finish_reason", "Step"),
    Touch("EngineCoreOutput", "stop_reason", "Step"),
    Touch("RequestState", "detokenizer", "RequestProgress reads, transplant"),
    Touch("RequestState", "logprobs_processor", "RequestProgress reads, transplant"),
    Touch("RequestState", "queue", "RequestProgress.delivered_finish"),
    Touch("RequestState", "weight_version_starts", "RequestProgress.weight_version_starts"),
    Touch("RequestState", "prompt_token_ids", "RequestProgress.transplant"),
    Touch("RequestState", "prompt_len", "RequestProgress.transplant"),
    Touch("RequestState", "max_tokens_param", "RequestProgress.transplant"),
    Touch("RequestOutputCollector", "output", "RequestProgress.delivered_finish"),
    Touch("IncrementalDetokenizer", "from_new_request", "primed_state"),
    Touch("IncrementalDetokenizer", "output_token_ids", "RequestProgress.progress"),
    Touch("IncrementalDetokenizer", "num_output_tokens", "RequestProgress.num_generated"),
    Touch("IncrementalDetokenizer", "update", "primed_state (replays the prefix)"),
    Touch("IncrementalDetokenizer", "get_next_output_text", "PrimedState.final_text"),
    Touch("LogprobsProcessor", "from_new_request", "primed_state"),
    Touch("LogprobsProcessor", "logprobs", "RequestProgress.sampled_logprobs, transplant"),
    Touch("LogprobsProcessor", "cumulative_logprob", "RequestProgress.transplant"),
    Touch("LogprobsProcessor", "_update_sample_logprobs", "primed_state (prefills logprobs)"),
    Touch("FlatLogprobs", "start_indices", "RequestProgress.sampled_logprobs"),
    Touch("FlatLogprobs", "logprobs", "RequestProgress.sampled_logprobs"),
    Touch("LogprobsLists", "logprob_token_ids", "primed_state (positional field 0)"),
    Touch("LogprobsLists", "logprobs", "primed_state (positional field 1)"),
    Touch("LogprobsLists", "sampled_token_ranks", "primed_state (positional field 2)"),
    Touch("SamplingParams", "_bad_words_token_ids", "bad_words_token_ids"),
    Touch("EngineCoreProc", "run_engine_core", "install_parent_death_signal"),
    Touch("Worker", "reload_weights", "reload_weights (collective RPC by method name)"),
    Touch("logits_processor.builtin", "process_dict_updates", "update_request_rows"),
)

# Owners reached by import: (module, name).
_IMPORTED_OWNERS = {
    "EngineCoreRequest": ("vllm.v1.engine", "EngineCoreRequest"),
    "EngineCoreOutput": ("vllm.v1.engine", "EngineCoreOutput"),
    "FlatLogprobs": ("vllm.logprobs", "FlatLogprobs"),
    "LogprobsLists": ("vllm.v1.outputs", "LogprobsLists"),
    "SamplingParams": ("vllm.sampling_params", "SamplingParams"),
    "EngineCoreProc": ("vllm.v1.engine.core", "EngineCoreProc"),
    "logits_processor.builtin": ("vllm.v1.sample.logits_processor", "builtin"),
}


def _has(obj: Any, attribute: str) -> bool:
    """An attribute of an instance or class, or a field of a dataclass (which a class without
    a default does not carry as an attribute)."""
    return hasattr(obj, attribute) or attribute in getattr(obj, "__dataclass_fields__", {})


def _owners(engine: Any, request: RequestProgress) -> dict[str, Any]:
    """Every owner of the table, live where the attributes are per instance; None if absent."""
    state = request._state
    owners: dict[str, Any] = {
        "AsyncLLM": engine,
        "OutputProcessor": getattr(engine, "output_processor", None),
        "RequestState": state,
        "RequestOutputCollector": getattr(state, "queue", None),
        "IncrementalDetokenizer": getattr(state, "detokenizer", None),
        "LogprobsProcessor": getattr(state, "logprobs_processor", None),
    }
    for owner, (module, name) in _IMPORTED_OWNERS.items():
        try:
            owners[owner] = _import(module, name)
        except VllmMismatch:
            owners[owner] = None
    try:
        owners["Worker"] = _worker_class(engine)
    except (VllmMismatch, AttributeError):
        owners["Worker"] = None
    return owners


def missing_attributes(engine: Any, request: RequestProgress) -> list[str]:
    """Each entry of `PRIVATE_SURFACE` that the running vLLM lacks, as `Owner.attribute (use)`.

    `request` is the reader of a live request (one the output processor holds a state for):
    most of what is read per request exists only on instances.
    """
    owners = _owners(engine, request)
    return [
        f"{t.owner}.{t.attribute} ({t.use})"
        for t in PRIVATE_SURFACE
        if owners[t.owner] is None or not _has(owners[t.owner], t.attribute)
    ]


# ---------------------------------------------------------------------------- progress reads


class PrimedState:
    """vLLM's own per-request detokenizer and sampled-logprobs container, with a staged prefix
    already fed through them, as if the engine had decoded it."""

    def __init__(self, detokenizer: Any, logprobs_processor: Any, stop: str | None) -> None:
        self._detokenizer = detokenizer
        self._logprobs_processor = logprobs_processor
        self.stop = stop  # the stop string the prefix's text reached, if any

    def num_output_tokens(self) -> int:
        """Tokens the detokenizer kept (fewer than fed when a stop string truncated them)."""
        return self._detokenizer.num_output_tokens()

    def final_text(self) -> str:
        """The whole output text, as vLLM returns it for a finished request."""
        return self._detokenizer.get_next_output_text(True, False)

    @property
    def logprobs(self) -> Any:
        """The sampled-logprobs container in vLLM's output form (None without logprobs)."""
        return self._logprobs_processor.logprobs

    @property
    def cumulative_logprob(self) -> float | None:
        return self._logprobs_processor.cumulative_logprob


class ProgressReader(Protocol):
    """What capture, cut and resume read of one request's progress, and the one write resume
    makes. `RequestProgress` reads vLLM's request state; unit tests drive the same logic with
    a fake."""

    def num_generated(self) -> int: ...

    def progress(self) -> tuple[int, Sequence[int]]:
        """(tokens so far, the generated-ids list). Its first n entries never change."""
        ...

    def sampled_logprobs(self, start: int, end: int) -> np.ndarray | None: ...

    def weight_version_starts(self) -> list[tuple[str, int]]: ...

    def delivered_finish(self) -> tuple[str | None, Any] | None: ...

    def transplant(self, primed: PrimedState, prompt_ids: list[int], max_tokens: int | None): ...

    def output_logprobs(self, n: int) -> Any: ...


class RequestProgress:
    """Reads one request's progress from vLLM's `RequestState` (kept after vLLM frees it, for
    terminal rows).

    The detokenizer's generated ids and the logprobs container are append-only, and vLLM
    trims a stop string's surplus inside the same `process_outputs` call that appends, so a
    count taken under the capture lock names a prefix that can be copied after the lock is
    released. Reading them without the engine's lock relies on the GIL (`check_supported`).
    """

    __slots__ = ("_state",)

    def __init__(self, state: Any) -> None:
        self._state = state

    def num_generated(self) -> int:
        return self._state.detokenizer.num_output_tokens()

    def progress(self) -> tuple[int, Sequence[int]]:
        detokenizer = self._state.detokenizer
        return detokenizer.num_output_tokens(), detokenizer.output_token_ids

    def sampled_logprobs(self, start: int, end: int) -> np.ndarray | None:
        """Sampled-token logprobs of positions [start, end), or None when the request has none
        (never zeros: a trainer would take them for real values)."""
        processor = self._state.logprobs_processor
        lp = processor.logprobs if processor is not None else None
        if lp is None or len(lp) < end:
            return None
        if hasattr(lp, "start_indices"):  # FlatLogprobs: the sampled entry first per position
            starts = lp.start_indices
            if len(lp.logprobs) == len(starts):  # logprobs=0: one entry per position
                return np.asarray(lp.logprobs[start:end], dtype=np.float32)
            return np.fromiter(
                (lp.logprobs[starts[i]] for i in range(start, end)), np.float32, end - start
            )
        return np.fromiter(
            (next(iter(lp[i].values())).logprob for i in range(start, end)),
            np.float32,
            end - start,
        )

    def weight_version_starts(self) -> list[tuple[str, int]]:
        """(weight version label, first output index) of each span vLLM tracked."""
        return list(self._state.weight_version_starts)

    def delivered_finish(self) -> tuple[str | None, Any] | None:
        """(finish reason, stop reason) of the final output vLLM handed to the request's
        collector (not yet read by `generate()`), None when there is none."""
        queue = self._state.queue
        final = queue.output if queue is not None else None
        outputs = getattr(final, "outputs", None)
        if not outputs:
            return None
        return outputs[0].finish_reason, outputs[0].stop_reason

    def transplant(self, primed: PrimedState, prompt_ids: list[int], max_tokens: int | None):
        """Make a just-added request continue a staged prefix: its detokenizer and logprobs
        become the primed ones, its prompt the original prompt (the prefix is output again)."""
        state = self._state
        processor = state.logprobs_processor
        if primed.logprobs is not None and processor is not None:
            processor.logprobs = primed.logprobs
            processor.cumulative_logprob = primed.cumulative_logprob
        state.detokenizer = primed._detokenizer
        state.prompt_token_ids = list(prompt_ids)
        state.prompt_len = len(prompt_ids)
        state.max_tokens_param = max_tokens

    def output_logprobs(self, n: int) -> Any:
        """The first n positions of the logprobs container, in vLLM's output form."""
        return self._state.logprobs_processor.logprobs[:n]


def primed_state(
    tokenizer: Any,
    request_id: str,
    prompt_ids: list[int],
    params: Any,
    ids: np.ndarray,
    logprobs: np.ndarray | None,
    stop_terminated: bool = False,
) -> PrimedState:
    """A detokenizer primed on the original prompt with the prefix `ids` replayed, and a
    logprobs container prefilled with the prefix (vLLM's per-step code, run once).
    `stop_terminated`: the last token is a stop token, left out of the text as vLLM does."""
    detokenizer_cls = _import("vllm.v1.engine.detokenizer", "IncrementalDetokenizer")
    processor_cls = _import("vllm.v1.engine.logprobs", "LogprobsProcessor")
    logprobs_lists = _import("vllm.v1.outputs", "LogprobsLists")
    request = SimpleNamespace(
        request_id=request_id, prompt_token_ids=prompt_ids, sampling_params=params
    )
    tokenizer = tokenizer if params.detokenize else None  # as vLLM's RequestState does
    detokenizer = detokenizer_cls.from_new_request(tokenizer, request)
    stop = detokenizer.update(ids.tolist(), stop_terminated)
    processor = processor_cls.from_new_request(tokenizer, request)
    if processor.logprobs is not None and logprobs is not None:
        k = len(ids)
        prefill = _require(processor, "LogprobsProcessor", "_update_sample_logprobs")
        prefill(
            logprobs_lists(
                ids.reshape(k, 1).astype(np.int64),
                logprobs.reshape(k, 1).astype(np.float32),
                np.ones(k, np.int64),
            )
        )
    return PrimedState(detokenizer, processor, stop)


# ---------------------------------------------------------------------------- output processor


class Step(NamedTuple):
    """One followed request's part of an engine step, after vLLM processed it."""

    request_id: str
    new_tokens: int  # tokens the engine core sampled for it in this step
    finished: bool  # vLLM freed its state in this step
    finish_reason: str | None  # the engine core's
    stop_reason: int | str | None  # the engine core's


@dataclass(frozen=True)
class AddedRequest:
    """A request the output processor just admitted."""

    request_id: str  # vLLM's internal id
    external_id: str  # the id `generate()` was called with
    params: Any  # its processed SamplingParams clone (stop ids, EOS filled in)
    prompt_token_ids: list[int]
    is_child: bool  # a child of an n>1 request
    progress: RequestProgress | None  # None when vLLM made no state for it


class OutputObserver(Protocol):
    """Follows requests through the output processor (TokenCapture)."""

    lock: threading.Lock  # held around every output-processor mutation
    by_request: Mapping[str, Any]  # the request ids followed

    def admit(self, params: Any) -> Any | None:
        """Before vLLM builds the request's state: a token to follow it by, or None."""
        ...

    def added(self, admitted: Any, request: AddedRequest) -> None: ...

    def stepped(self, steps: list[Step]) -> None: ...

    def swept(self, is_live: Callable[[str], bool]) -> None:
        """After an abort: drop followed requests that are no longer live."""
        ...


def hook_output_processor(engine: Any, observer: OutputObserver) -> None:
    """Wrap, on the engine's output processor *instance*, `add_request`, `process_outputs`
    and `abort_requests` under the observer's lock. vLLM looks them up per call, and
    `add_request` runs before the engine core sees the request, so a hook can change the
    request's state before its first output."""
    op = _require(engine, "AsyncLLM", "output_processor")
    _require(op, "OutputProcessor", "request_states")
    orig_add = _require(op, "OutputProcessor", "add_request")
    orig_process = _require(op, "OutputProcessor", "process_outputs")
    orig_abort = _require(op, "OutputProcessor", "abort_requests")

    def add_request(request, prompt, parent_req=None, request_index=0, queue=None):
        params = request.sampling_params
        admitted = observer.admit(params) if params is not None else None
        with observer.lock:
            orig_add(request, prompt, parent_req, request_index, queue)
            if admitted is not None:
                observer.added(admitted, _added_request(op, request, parent_req))

    def process_outputs(engine_core_outputs, *args, **kwargs):
        with observer.lock:
            out = orig_process(engine_core_outputs, *args, **kwargs)
            followed = observer.by_request
            if followed:
                live = op.request_states
                steps = [
                    Step(
                        eco.request_id,
                        len(eco.new_token_ids),
                        eco.request_id not in live,
                        str(eco.finish_reason) if eco.finish_reason else None,
                        eco.stop_reason,
                    )
                    for eco in engine_core_outputs
                    if eco.request_id in followed
                ]
                if steps:
                    observer.stepped(steps)
            return out

    def abort_requests(request_ids, internal):
        with observer.lock:
            out = orig_abort(request_ids, internal)
            observer.swept(op.request_states.__contains__)
            return out

    op.add_request = add_request
    op.process_outputs = process_outputs
    op.abort_requests = abort_requests


OUTPUT_PROCESSOR_HOOKS = ("add_request", "process_outputs", "abort_requests")


def output_processor_hooked(engine: Any) -> bool:
    """Whether `hook_output_processor` hooks are set on the engine's output processor."""
    op = _require(engine, "AsyncLLM", "output_processor")
    return all(name in vars(op) for name in OUTPUT_PROCESSOR_HOOKS)


def unhook_output_processor(engine: Any) -> None:
    """Remove the hooks (they are set on the instance, so the class methods come back);
    benchmarks measure the same engine with and without them."""
    op = _require(engine, "AsyncLLM", "output_processor")
    for name in OUTPUT_PROCESSOR_HOOKS:
        vars(op).pop(name, None)


def _added_request(op: Any, request: Any, parent_req: Any) -> AddedRequest:
    state = op.request_states.get(request.request_id)
    return AddedRequest(
        request_id=request.request_id,
        external_id=request.external_req_id,
        params=request.sampling_params,
        prompt_token_ids=request.prompt_token_ids,
        is_child=parent_req is not None,
        progress=RequestProgress(state) if state is not None else None,
    )


def output_tokenizer(engine: Any) -> Any:
    """The tokenizer the output processor builds detokenizers with (a resumed request's
    primed detokenizer must be built with the same)."""
    op = _require(engine, "AsyncLLM", "output_processor")
    return _require(op, "OutputProcessor", "tokenizer")


# ---------------------------------------------------------------------------- generate


GenerateFn = Callable[..., AsyncIterator[Any]]
GenerateLayer = Callable[[GenerateFn], GenerateFn]


def wrap_generate(
    engine: Any, prefix_supply: GenerateLayer, resume: GenerateLayer | None = None
) -> None:
    """Replace `engine.generate` on the instance (vLLM's OpenAI server looks it up per
    request) by prefix_supply(resume(generate)): prefix supply is outermost, so resume, and
    the capture behind it, see the spliced prompt."""
    generate = _require(engine, "AsyncLLM", "generate")
    if resume is not None:
        generate = resume(generate)
    engine.generate = prefix_supply(generate)


def install_engine_hooks(
    engine: Any,
    prefix_supply: GenerateLayer,
    capture: OutputObserver | None = None,
    resume: GenerateLayer | None = None,
) -> None:
    """The entry point: every hook on a built engine, after the gate. Install before the
    server takes requests."""
    check_supported()
    if capture is not None:
        hook_output_processor(engine, capture)
    wrap_generate(engine, prefix_supply, resume)


# ---------------------------------------------------------------------------- lifecycle


_PR_SET_PDEATHSIG = 1
_ORIGINAL_TARGET = "_rr_original_run_engine_core"


def _run_engine_core_with_pdeathsig(*args, **kwargs):
    """The EngineCore process's target: die with the parent, then run vLLM's own target."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    parent = multiprocessing.parent_process()
    # The parent may have died between fork and prctl; then nobody would signal us.
    if parent is not None and os.getppid() != parent.pid:
        os._exit(1)
    engine_core_proc = _import("vllm.v1.engine.core", "EngineCoreProc")
    # In the spawned child nothing is patched, so this is vLLM's own function.
    target = getattr(engine_core_proc, _ORIGINAL_TARGET, engine_core_proc.run_engine_core)
    return target(*args, **kwargs)


def install_parent_death_signal() -> None:
    """Make the EngineCore process die with the process that started it. Call before an
    AsyncLLM is created; idempotent; Linux only.

    vLLM sets no parent-death signal on the EngineCore. Ray's cleanups kill it when the actor
    dies, but without them a SIGKILLed actor would leave an orphaned engine holding memory.
    Spawn pickles the process target by reference, so replacing
    `EngineCoreProc.run_engine_core` with a module-level wrapper makes the child run it.
    """
    if not os.path.exists("/proc/self"):
        return
    engine_core_proc = _import("vllm.v1.engine.core", "EngineCoreProc")
    if getattr(engine_core_proc, _ORIGINAL_TARGET, None) is not None:
        return
    original = _require(engine_core_proc, "EngineCoreProc", "run_engine_core")
    setattr(engine_core_proc, _ORIGINAL_TARGET, staticmethod(original))
    engine_core_proc.run_engine_core = staticmethod(_run_engine_core_with_pdeathsig)


async def cancel_output_handler(engine: Any) -> None:
    """Cancel the engine's output-handler task before `engine.shutdown`: vLLM stops the
    EngineCore first, and the handler then logs a spurious EngineDeadError. Nothing to do
    when the engine never started one."""
    handler = getattr(engine, "output_handler", None)
    if handler is not None and not handler.done():
        handler.cancel()
        await asyncio.gather(handler, return_exceptions=True)


# ---------------------------------------------------------------------------- sampler, weights


def bad_words_token_ids(params: Any) -> list[list[int]]:
    """The token-id sequences of a request's bad words (vLLM fills them in when it processes
    the request; empty before)."""
    return getattr(params, "_bad_words_token_ids", None) or []


@functools.cache
def _process_dict_updates() -> Callable:
    return _import("vllm.v1.sample.logits_processor.builtin", "process_dict_updates")


def update_request_rows(rows: dict, batch_update: Any, new_row: Callable) -> None:
    """Apply a logits processor's batch update (added, removed, moved rows) to its per-row
    dict, with vLLM's built-in helper (runs every engine step)."""
    _process_dict_updates()(rows, batch_update, new_row)


def _worker_class(engine: Any) -> type:
    module, _, name = engine.vllm_config.parallel_config.worker_cls.rpartition(".")
    return _import(module, name)


async def reload_weights(engine: Any, weights_dir: str) -> None:
    """Reload every worker's weights from a directory of safetensors (the workers'
    `reload_weights`, called by name; `missing_attributes` checks that they have it)."""
    await engine.collective_rpc("reload_weights", kwargs={"weights_path": weights_dir})
