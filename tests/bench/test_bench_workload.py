"""What `pdserve bench` hands `vllm bench serve`: SLOs in vLLM's syntax, and each dataset's flags."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pdserve.bench.inputs import sharegpt_sample, write_sim_tokenizer
from pdserve.bench.workload import Workload, client_args
from pdserve.errors import ConfigError
from pdserve.slo import Slo


def args_of(workload: Workload, rate: float = math.inf, **kwargs: str) -> list[str]:
    return client_args(workload, "http://127.0.0.1:21000", rate, "/tmp/out", "run.json", seed=7, salt="s1",
                       **kwargs)  # fmt: skip


def value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_slos_parse_from_vllms_goodput_syntax_and_go_back_to_it() -> None:
    slo = Slo.parse(["ttft:200", "tpot:50"])
    assert (slo.ttft_ms, slo.tpot_ms, slo.e2el_ms) == (200, 50, None)
    assert slo.goodput_args() == ["--goodput", "ttft:200", "tpot:50"]
    assert slo.describe() == "TTFT ≤ 200 ms, TPOT ≤ 50 ms"
    assert Slo().goodput_args() == [] and not Slo().is_set


@pytest.mark.parametrize("bad", ["ttft=200", "latency:5", "ttft:fast", "tpot:0", "e2el:-1"])
def test_a_bad_slo_is_refused_with_the_syntax(bad: str) -> None:
    with pytest.raises(ConfigError):
        Slo.parse([bad])


def test_random_prompts_at_a_rate_with_every_detail_saved() -> None:
    args = args_of(Workload(input_len=256, output_len=32, num_prompts=10, slo=Slo(ttft_ms=300)), rate=4.0)
    assert value(args, "--dataset-name") == "random"
    assert (value(args, "--random-input-len"), value(args, "--random-output-len")) == ("256", "32")
    assert (value(args, "--num-prompts"), value(args, "--request-rate"), value(args, "--seed")) == (
        "10",
        "4",
        "7",
    )
    assert value(args, "--goodput") == "ttft:300"
    assert {"--save-result", "--save-detailed", "--ignore-eos"} <= set(args)
    assert value(args, "--percentile-metrics") == "ttft,tpot,itl,e2el"
    assert (value(args, "--result-dir"), value(args, "--result-filename")) == ("/tmp/out", "run.json")
    # A salt of its own: no run is served from another run's prefix cache.
    assert json.loads(value(args, "--extra-body")) == {"cache_salt": "s1"}
    assert "--max-concurrency" not in args


def test_concurrency_cap_all_at_once() -> None:
    args = args_of(Workload(max_concurrency=4))
    assert (value(args, "--request-rate"), value(args, "--max-concurrency")) == ("inf", "4")


def test_shared_prefix_prompts_use_vllms_prefix_repetition_dataset() -> None:
    args = args_of(Workload(dataset="prefix", input_len=512, prefix_len=384, num_prefixes=2, output_len=8))
    assert value(args, "--dataset-name") == "prefix_repetition"
    assert value(args, "--prefix-repetition-prefix-len") == "384"
    assert value(args, "--prefix-repetition-suffix-len") == "128"
    assert value(args, "--prefix-repetition-num-prefixes") == "2"
    assert value(args, "--prefix-repetition-output-len") == "8"


def test_sharegpt_needs_a_file_and_passes_it_on() -> None:
    with pytest.raises(ConfigError, match="file"):
        args_of(Workload(dataset="sharegpt"))
    args = args_of(Workload(dataset="sharegpt"), dataset_path="/data/sg.json", tokenizer="/tok", label="x")
    assert (value(args, "--dataset-name"), value(args, "--dataset-path")) == ("sharegpt", "/data/sg.json")
    assert (value(args, "--tokenizer"), value(args, "--label")) == ("/tok", "x")


@pytest.mark.parametrize(
    "changes",
    [{"num_prompts": 0}, {"request_rates": ()}, {"request_rates": (0.0,)}, {"max_concurrency": 0},
     {"dataset": "prefix", "prefix_len": 512, "input_len": 512}, {"dataset": "prefix", "num_prefixes": 200},
     {"dataset": "lmsys"}, {"num_warmups": -1}],
)  # fmt: skip
def test_an_impossible_workload_is_refused_before_anything_starts(changes: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        Workload(**changes)  # type: ignore[arg-type]


def test_the_sharegpt_sample_has_sharegpts_shape_and_is_reproducible() -> None:
    sample = sharegpt_sample(20, seed=3)
    assert sample == sharegpt_sample(20, seed=3) != sharegpt_sample(20, seed=4)
    turns = sample[0]["conversations"]
    assert isinstance(turns, list) and [t["from"] for t in turns] == ["human", "gpt"]
    lengths = [len(e["conversations"][0]["value"].split()) for e in sample]  # type: ignore[index]
    assert min(lengths) >= 8 and max(lengths) <= 250 and len(set(lengths)) > 5


def test_the_sim_tokenizer_counts_one_token_per_word(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    directory = write_sim_tokenizer(tmp_path / "tok")
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    assert len(tokenizer.encode("bababa bababe bababi").ids) == 3
