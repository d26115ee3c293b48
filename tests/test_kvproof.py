"""The proof's own rules: what a cached-token count proves, and what a probe's prompt must be."""

from __future__ import annotations

from pdserve import kvproof
from pdserve.kvproof import Evidence


def test_a_whole_prompt_from_the_connector_is_a_transfer_and_a_recomputed_one_is_not() -> None:
    assert Evidence(prompt_tokens=600, cached_tokens=600).transfer()[0]
    ok, said = Evidence(prompt_tokens=600, cached_tokens=0).transfer()
    assert not ok and "decode computed 600 of 600" in said and "recomputed" in said


def test_a_hybrid_models_recomputed_last_token_passes_and_says_why() -> None:
    ok, said = Evidence(prompt_tokens=600, cached_tokens=599).transfer()
    assert ok and "decode computed 1 of 600" in said and "hybrid" in said
    assert not Evidence(prompt_tokens=600, cached_tokens=598).transfer()[0]
    assert not Evidence(prompt_tokens=1, cached_tokens=0).transfer()[0]


def test_no_count_proves_nothing() -> None:
    ok, said = Evidence(prompt_tokens=600).transfer()
    assert not ok and "--enable-prompt-tokens-details" in said


def test_probes_differ_from_their_first_words_to_their_last_and_salts_never_repeat() -> None:
    one, two = kvproof.fresh_text(200).split(), kvproof.fresh_text(200).split()
    assert len(one) >= 200 and one[1:8] != two[1:8] and one[-8:] != two[-8:]
    assert kvproof.fresh_salt("x") != kvproof.fresh_salt("x")
    assert len(kvproof.fresh_salt("verify")) <= 128


def test_a_probe_spans_four_blocks_of_the_engines_size_or_of_the_largest_default() -> None:
    assert kvproof.min_prompt_tokens(16) == 64
    assert kvproof.min_prompt_tokens(None) == 4 * 128
