"""Recompute trained tokens' logprobs with the weights of the version that sampled each one:
vLLM's offline engine, reloaded with each version's weights in turn, scoring each sequence
with `prompt_logprobs`. Run as a subprocess by async_recovery.py (the engine environment is in
place before torch is imported).

Reads a JSON request on stdin:
    {"model": BASE_DIR, "kv_bytes": N, "max_model_len": N,
     "versions": {"0": null, "3": WEIGHTS_DIR, ...},       # null: the base model's weights
     "sequences": [{"id": ID, "token_ids": [...], "positions": {"3": [i, ...]}}, ...]}
and prints `RESULT {"ID": {"i": logprob, ...}, ...}`: the logprob of token i given tokens
before it, for each position listed under each version.
"""

import json
import sys

if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    req = json.load(sys.stdin)
    llm = LLM(model=req["model"], dtype="float32", enforce_eager=True,
              enable_prefix_caching=False, kv_cache_memory_bytes=req["kv_bytes"],
              max_model_len=req["max_model_len"], seed=0)  # fmt: skip
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    out: dict[str, dict[str, float]] = {}
    for version, weights in sorted(req["versions"].items(), key=lambda kv: int(kv[0])):
        llm.collective_rpc("reload_weights", kwargs={"weights_path": weights or req["model"]})
        llm.reset_prefix_cache()
        seqs = [s for s in req["sequences"] if s["positions"].get(version)]
        if not seqs:
            continue
        prompts = [TokensPrompt(prompt_token_ids=s["token_ids"]) for s in seqs]
        for seq, result in zip(seqs, llm.generate(prompts, params, use_tqdm=False), strict=True):
            scored = out.setdefault(seq["id"], {})
            for i in seq["positions"][version]:
                scored[str(i)] = result.prompt_logprobs[i][seq["token_ids"][i]].logprob
    print("RESULT " + json.dumps(out))
