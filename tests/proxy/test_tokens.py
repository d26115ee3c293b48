"""Prompt token ids in the proxy, with a tiny tokenizer trained here (no network, no model download)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from pdserve.blocks import block_hashes
from pdserve.engines.model import embedded_model_dir
from pdserve.errors import ConfigError
from pdserve.proxy.request.tokens import PromptTokenizer

CORPUS = [
    "You are a helpful assistant that answers questions about prefill and decode.",
    "The quick brown fox jumps over the lazy dog.",
    "Prefix caching keeps the KV blocks of a shared system prompt.",
    "user: what is disaggregated serving?",
    "assistant: prefill and decode run on different instances.",
]
SYSTEM = "You are a helpful assistant that answers questions about prefill and decode. " * 4
TINY_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}"
    "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
EMBEDDED_MODEL = embedded_model_dir()  # built by `make test`'s bootstrap before the tests run


def _write_model_dir(path: Path, chat_template: str | None = None) -> Path:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    config: dict[str, Any] = {"bos_token": "<s>", "eos_token": {"content": "</s>"}}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_model_dir(tmp_path_factory.mktemp("tiny-tokenizer"))


@pytest.fixture(scope="module")
def prompt_tokenizer(model_dir: Path) -> PromptTokenizer:
    loaded = PromptTokenizer.from_model_dir(model_dir)
    assert loaded is not None
    return loaded


def _chat(user: str) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]}


def test_completion_text_counts_the_same_tokens_as_the_tokenizer_itself(
    model_dir: Path, prompt_tokenizer: PromptTokenizer
) -> None:
    direct = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    for text in [*CORPUS, SYSTEM, "words the tokenizer never saw: zyxt qwv"]:
        expected = direct.encode(text).ids
        assert expected[0] == 1  # the BOS vLLM also adds to a completion prompt
        assert prompt_tokenizer.token_ids({"prompt": text}) == expected
        assert prompt_tokenizer.token_ids({"prompt": [text]}) == expected


def test_completion_token_ids_are_used_as_given(prompt_tokenizer: PromptTokenizer) -> None:
    assert prompt_tokenizer.token_ids({"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert prompt_tokenizer.token_ids({"prompt": [[5, 6, 7]]}) == [5, 6, 7]


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": ["one", "two"]},  # a batch: decode serves it whole
        {"prompt": [[1, 2], [3, 4]]},
        {"prompt": []},
        {"prompt": [1, "x"]},
        {"prompt_embeds": "..."},
        {"messages": [{"content": "no role"}]},
    ],
)
def test_a_prompt_the_proxy_cannot_read_gives_none_not_an_empty_prompt(
    prompt_tokenizer: PromptTokenizer, body: dict[str, Any]
) -> None:
    assert prompt_tokenizer.token_ids(body) is None


def test_model_dir_without_tokenizer_json_gives_no_tokenizer(tmp_path: Path) -> None:
    assert PromptTokenizer.from_model_dir(tmp_path) is None


def test_broken_tokenizer_json_fails_at_load_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"tokenizer\.json"):
        PromptTokenizer.from_model_dir(tmp_path)


def test_chats_sharing_a_system_prompt_share_its_leading_blocks(prompt_tokenizer: PromptTokenizer) -> None:
    a = prompt_tokenizer.token_ids(_chat("what is prefill?"))
    b = prompt_tokenizer.token_ids(_chat("and decode?"))
    system_only = prompt_tokenizer.token_ids({"messages": [{"role": "system", "content": SYSTEM}]})
    assert a is not None and b is not None and system_only is not None
    assert a != b
    num_shared_blocks = (len(system_only) - 2) // 16  # a BPE merge may join the last tokens to the next turn
    assert num_shared_blocks >= 3
    assert block_hashes(a, 16)[:num_shared_blocks] == block_hashes(b, 16)[:num_shared_blocks]
    assert prompt_tokenizer.token_ids(_chat("what is prefill?")) == a  # stable from call to call


def test_chat_text_parts_count_like_plain_text(prompt_tokenizer: PromptTokenizer) -> None:
    parts = [{"type": "text", "text": "what is"}, {"type": "image_url"}, {"type": "text", "text": "prefill?"}]
    as_parts = {"messages": [{"role": "user", "content": parts}]}
    as_text = {"messages": [{"role": "user", "content": "what is\nprefill?"}]}
    assert prompt_tokenizer.token_ids(as_parts) == prompt_tokenizer.token_ids(as_text)


def test_chat_template_is_rendered_as_vllm_does(tmp_path: Path) -> None:
    loaded = PromptTokenizer.from_model_dir(_write_model_dir(tmp_path, TINY_TEMPLATE))
    assert loaded is not None and loaded.uses_chat_template
    direct = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    rendered = f"<s>system: {SYSTEM}</s>\nuser: hi</s>\nassistant:"
    expected = direct.encode(rendered, add_special_tokens=False).ids
    assert loaded.token_ids(_chat("hi")) == expected


@pytest.mark.skipif(not (EMBEDDED_MODEL / "tokenizer.json").is_file(), reason="embedded model not built")
def test_embedded_model_chat_count_is_within_a_few_tokens_of_its_template() -> None:
    loaded = PromptTokenizer.from_model_dir(EMBEDDED_MODEL)
    assert loaded is not None
    direct = Tokenizer.from_file(str(EMBEDDED_MODEL / "tokenizer.json"))
    body = _chat("how do prefill and decode share the KV cache?")
    assert loaded.token_ids({"prompt": SYSTEM}) == direct.encode(SYSTEM).ids
    rendered = "<s>" + "".join(f"{m['role']}: {m['content']}</s>\n" for m in body["messages"]) + "assistant:"
    vllm_count = len(direct.encode(rendered, add_special_tokens=False).ids)
    ids = loaded.token_ids(body)
    assert ids is not None
    assert abs(len(ids) - vllm_count) <= 2 * len(body["messages"]) + 2
