"""A multi-turn tool harness written with the official `openai` client, as an agent framework
would be: it knows nothing of recovery, only `OPENAI_BASE_URL` (its rollout's gateway URL).

Each turn it asks the model with a calculator tool offered (`tool_choice="auto"`), alternating
plain and streamed calls; a tool call the model makes is run, and so is the harness's rule for
replies without one (the digits in the reply are added to a running register), whose result
is the next message. It prints its result as one JSON line. Run it again after a crash and it
makes the same calls: the gateway answers the ones already made from the journal.
"""

from __future__ import annotations

import json
import os

from openai import OpenAI

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add a number to the running register.",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
    },
}


def ask(client: OpenAI, messages: list[dict], stream: bool) -> tuple[str, list[dict]]:
    """The reply's text and tool calls, streamed or not."""
    args = {"model": "policy", "messages": messages, "tools": [CALCULATOR],
            "tool_choice": "auto", "logprobs": True}  # fmt: skip
    if not stream:
        message = client.chat.completions.create(**args).choices[0].message
        calls = [c.model_dump() for c in message.tool_calls or []]
        return message.content or "", calls
    text, calls = [], {}
    for chunk in client.chat.completions.create(**args, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        text.append(delta.content or "")
        for call in delta.tool_calls or []:
            calls.setdefault(call.index, call.model_dump())
    return "".join(text), list(calls.values())


def main() -> None:
    client = OpenAI(max_retries=0)
    task = json.loads(os.environ["ROLLOUT_TASK"])
    turns = int(os.environ.get("ROLLOUT_MAX_TURNS", "3"))
    messages, replies, register = [dict(m) for m in task["messages"]], [], 0
    for turn in range(turns):
        content, calls = ask(client, messages, stream=turn % 2 == 1)
        replies.append(content)
        messages.append({"role": "assistant", "content": content})
        if turn + 1 == turns:
            break
        if calls:
            register += int(json.loads(calls[0]["function"]["arguments"] or "{}").get("x", 0))
        else:
            register += sum(int(c) for c in content if c.isdigit())
        messages.append({"role": "user", "content": f"calculator: register = {register}"})
    print(json.dumps({"text": "".join(replies), "register": register, "turns": len(replies)}))


if __name__ == "__main__":
    main()
