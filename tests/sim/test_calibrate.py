"""Calibration math and output: the fit recovers known step costs, its YAML loads as a Profile, and every
shipped profile loads and validates. No network: the measurement is built by hand."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pdserve.errors import PDServeError
from pdserve.sim.calibrate import Measurement, Point, parse_sets, profile_yaml, steady_decode
from pdserve.sim.fit import least_squares, quantile
from pdserve.sim.probe import Sample
from pdserve.sim.profile import Profile, load_profile, named_profiles

BASE, PER_SEQ, PER_CTX = 2.0e-3, 5.0e-4, 3.0e-7
OVERHEAD, PER_TOKEN = 2.5e-2, 6.0e-5


def decode_points(noise: float = 0.0, seed: int = 1) -> list[Point]:
    rng = random.Random(seed)
    points = []
    for b in (1, 2, 4, 8):
        for ctx in (32, 528, 1552):
            y = BASE + PER_SEQ * b + PER_CTX * b * ctx
            points.append(Point((1.0, float(b), float(b * ctx)), y * (1 + rng.gauss(0, noise)), f"B={b}"))
    return points


def prefill_points(noise: float = 0.0, seed: int = 2) -> list[Point]:
    rng = random.Random(seed)
    return [
        Point((1.0, float(n)), (OVERHEAD + PER_TOKEN * n) * (1 + rng.gauss(0, noise)), f"{n} tokens")
        for n in (16, 64, 128, 256, 512, 768, 1024)
    ]


def test_fit_recovers_decode_step_costs_through_five_percent_noise() -> None:
    points = decode_points(noise=0.05)
    fit = least_squares([p.row for p in points], [p.y for p in points])
    base, per_seq, per_ctx = fit.coefficients
    assert base == pytest.approx(BASE, rel=0.5)  # the intercept is the least constrained term
    assert per_seq == pytest.approx(PER_SEQ, rel=0.2)
    assert per_ctx == pytest.approx(PER_CTX, rel=0.2)
    assert fit.r_squared > 0.95


def test_fit_is_exact_on_noiseless_data() -> None:
    points = prefill_points()
    fit = least_squares([p.row for p in points], [p.y for p in points])
    assert fit.coefficients == pytest.approx((OVERHEAD, PER_TOKEN), rel=1e-9)
    assert fit.r_squared == pytest.approx(1.0)
    assert fit.rmse == pytest.approx(0.0, abs=1e-12)
    assert fit.predict((1.0, 100.0)) == pytest.approx(OVERHEAD + PER_TOKEN * 100)


def test_fit_refuses_data_that_cannot_determine_the_unknowns() -> None:
    with pytest.raises(ValueError, match="cannot determine"):
        least_squares([(1.0, 2.0, 3.0)], [1.0])
    with pytest.raises(ValueError, match="combination"):  # the batch size never varies
        least_squares([(1.0, 4.0), (1.0, 4.0), (1.0, 4.0)], [1.0, 2.0, 3.0])


def test_quantile_interpolates_and_half_is_the_median() -> None:
    assert quantile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert quantile([4.0, 1.0, 3.0, 2.0], 0.25) == pytest.approx(1.75)
    assert quantile([7.0], 0.25) == 7.0


def test_steady_decode_counts_only_tokens_while_the_whole_batch_decodes() -> None:
    # Two requests: A gets its first token at t=1 and B at t=3; A ends at 9, B at 11. Tokens every 1 s,
    # except one chunk of A carrying two tokens (a coalesced chunk counts as two).
    a = Sample(
        prompt_tokens=100, sent_at=0.0, chunks=((1.0, 1), (2.0, 1), (3.0, 1), (5.0, 2), (6.0, 1), (9.0, 1))
    )
    b = Sample(prompt_tokens=10, sent_at=0.0, chunks=tuple((float(t), 1) for t in range(3, 12)))
    rates = steady_decode([a, b])
    # Window [3, 9]: A has chunks at 3, 5(2), 6, 9 -> 4 tokens in 6 s; B has 3..9 -> 6 tokens in 6 s.
    assert [r for r, _ in rates] == pytest.approx([1.5, 1.0])
    assert rates[1][1] == pytest.approx(10 + 1 + 3)  # prompt + generated before the window + half its tokens


def test_steady_decode_drops_a_stream_that_arrived_in_one_burst() -> None:
    burst = Sample(prompt_tokens=16, sent_at=0.0, chunks=tuple((1.0 + i * 1e-6, 1) for i in range(32)))
    assert steady_decode([burst]) == []


def test_a_burst_stream_does_not_spoil_the_window_of_the_others() -> None:
    steady = [Sample(16, 0.0, tuple((float(t), 1) for t in range(1, 11))) for _ in range(2)]
    burst = Sample(16, 0.0, tuple((1.0 + i * 1e-6, 1) for i in range(10)))  # all ten tokens at t=1
    assert [r for r, _ in steady_decode([*steady, burst])] == pytest.approx([1.0, 1.0])


def measurement(prefill: list[Point], decode: list[Point]) -> Measurement:
    found = {
        "served_model_name": "pdserve-tiny",
        "max_model_len": 2048,
        "block_size": 128,
        "num_blocks": 8192,
    }
    return Measurement("http://localhost:9300", "0.32.0", found, 0.001, 0.5, prefill, decode, 12.0)


def test_calibrated_yaml_loads_as_a_profile_with_the_fitted_and_discovered_values(tmp_path: Path) -> None:
    sets = parse_sets(["max_num_seqs=128", "kv_pull_base_s=0.002"])
    text = profile_yaml(
        measurement(prefill_points(), decode_points()), sets, "pdserve sim calibrate URL", "2026-01-02"
    )
    path = tmp_path / "tiny.yaml"
    path.write_text(text)
    profile = load_profile(str(path))
    assert profile.name == "tiny"
    assert profile.step_base_s == pytest.approx(BASE, rel=1e-3)
    assert profile.prefill_per_token_s == pytest.approx(PER_TOKEN, rel=1e-3)
    assert profile.decode_per_seq_s == pytest.approx(PER_SEQ, rel=1e-3)
    assert profile.decode_per_ctx_token_s == pytest.approx(PER_CTX, rel=1e-3)
    assert (profile.block_size, profile.num_blocks, profile.max_model_len) == (128, 8192, 2048)
    assert profile.served_model_name == "pdserve-tiny"
    assert (profile.max_num_seqs, profile.kv_pull_base_s) == (128, 0.002)
    assert "http://localhost:9300" in profile.source and "R²=1.000" in profile.source
    assert "# Prefill" in text and "# Decode" in text  # the evidence travels with the numbers


def test_a_negative_fit_is_written_as_zero(tmp_path: Path) -> None:
    decode = [Point(p.row, BASE + PER_SEQ * p.row[1] - 1e-8 * p.row[2], p.label) for p in decode_points()]
    path = tmp_path / "neg.yaml"
    path.write_text(profile_yaml(measurement(prefill_points(), decode), {}, "cmd", "2026-01-02"))
    assert load_profile(str(path)).decode_per_ctx_token_s == 0.0


def test_set_rejects_fields_a_profile_does_not_have() -> None:
    with pytest.raises(PDServeError, match="max_num_seqs"):
        parse_sets(["max_num_sequences=12"])
    with pytest.raises(PDServeError):
        parse_sets(["max_num_seqs"])
    with pytest.raises(PDServeError, match="not YAML"):  # a clear error, not yaml's traceback
        parse_sets(["max_num_seqs=[12"])


@pytest.mark.parametrize("name", sorted(named_profiles()))
def test_every_shipped_profile_loads_validates_and_cites_its_source(name: str) -> None:
    profile = load_profile(name)
    assert isinstance(profile, Profile) and profile.name == name
    assert profile.source.strip(), "a shipped profile must say where its numbers come from"
    assert not profile.is_zero_cost
    # A lone decode step costs more than nothing; a long prefill costs more than a short one.
    assert 0 < profile.step_seconds(0, 1, 100) < profile.step_seconds(1000, 1, 100)


def test_the_shipped_profiles_include_the_measured_cpu_one_and_two_gpu_ones() -> None:
    assert {"tiny-cpu", "llama3-8b-a100", "llama3-70b-h100-tp4"} <= set(named_profiles())
