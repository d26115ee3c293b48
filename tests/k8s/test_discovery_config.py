"""Discovery's configuration and its reading of a pod, without any server: what `pdserve proxy` accepts,
refuses at start, and which URL it makes of a pod."""

from __future__ import annotations

import pytest

from pdserve.cli import build_parser, main
from pdserve.config import ProxyConfig
from pdserve.configparts import K8sDiscovery, PoolSpec
from pdserve.errors import ConfigError
from pdserve.labels import label_selector
from pdserve.proxy.pool.discovery import pod_url
from pdserve.proxy.pool.k8s_watch import PodView


def test_a_proxy_with_discovery_starts_with_no_instances_and_one_without_does_not(
    capsys: pytest.CaptureFixture[str],
) -> None:
    both = (PoolSpec("prefill", selector="role=prefill"), PoolSpec("decode", selector="role=decode"))
    assert ProxyConfig(pools=both).is_discovering
    prefill_only = (PoolSpec("prefill", selector="role=prefill"), PoolSpec("decode"))
    assert ProxyConfig(pools=(prefill_only[0], PoolSpec("decode", ("http://d:1",)))).is_discovering
    with pytest.raises(ConfigError, match="prefill instance"):
        ProxyConfig(pools=(PoolSpec("prefill"), PoolSpec("decode", selector="role=decode")))
    with pytest.raises(ConfigError, match="decode instance"):
        ProxyConfig(pools=prefill_only)
    # --colocated has no prefill pool: a prefill selector beside it is refused as a prefill URL is.
    argv = ["proxy", "--colocated", "--k8s-prefill-selector", "a=b", "--k8s-decode-selector", "c=d"]
    assert main(argv) == 2
    assert "colocated" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="must differ"):
        ProxyConfig(pools=(PoolSpec("prefill", selector="a=b"), PoolSpec("decode", selector="a==b")))


def test_selectors_are_equality_labels_as_the_peers_take_them() -> None:
    assert label_selector("app.kubernetes.io/name=pdserve, llm-d.ai/role==prefill,tier=") == {
        "app.kubernetes.io/name": "pdserve",
        "llm-d.ai/role": "prefill",
        "tier": "",
    }
    for bad in ("", "role", "role!=prefill", "role in (a,b)", "a=b,a=c", "-x=y", "a=b c", "Bad_/x=y"):
        with pytest.raises(ConfigError):
            label_selector(bad)


@pytest.mark.parametrize(
    ("field", "value"),
    [("k8s_port", "0"), ("k8s_port", "Not_A_Port"), ("k8s_port", "99999"),
     ("k8s_port_annotation", "not an annotation"), ("k8s_api_server", "kubernetes:6443")],
)  # fmt: skip
def test_bad_discovery_settings_fail_at_start(field: str, value: str) -> None:
    with pytest.raises(ConfigError, match=field):  # named as the flag names it: --k8s-port
        K8sDiscovery(**{field.removeprefix("k8s_"): value})


def test_pdserve_proxy_takes_discovery_flags_instead_of_urls(capsys: pytest.CaptureFixture[str]) -> None:
    a = build_parser().parse_args(
        ["proxy", "--k8s-prefill-selector", "role=prefill", "--k8s-decode-selector", "role=decode",
         "--k8s-namespace", "llm", "--k8s-port", "http", "--k8s-api-server", "http://127.0.0.1:8001"]
    )  # fmt: skip
    assert (a.prefill, a.decode, a.k8s_namespace, a.k8s_port) == ([], [], "llm", "http")
    assert main(["proxy"]) == 2  # neither URLs nor selectors: refused before it serves
    assert "--k8s-prefill-selector" in capsys.readouterr().err


def pod(**fields: object) -> PodView:
    base: dict[str, object] = {"key": "ns/p", "ip": "10.1.2.3", "is_ready": True, "is_terminating": False}
    return PodView(**{**base, **fields})  # type: ignore[arg-type]


def test_a_pods_url_is_its_ip_and_the_annotated_named_or_given_port() -> None:
    annotation = "pdserve/port"
    assert pod_url(pod(), "8000", annotation) == ("http://10.1.2.3:8000", None)
    assert pod_url(pod(ports={"http": 8100}), "http", annotation) == ("http://10.1.2.3:8100", None)
    annotated = pod(ports={"http": 8100}, annotations={annotation: "9000"})
    assert pod_url(annotated, "http", annotation) == ("http://10.1.2.3:9000", None)
    assert pod_url(pod(ip="fd00::5"), "8000", annotation) == ("http://[fd00::5]:8000", None)
    assert pod_url(pod(ip=None), "8000", annotation) == (None, "no pod IP yet")
    url, why = pod_url(pod(ports={"metrics": 9090}), "http", annotation)
    assert url is None and why is not None and "'http'" in why
