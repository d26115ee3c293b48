"""The sim tokenizer: the same ids for the same text in every process, a chat template, speed."""

from __future__ import annotations

import subprocess
import sys
import zlib

import orjson
import pytest

from pdserve.errors import ChatTemplateError
from pdserve.sim import tokenizer
from pdserve.sim.tokenizer import FIRST_TOKEN_ID, VOCAB_SIZE


def test_words_and_punctuation_are_tokens_with_stable_ids() -> None:
    ids = tokenizer.encode("Hello, world! Hello again.")
    assert len(ids) == 7 == tokenizer.count_tokens("Hello, world! Hello again.")
    assert ids[0] == ids[4]  # "Hello" both times
    assert ids[0] == FIRST_TOKEN_ID + zlib.crc32(b"Hello") % VOCAB_SIZE
    assert all(FIRST_TOKEN_ID <= i < FIRST_TOKEN_ID + VOCAB_SIZE for i in ids)
    assert tokenizer.encode("") == [] and tokenizer.encode("   \n\t") == []


def test_ids_do_not_depend_on_the_process() -> None:
    # str hashes are salted per process; a P→D pair in two processes must still agree on prompt ids.
    code = "from pdserve.sim import tokenizer; print(tokenizer.encode('cross process prompt, please'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert orjson.loads(out) == tokenizer.encode("cross process prompt, please")


def test_output_tokens_are_words_with_a_leading_space() -> None:
    assert tokenizer.piece(FIRST_TOKEN_ID) == " the"
    assert tokenizer.decode([FIRST_TOKEN_ID, FIRST_TOKEN_ID + 1]) == " the of"
    for token_id in (0, 100, 999, 123456):
        assert orjson.loads(tokenizer.piece_json(token_id)) == tokenizer.piece(token_id)
        assert tokenizer.piece(token_id).startswith(" ") and tokenizer.piece(token_id)[1:].isalpha()


def test_chat_template_renders_roles_and_text_parts() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {}}]},
    ]
    assert tokenizer.render_chat(messages) == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    assert tokenizer.render_chat(messages, add_generation_prompt=False).endswith("<|user|>\nHi\n")


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "Cannot apply chat template to an empty conversation. Provide at least one message."),
        (["hi"], "each message must be an object"),
        ([{"content": "hi"}], "string role"),
        ([{"role": "user", "content": 5}], "string or a list of parts"),
    ],
)
def test_bad_conversations_are_refused(messages: list[object], message: str) -> None:
    with pytest.raises(ChatTemplateError, match=message):
        tokenizer.render_chat(messages)


def test_a_long_text_encodes_to_one_token_per_word_and_mark() -> None:
    text = " ".join(f"word{i % 5000}, and more" for i in range(20000))  # 80k tokens
    ids = tokenizer.encode(text)
    assert len(ids) == 80000
    assert tokenizer.encode(text) == ids  # the same text, the same ids, whatever is cached
