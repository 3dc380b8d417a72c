"""Greedy generation with vLLM's offline `LLM`, run as a subprocess by the engine tests.

Reads a JSON request on stdin ({"model", "prompt_token_ids", "max_tokens", "kv_bytes",
"max_model_len"}) and prints {"token_ids", "logprobs"}. It runs in its own process so the
engine determinism environment is in place before torch is imported.
"""

import json
import sys

if __name__ == "__main__":
    from offline_common import offline_llm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    req = json.load(sys.stdin)
    llm = offline_llm(req)
    params = SamplingParams(
        temperature=0.0, max_tokens=req["max_tokens"], logprobs=0, ignore_eos=True
    )
    out = llm.generate([TokensPrompt(prompt_token_ids=req["prompt_token_ids"])], params)[0]
    comp = out.outputs[0]
    logprobs = [lp[tok].logprob for lp, tok in zip(comp.logprobs, comp.token_ids, strict=True)]
    print("RESULT " + json.dumps({"token_ids": list(comp.token_ids), "logprobs": logprobs}))
