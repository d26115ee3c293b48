"""The stack refuses, before it starts any instance, prefill and decode tensor-parallel sizes vLLM cannot
pair for the model it serves, and says how a supported heterogeneous pair maps; the proxy's prefix
affinity hashes prompts in the block size the engines are started with."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from pdserve.errors import ConfigError
from pdserve.stack import Stack, prefix_block_size
from pdserve.topology import RoleSpec, Topology


def _sim_topology(tmp_path: Path, decode_args: tuple[str, ...]) -> Topology:
    # The profile's engine: Llama-3-70B (8 KV heads) at TP 4, which prefill keeps.
    return Topology(
        engine="sim",
        sim_profile="llama3-70b-h100-tp4",
        decode=RoleSpec(args=decode_args),
        run_dir=str(tmp_path),
    )


def test_a_pair_vllm_cannot_map_is_refused_before_any_instance_starts(tmp_path: Path) -> None:
    stack = Stack(_sim_topology(tmp_path, ("--tensor-parallel-size", "3")), say=lambda _: None)
    with pytest.raises(ConfigError, match="prefill TP4 and decode TP3 cannot pair"):
        stack.start()
    assert stack.engines is None and stack.proxy is None


def test_a_supported_heterogeneous_pair_starts_and_is_described(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Stack, "_start", lambda *_: None)  # the instances themselves are not the point here
    said: list[str] = []
    Stack(_sim_topology(tmp_path, ("-tp", "8")), say=said.append).start()
    assert any(line.startswith("tensor parallel: prefill TP4 → decode TP8: 2 decode ranks") for line in said)


def test_prefix_affinity_hashes_in_the_block_size_the_engines_use() -> None:
    assert prefix_block_size(Topology(device="cuda")) == 16  # vLLM's defaults when nothing is set
    assert prefix_block_size(Topology(device="cpu")) == 128
    assert prefix_block_size(Topology(device="cuda", vllm_args=("--block-size", "64"))) == 64
    prefill_own = Topology(device="cuda", prefill=RoleSpec(args=("--block-size=128",)))
    assert prefix_block_size(prefill_own) == 128


def test_the_supervisor_hears_from_the_proxy_how_many_requests_it_has_at_an_instance(tmp_path: Path) -> None:
    # what decides whether a push decode's deferred request is an orphan (engines/stranded.py)
    # a profile whose steps take time: the zero-cost one streams a whole answer before the client reads
    topology = Topology(engine="sim", sim_profile="llama3-8b-h200", run_dir=str(tmp_path), proxy_port=19890,
                        first_port=19891, first_side_channel_port=19895)  # fmt: skip
    with Stack(topology, say=lambda _: None) as stack:
        [decode] = stack.urls("decode")
        body = {"model": stack.model.served_model_name if stack.model else "", "prompt": "hi",
                "max_tokens": 2000, "stream": True}  # fmt: skip
        assert stack._in_flight_at(decode) == 0
        with requests.post(f"{stack.proxy_url}/v1/completions", json=body, stream=True, timeout=30) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()  # kept: a generator dropped would close the stream
            next(lines)  # decode is streaming
            assert stack._in_flight_at(decode) == 1
        assert stack._in_flight_at("http://127.0.0.1:1") is None  # not an instance of this proxy
