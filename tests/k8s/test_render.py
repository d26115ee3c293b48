"""`pdserve k8s render`: what it prints passes Kubernetes' own schemas, strictly, and wires up what the
proxy's discovery and vLLM's NixlConnector rely on.

Core objects go through `kubernetes-validate --strict` exactly as a user would run it; LeaderWorkerSet
(a CRD, unknown to it) through the vendored schema in schemas/, whose pod templates are Kubernetes' own.
No API server is involved: whether a real cluster schedules these pods is on paper (docs/deploying.md).
"""

from __future__ import annotations

import importlib.metadata
import json
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import referencing
import yaml

from pdserve.cli import build_parser, main, proxy_config_from_args
from pdserve.engines.placement import kv_transfer_config
from pdserve.labels import label_selector

KUBE_VERSIONS = ("1.29", "1.37")  # an older cluster and the newest schemas the validator ships
_SCHEMAS = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
LWS_SCHEMA = json.loads((Path(__file__).parent / "schemas" / "leaderworkerset-v1.json").read_text())

LAYOUTS = {  # name → `pdserve k8s render` arguments
    name: shlex.split(args)
    for name, args in {
        "1P1D": "",
        "2P3D on 2 GPUs a pod": "--prefill 2 --decode 3 --gpus-per-pod 2 --kv-lease 60 --env UCX_TLS=all "
        "--vllm-args '--max-num-seqs 64'",
        "CPU": "--device cpu --name cpu-pd --namespace llm",
        "multi-node": "--pods-per-instance 2 --gpus-per-pod 8 --decode 2",
    }.items()
}


def render(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[str, list[dict[str, Any]]]:
    assert main(["k8s", "render", "--model", "Qwen/Qwen3-8B", *args]) == 0
    text = capsys.readouterr().out
    return text, [doc for doc in yaml.safe_load_all(text) if doc]


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def kubernetes_validate_strict(path: Path, version: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", version, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def validate_lws(obj: dict[str, Any], version: str) -> None:
    """Against the vendored LeaderWorkerSet schema, its pod templates against ``version``'s own."""
    definitions = json.loads((_SCHEMAS / f"v{version}.0-local-strict" / "_definitions.json").read_text())
    registry: referencing.Registry[Any] = referencing.Registry().with_resources(
        [(definitions["$id"], referencing.Resource.from_contents(definitions))]
    )
    jsonschema.Draft202012Validator(LWS_SCHEMA, registry=registry).validate(obj)


def role_workloads(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    workloads = by_kind(objects, "Deployment") + by_kind(objects, "LeaderWorkerSet")
    return {o["metadata"]["labels"]["app.kubernetes.io/component"]: o for o in workloads}


def serving_template(workload: dict[str, Any]) -> dict[str, Any]:
    """The pod template whose pods serve HTTP (a LeaderWorkerSet's leader)."""
    spec = workload["spec"]
    return (
        spec["leaderWorkerTemplate"]["leaderTemplate"] if "leaderWorkerTemplate" in spec else spec["template"]
    )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_rendered_manifest_passes_strict_validation(
    layout: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    text, objects = render(capsys, *LAYOUTS[layout])
    path = tmp_path / "manifests.yaml"
    path.write_text(text)
    for version in KUBE_VERSIONS:
        run = kubernetes_validate_strict(path, version)
        assert run.returncode == 0, run.stdout + run.stderr
        passed = [line for line in run.stdout.splitlines() if line.startswith("INFO") and " passed " in line]
        core = [o for o in objects if o["kind"] != "LeaderWorkerSet"]
        assert len(passed) == len(core), run.stdout  # each core object validated, none skipped
        assert "ERROR" not in run.stdout
        for lws in by_kind(objects, "LeaderWorkerSet"):
            validate_lws(lws, version)
    assert {o["kind"] for o in objects} >= {"ServiceAccount", "Role", "RoleBinding", "Deployment", "Service"}


def test_the_validators_reject_a_misspelt_field(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A control: a strict check that passes everything proves nothing."""
    _, objects = render(capsys, "--pods-per-instance", "2")
    deployment = by_kind(objects, "Deployment")[0]
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(deployment))
    assert kubernetes_validate_strict(path, KUBE_VERSIONS[-1]).returncode != 0
    lws = by_kind(objects, "LeaderWorkerSet")[0]
    lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["imagePullPolcy"] = "x"
    with pytest.raises(jsonschema.ValidationError):
        validate_lws(lws, KUBE_VERSIONS[-1])
    lws["spec"]["leaderWorkerTemplate"] = {"size": 2, "restartPolicy": "Always"}
    with pytest.raises(jsonschema.ValidationError):
        validate_lws(lws, KUBE_VERSIONS[-1])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_vllm_pods_advertise_their_pod_ip_and_carry_their_role(
    layout: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = LAYOUTS[layout]
    _, objects = render(capsys, *args)
    device = "cpu" if "cpu" in args else "cuda"
    lease = 60.0 if "--kv-lease" in args else None
    for role, workload in role_workloads(objects).items():
        if role == "proxy":
            continue
        template = serving_template(workload)
        assert template["metadata"]["labels"]["llm-d.ai/role"] == role
        vllm = template["spec"]["containers"][0]
        env = {e["name"]: e for e in vllm["env"]}
        # decode dials the address prefill advertises: the pod's own IP, from the downward API
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"] == "5600"
        command = " ".join([*vllm["command"], *vllm["args"]])
        assert kv_transfer_config(role, device, lease) in command  # type: ignore[arg-type]
        assert vllm["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        assert {"name": "http", "containerPort": 8000} in vllm["ports"]
        gpus = vllm.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
        per_pod = args[args.index("--gpus-per-pod") + 1] if "--gpus-per-pod" in args else "1"
        assert gpus == (None if device == "cpu" else per_pod)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_proxy_discovers_exactly_the_pods_rendered_for_each_role(
    layout: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _, objects = render(capsys, *LAYOUTS[layout])
    workloads = role_workloads(objects)
    proxy_pod = workloads["proxy"]["spec"]["template"]
    container = proxy_pod["spec"]["containers"][0]
    # The proxy's arguments are pdserve's own flags and make a valid config with no static instances.
    a = build_parser().parse_args(container["args"])
    config = proxy_config_from_args(a)
    lws_leader = {"leaderworkerset.sigs.k8s.io/worker-index": "0"}  # set by the LWS controller on leaders
    discovery = config.discovery
    assert config.roles() == ("prefill", "decode")
    for role, selector in ((role, config.pool(role).selector) for role in config.roles()):
        assert selector is not None
        wanted = label_selector(selector)
        for other, workload in workloads.items():
            pod_labels = {**serving_template(workload)["metadata"]["labels"], **lws_leader}
            assert all(pod_labels.get(k) == v for k, v in wanted.items()) == (other == role), (role, other)
        ports = {p["name"] for p in serving_template(workloads[role])["spec"]["containers"][0]["ports"]}
        assert discovery.port in ports
    assert a.k8s_namespace == workloads["proxy"]["metadata"]["namespace"]


def test_the_proxy_image_is_the_one_make_image_tags(capsys: pytest.CaptureFixture[str]) -> None:
    # `make image` tags pdserve:<pyproject's version> (scripts/image.sh); an installed pdserve reports the
    # same version, so a stale install fails here rather than rendering an image nobody built.
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    version = pyproject["project"]["version"]
    assert importlib.metadata.version("pdserve") == version
    _, objects = render(capsys)
    (container,) = role_workloads(objects)["proxy"]["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"pdserve:{version}"
    assert container["command"] == ["pdserve"]  # on the image's PATH, instead of its entrypoint
    _, objects = render(capsys, "--proxy-image", "registry.example/pdserve:1.2.3")
    (container,) = role_workloads(objects)["proxy"]["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "registry.example/pdserve:1.2.3"


def test_the_proxy_may_watch_pods_and_nothing_else(capsys: pytest.CaptureFixture[str]) -> None:
    _, objects = render(capsys)
    (account,), (role,), (binding,) = (by_kind(objects, k) for k in ("ServiceAccount", "Role", "RoleBinding"))
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": "default"}
    ]
    proxy = role_workloads(objects)["proxy"]["spec"]["template"]
    assert proxy["spec"]["serviceAccountName"] == account["metadata"]["name"]
    (service,) = by_kind(objects, "Service")
    assert service["spec"]["selector"].items() <= proxy["metadata"]["labels"].items()
    assert service["spec"]["ports"][0]["targetPort"] in {
        p["name"] for p in proxy["spec"]["containers"][0]["ports"]
    }


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (["--vllm-args", "--port 9000"], "--port is set by the manifests"),
        (["--env", "VLLM_NIXL_SIDE_CHANNEL_HOST=10.0.0.1"], "VLLM_NIXL_SIDE_CHANNEL_HOST"),
        (["--name", "Not_A_Name"], "k8s.name"),
        (["--pods-per-instance", "2", "--device", "cpu"], "need GPUs"),
    ],
)
def test_render_refuses_what_would_break_the_deployment(
    args: list[str], complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["k8s", "render", "--model", "m", *args]) == 2
    captured = capsys.readouterr()
    assert complaint in captured.err and captured.out == ""


def test_a_checkout_run_without_installing_names_its_own_version(monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU host without network runs pdserve from src/ uninstalled: the proxy image is still tagged with
    the version pyproject.toml gives, not an import error."""
    import importlib.metadata

    import pdserve.k8s.spec as spec

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(spec, "version", missing)
    assert f"pdserve:{spec._own_version()}" == spec.PROXY_IMAGE
