"""A request body's prompt as token ids, computed in the proxy with the model's own tokenizer.

Prefix-aware routing needs only a *stable* prefix: two requests that share a system prompt must share
leading token ids here, whatever vLLM's exact ids are, since the proxy hashes its own ids and compares
them with its own earlier ones. Thresholds (skip prefill below N uncached tokens) need a count close to
vLLM's, not equal to it.

- completions: ``prompt`` text is encoded as vLLM does (with special tokens, e.g. BOS); token ids are
  taken as they are.
- chat: the model's chat template is rendered with jinja2, in the sandboxed environment transformers
  (and so vLLM) uses, when the model has one. Without a template each message is encoded as
  ``role: content\\n``, which keeps a shared system prompt a shared prefix and misses vLLM's count by the
  template's own markers: a few tokens per message.

``tokenizers`` (a Rust wheel, no torch) and ``jinja2`` are the libraries used; their errors become
``ConfigError`` here, at load time, and nowhere else.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer

from pdserve.errors import ConfigError

log = logging.getLogger("pdserve.proxy")

Renderer = Callable[[list[dict[str, Any]], dict[str, Any]], str]


class PromptTokenizer:
    def __init__(self, tokenizer: Tokenizer, render_chat: Renderer | None = None) -> None:
        # vLLM counts every prompt token: a truncation or padding setting saved in tokenizer.json must not apply.
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self._tokenizer = tokenizer
        self._render_chat = render_chat

    @classmethod
    def from_model_dir(cls, path: str | Path) -> PromptTokenizer | None:
        """The model's tokenizer; None when the directory has no ``tokenizer.json`` (e.g. a hub name)."""
        model_dir = Path(path)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            return None
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust side raises plain Exception for any malformed file
            raise ConfigError(f"cannot load tokenizer {tokenizer_file}: {exc}") from exc
        return cls(tokenizer, _chat_renderer(model_dir))

    @property
    def uses_chat_template(self) -> bool:
        """True when chat prompts are rendered with the model's template, False when approximated."""
        return self._render_chat is not None

    def token_ids(self, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids; None when the body holds no single prompt the proxy can read
        (a batch of prompts, prompt embeddings, a malformed field): route it by load alone."""
        messages = body.get("messages")
        if isinstance(messages, list):
            return self._chat_ids(messages, body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return self._tokenizer.encode(prompt).ids
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return prompt
        return None

    def _chat_ids(self, messages: list[Any], body: dict[str, Any]) -> list[int] | None:
        flat = [_flatten(m) for m in messages]
        if any(m is None for m in flat):
            return None
        clean = [m for m in flat if m is not None]  # for the type checker: none is None by now
        if self._render_chat is not None:
            try:
                text = self._render_chat(clean, body)
            except Exception as exc:  # a template's own raise_exception: vLLM rejects it too, with a 400
                log.debug("chat template failed, approximating: %s", exc)
            else:
                # Templates write BOS themselves; vLLM's chat path adds no special tokens on top.
                return self._tokenizer.encode(text, add_special_tokens=False).ids
        text = "".join(f"{m['role']}: {m['content']}\n" for m in clean)
        return self._tokenizer.encode(text).ids


def _flatten(message: Any) -> dict[str, Any] | None:
    """The message with its content as one string: text parts joined by newlines, as vLLM's "string"
    content format does; images and other parts have no text the proxy could count."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        return None
    content = message.get("content")
    if isinstance(content, list):
        texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        content = "\n".join(t for t in texts if isinstance(t, str))
    elif not isinstance(content, str):
        content = ""  # e.g. an assistant turn holding only tool calls
    return {**message, "content": content}


def _chat_renderer(model_dir: Path) -> Renderer | None:
    """The model's chat template compiled once, or None when the model has none."""
    config = _read_json(model_dir / "tokenizer_config.json")
    template_file = model_dir / "chat_template.jinja"  # where newer transformers save it
    source: Any = template_file.read_text() if template_file.is_file() else config.get("chat_template")
    if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if not isinstance(source, str):
        return None
    # The environment transformers (and so vLLM) renders chat templates in.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    try:
        template = env.from_string(source)
    except Exception as exc:  # jinja2's TemplateSyntaxError; vLLM would fail on it too
        raise ConfigError(f"chat template of {model_dir} does not compile: {exc}") from exc
    special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}

    def render(messages: list[dict[str, Any]], body: dict[str, Any]) -> str:
        extra = body.get("chat_template_kwargs")
        context = {
            **special,
            "tools": body.get("tools"),
            "add_generation_prompt": body.get("add_generation_prompt", True),
            "continue_final_message": body.get("continue_final_message", False),
            **(extra if isinstance(extra, dict) else {}),
            "messages": messages,
        }
        text: str = template.render(context)
        return text

    return render


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _raise(message: str) -> None:
    raise ValueError(message)


_CHARS_PER_TOKEN = 4  # English text under a BPE tokenizer, roughly; the elastic router needs a size, not ids


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """The prompt's length in tokens without a tokenizer: exact for token ids, else its characters / 4
    (chat: every message's text). Enough to tell a long prompt from a short one."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, str):
        return max(1, len(prompt) // _CHARS_PER_TOKEN)
    messages = body.get("messages")
    if isinstance(messages, list):
        chars = sum(_text_length(m.get("content")) + 8 for m in messages if isinstance(m, dict))
        return max(1, chars // _CHARS_PER_TOKEN)
    return 1


def _text_length(content: Any) -> int:
    """Characters of a message's content: a string, or parts of which the text ones count."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0
