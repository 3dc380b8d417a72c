"""Every engine check of the position-keyed sampler in one offline `LLM`, run as a subprocess.

Reads {"model", "prompts", "max_tokens", "seeds", "cuts", "kv_bytes", "max_model_len"} on stdin
and prints one RESULT line of JSON: the generated runs plus a transformers forward of each
sampled run (its log_softmax(z/T) and the choices `sample_positions` makes from its logits).
"""

import json
import sys


def main() -> None:
    import torch
    from offline_common import offline_llm
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from rollout_recovery.generation.sampler import SAMPLER_FQCN, as_int64_seed, sample_positions

    req = json.load(sys.stdin)
    n, (p0, p1), (s0, s1, s2) = req["max_tokens"], req["prompts"], req["seeds"]
    llm = offline_llm(
        req,
        logits_processors=[SAMPLER_FQCN],
        # The reported logprob is then the value the processor wrote: log_softmax(z/T)[token].
        logprobs_mode="processed_logits",
    )

    def generate(jobs: list[tuple[list[int], int | None, float, int]]) -> list[dict]:
        prompts = [TokensPrompt(prompt_token_ids=prompt) for prompt, *_ in jobs]
        params = [
            SamplingParams(
                temperature=0.0,
                max_tokens=max_tokens,
                logprobs=0,
                ignore_eos=True,
                extra_args=None if seed is None else {"rr_seed": seed, "rr_temperature": temp},
            )
            for _, seed, temp, max_tokens in jobs
        ]
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [
            {
                "token_ids": list(c.token_ids),
                "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)],
            }
            for c in (o.outputs[0] for o in outs)
        ]

    rejected = ""
    try:
        llm.generate([TokensPrompt(prompt_token_ids=p0)], SamplingParams(
            temperature=0.7, extra_args={"rr_seed": 1}), use_tqdm=False)  # fmt: skip
    except Exception as exc:  # VLLMValidationError, which is not a ValueError
        rejected = f"{type(exc).__name__}: {exc}"

    res: dict = {"rejected": rejected}
    res["alone"] = generate([(p0, s0, 0.8, n)])[0]
    res["alone_again"] = generate([(p0, s0, 0.8, n)])[0]
    res["greedy_alone"] = generate([(p0, None, 1.0, n)])[0]
    res["batch"] = generate(
        [(p0, s0, 0.8, n), (p0, s1, 0.8, n), (p1, s2, 1.0, n), (p0, None, 1, n)]
    )
    head = res["alone"]["token_ids"]
    res["resumed"] = generate([(p0 + head[:k], s0, 0.8, n - k) for k in req["cuts"]])

    model = AutoModelForCausalLM.from_pretrained(req["model"], dtype=torch.float32).eval()
    res["reference"] = []
    for prompt, seed, temp, run in ((p0, s0, 0.8, res["alone"]), (p1, s2, 1.0, res["batch"][2])):
        ids = torch.tensor([prompt + run["token_ids"]])
        with torch.no_grad():
            z = model(ids).logits[0, len(prompt) - 1 : -1].float()
        positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + z.shape[0])
        tokens, _ = sample_positions(
            z, torch.full_like(positions, as_int64_seed(seed)), positions, temp
        )
        picked = torch.log_softmax(z / temp, dim=-1).gather(1, ids[0, len(prompt) :, None])
        res["reference"].append({"logprobs": picked[:, 0].tolist(), "token_ids": tokens.tolist()})
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
