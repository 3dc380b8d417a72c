"""The vLLM seam without vLLM: its gate, its mismatch messages, the order of the generate
layers, and the output-processor hooks over objects shaped like vLLM 0.32's.

That every attribute the seam touches exists on the real engine is
tests/engine/test_vllm_compat.py.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from rollout_recovery.generation import vllm_compat
from rollout_recovery.generation.capture import TokenCapture
from rollout_recovery.generation.vllm_compat import (
    SUPPORTED_VLLM_SERIES,
    RequestProgress,
    VllmMismatch,
    check_supported,
)
from rollout_recovery.protocol import CallIdentity

# ------------------------------------------------------------------ the gate


def test_check_supported_passes_the_supported_series():
    assert check_supported(f"{SUPPORTED_VLLM_SERIES}7", gil_enabled=True).startswith("0.32.")


@pytest.mark.parametrize("version", ["0.33.0", "0.31.9", "1.0.0", "0.3.2"])
def test_check_supported_refuses_another_vllm_with_both_versions(version):
    with pytest.raises(VllmMismatch) as err:
        check_supported(version, gil_enabled=True)
    assert f"found vLLM {version}" in str(err.value)
    assert f"vLLM {SUPPORTED_VLLM_SERIES}x" in str(err.value)
    assert "generation/vllm_compat.py" in str(err.value)


def test_check_supported_refuses_a_python_without_the_gil():
    with pytest.raises(VllmMismatch, match="GIL"):
        check_supported(f"{SUPPORTED_VLLM_SERIES}0", gil_enabled=False)


def test_a_hook_names_the_attribute_it_misses_and_the_supported_series():
    capture = TokenCapture(on_finished=lambda call: None)
    with pytest.raises(VllmMismatch) as err:
        vllm_compat.hook_output_processor(SimpleNamespace(), capture)
    assert "AsyncLLM.output_processor" in str(err.value)
    assert f"{SUPPORTED_VLLM_SERIES}x" in str(err.value)
    engine = SimpleNamespace(output_processor=SimpleNamespace(request_states={}))
    with pytest.raises(VllmMismatch, match=r"OutputProcessor\.add_request"):
        vllm_compat.hook_output_processor(engine, capture)


def test_every_table_owner_is_resolvable():
    """`missing_attributes` can place every row (a new owner needs a way to reach it)."""
    live = {"AsyncLLM", "OutputProcessor", "RequestState", "RequestOutputCollector"}
    live |= {"IncrementalDetokenizer", "LogprobsProcessor", "Worker"}
    owners = {t.owner for t in vllm_compat.PRIVATE_SURFACE}
    assert owners == live | set(vllm_compat._IMPORTED_OWNERS)


# ------------------------------------------------------------------ generate layers


def test_prefix_supply_is_the_outermost_generate_layer():
    seen: list[str] = []

    async def generate(prompt, sampling_params, request_id, **kwargs):
        seen.append(f"vllm:{prompt}")
        yield prompt

    def layer(name: str):
        def wrap(inner):
            async def generate(prompt, sampling_params, request_id, **kwargs):
                seen.append(name)
                async for out in inner(f"{prompt}+{name}", sampling_params, request_id):
                    yield out

            return generate

        return wrap

    engine = SimpleNamespace(generate=generate)
    vllm_compat.wrap_generate(engine, layer("supply"), layer("resume"))

    async def run():
        return [out async for out in engine.generate("p", None, "r")]

    assert asyncio.run(run()) == ["p+supply+resume"]
    assert seen == ["supply", "resume", "vllm:p+supply+resume"]


# ------------------------------------------------------------------ output-processor hooks


class _Detokenizer:
    def __init__(self) -> None:
        self.token_ids: list[int] = []

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids

    def num_output_tokens(self) -> int:
        return len(self.token_ids)


class _OutputProcessor:
    """vLLM 0.32's OutputProcessor as far as the hooks see it: states by internal id, freed
    when a request finishes."""

    def __init__(self) -> None:
        self.request_states: dict[str, SimpleNamespace] = {}

    def add_request(self, request, prompt, parent_req=None, request_index=0, queue=None):
        self.request_states[request.request_id] = SimpleNamespace(
            detokenizer=_Detokenizer(),
            logprobs_processor=SimpleNamespace(logprobs=[]),
            queue=SimpleNamespace(output=None),
            weight_version_starts=[],
        )

    def process_outputs(self, outputs, *args, **kwargs):
        for eco in outputs:
            state = self.request_states[eco.request_id]
            state.detokenizer.token_ids += eco.new_token_ids
            state.logprobs_processor.logprobs += [
                {t: SimpleNamespace(logprob=-0.5)} for t in eco.new_token_ids
            ]
            if eco.finish_reason:
                del self.request_states[eco.request_id]
        return SimpleNamespace(reqs_to_abort=[])

    def abort_requests(self, request_ids, internal):
        for rid in request_ids:
            self.request_states.pop(rid, None)
        return list(request_ids)


def _request(rid: str, identity: CallIdentity | None):
    params = SimpleNamespace(
        extra_args=identity.to_xargs() if identity else None,
        logprobs=None,
        flat_logprobs=False,
        max_tokens=16,
    )
    return SimpleNamespace(
        request_id=f"{rid}-internal",
        external_req_id=rid,
        sampling_params=params,
        prompt_token_ids=[1, 2],
    )


def _eco(rid: str, ids: list[int], finish: str | None = None):
    return SimpleNamespace(
        request_id=f"{rid}-internal", new_token_ids=ids, finish_reason=finish, stop_reason=None
    )


def test_the_hooks_follow_identified_requests_only():
    finished = []
    capture = TokenCapture(on_finished=finished.append)
    op = _OutputProcessor()
    vllm_compat.hook_output_processor(SimpleNamespace(output_processor=op), capture)
    identity = CallIdentity("hooked", "c0", 0)
    op.add_request(_request("hooked", identity), None)
    op.add_request(_request("anonymous", None), None)
    assert list(capture.by_request) == ["hooked-internal"]
    call = capture.calls[identity]
    assert isinstance(call.reader, RequestProgress)
    op.process_outputs([_eco("hooked", [7, 8]), _eco("anonymous", [9])])
    assert call.progress()[0] == 2 and call.generated_ids(0, 2).tolist() == [7, 8]
    assert call.sampled_logprobs(0, 2).tolist() == [-0.5, -0.5]
    assert call.sampled_logprobs(0, 3) is None  # not decoded yet: never zeros
    op.process_outputs([_eco("hooked", [9], finish="length")])
    assert finished == [call] and call.finish_record() == ("length", None)
    assert capture.by_request == {}
    [record] = capture.attempts.read(0).attempts
    assert (record.decoded_tokens, record.finish_reason) == (3, "length")


def test_an_abort_drops_the_followed_request():
    capture = TokenCapture(on_finished=lambda call: None)
    op = _OutputProcessor()
    vllm_compat.hook_output_processor(SimpleNamespace(output_processor=op), capture)
    identity = CallIdentity("aborted", "c0", 0)
    op.add_request(_request("aborted", identity), None)
    op.abort_requests(["aborted-internal"], internal=True)
    assert identity not in capture.calls and capture.by_request == {}


class _FlatLogprobs:
    """vLLM's FlatLogprobs as the reader sees it: flat entries, the sampled one first per
    position."""

    def __init__(self, start_indices: list[int], logprobs: list[float]) -> None:
        self.start_indices, self.logprobs = start_indices, logprobs

    def __len__(self) -> int:
        return len(self.start_indices)


@pytest.mark.parametrize(
    "flat",
    [
        _FlatLogprobs([0, 1, 2], [-1.0, -2.0, -3.0]),  # logprobs=0: one entry per position
        _FlatLogprobs([0, 2, 4], [-1.0, -9.0, -2.0, -9.0, -3.0, -9.0]),  # with top-1
    ],
)
def test_flat_logprobs_are_read_at_each_positions_sampled_entry(flat):
    state = SimpleNamespace(logprobs_processor=SimpleNamespace(logprobs=flat))
    got = RequestProgress(state).sampled_logprobs(1, 3)
    assert got.dtype == np.float32 and got.tolist() == [-2.0, -3.0]
