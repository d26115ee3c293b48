"""One greedy answer's text, through the OpenAI client as a user's code would ask it: completions or
chat, streamed or whole, joined into one string so that the four ways can be compared with each other."""

from __future__ import annotations

from typing import Any

import openai


def greedy_text(
    url: str,
    model: str,
    kind: str,
    prompt: str,
    stream: bool,
    request_id: str | None = None,
    max_tokens: int = 8,
) -> str:
    headers = {"X-Request-Id": request_id} if request_id else {}
    client = openai.OpenAI(
        base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120, default_headers=headers
    )
    common: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0.0}
    if kind == "completions":
        if stream:
            chunks = client.completions.create(prompt=prompt, stream=True, **common)
            return "".join(c.choices[0].text for c in chunks if c.choices)
        return str(client.completions.create(prompt=prompt, **common).choices[0].text)
    messages: Any = [{"role": "user", "content": prompt}]
    if stream:
        parts = client.chat.completions.create(messages=messages, stream=True, **common)
        return "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    return client.chat.completions.create(messages=messages, **common).choices[0].message.content or ""
