"""`pdserve k8s render`: the Kubernetes objects of a PD deployment, as plain dicts and as YAML.

    ServiceAccount, Role, RoleBinding   the proxy may get/list/watch pods in its namespace, nothing more
    <name>-prefill, <name>-decode       Deployments (one pod per instance), or LeaderWorkerSets (a group of
                                        pods per instance, vLLM on Ray across them) with --pods-per-instance
    <name>-proxy                        `pdserve proxy` discovering both roles by label selector
    Service <name>                      the proxy, the one address clients use

Every vLLM pod advertises its own pod IP (downward API) as ``VLLM_NIXL_SIDE_CHANNEL_HOST``: decode dials
prefill's side channel at whatever address prefill puts in its ``kv_transfer_params``, and vLLM's default
(localhost) would send it to itself. Readiness is vLLM's /health, which is what the proxy's discovery
waits for before it sends a pod anything.
"""

from __future__ import annotations

import shlex
from typing import Any

import yaml

from pdserve.config import Role
from pdserve.engines.placement import kv_transfer_config
from pdserve.k8s.spec import ClusterSpec

Obj = dict[str, Any]

ROLE_LABEL = "llm-d.ai/role"  # llm-d's role label, so its tooling and dashboards see the same pods
LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"  # "0" on a group's leader
_RAY_PORT = 6379
# Between the proxy seeing deletionTimestamp (it drains the pod within a discovery pass) and vLLM getting
# SIGTERM: long enough that no new request is sent to a pod that is about to stop.
_PRE_STOP_S = 10


def labels(spec: ClusterSpec, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "pdserve",
        "app.kubernetes.io/instance": spec.name,
        "app.kubernetes.io/component": component,
    }


def selector(spec: ClusterSpec, role: Role) -> str:
    """The label selector the proxy discovers ``role``'s pods by (only leaders serve HTTP)."""
    text = f"app.kubernetes.io/instance={spec.name},{ROLE_LABEL}={role}"
    return text + f",{LWS_WORKER_INDEX}=0" if spec.is_multi_node else text


def render(spec: ClusterSpec) -> list[Obj]:
    return [
        *_rbac(spec),
        *(_instances(spec, role) for role, _ in spec.roles()),
        _proxy(spec),
        _service(spec),
    ]


def to_yaml(spec: ClusterSpec) -> str:
    """What `pdserve k8s render` prints: every object, with a header saying how to apply them."""
    header = ["# Rendered by `pdserve k8s render`. Apply with: kubectl apply -f FILE"]
    if spec.is_multi_node:
        header.append("# LeaderWorkerSet needs its controller installed first (https://lws.sigs.k8s.io).")
    return "\n".join(header) + "\n" + yaml.safe_dump_all(render(spec), sort_keys=False, width=120)


def _meta(spec: ClusterSpec, name: str, component: str) -> Obj:
    return {"name": name, "namespace": spec.namespace, "labels": labels(spec, component)}


def _rbac(spec: ClusterSpec) -> list[Obj]:
    name, meta = f"{spec.name}-proxy", _meta(spec, f"{spec.name}-proxy", "proxy")
    rule = {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta, "rules": [rule]},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": spec.namespace}],
        },
    ]


def _vllm_args(spec: ClusterSpec, role: Role) -> list[str]:
    args = [spec.model, "--host", "0.0.0.0", "--port", str(spec.port)]
    args += ["--kv-transfer-config", kv_transfer_config(role, spec.device, spec.kv_lease_s)]
    if spec.gpus_per_pod > 1:
        args += ["--tensor-parallel-size", str(spec.gpus_per_pod)]
    if spec.is_multi_node:  # one pipeline stage per pod of the group, placed by Ray
        args += [
            "--pipeline-parallel-size",
            str(spec.pods_per_instance),
            "--distributed-executor-backend",
            "ray",
        ]
    return [*args, *spec.vllm_args, *spec.role(role).args]


def _vllm_container(spec: ClusterSpec, role: Role, *, is_worker: bool = False) -> Obj:
    env: list[Obj] = [
        # The address decode dials for this pod's KV: its own pod IP, known only once it is scheduled.
        {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": str(spec.side_channel_port)},
        # POST /reset_prefix_cache, for the proxy's lease guard after a late pull (docs/kv-integrity.md).
        *([{"name": "VLLM_SERVER_DEV_MODE", "value": "1"}] if role == "decode" else []),
        *({"name": name, "value": value} for name, value in spec.env),
    ]
    container: Obj = {"name": "vllm", "image": spec.image}
    if not spec.is_multi_node:
        container |= {"command": ["vllm", "serve"], "args": _vllm_args(spec, role)}
    elif is_worker:  # a worker only lends its GPUs to the leader's Ray cluster
        join = f"ray start --address=$LWS_LEADER_ADDRESS:{_RAY_PORT} --block"
        container |= {"command": ["/bin/sh", "-c"], "args": [join]}
    else:
        serve = shlex.join(["vllm", "serve", *_vllm_args(spec, role)])
        container |= {
            "command": ["/bin/sh", "-c"],
            "args": [f"ray start --head --port={_RAY_PORT} && exec {serve}"],
        }
    container["env"] = env
    container["ports"] = [
        {"name": "http", "containerPort": spec.port},
        {"name": "nixl", "containerPort": spec.side_channel_port},
    ]
    if not is_worker:
        health = {"httpGet": {"path": "/health", "port": "http"}}
        container |= {
            # Out of the proxy's pools until vLLM answers; the proxy takes a pod out when this fails.
            "readinessProbe": {**health, "periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 3},
            # Loading weights can take many minutes; restart only an engine that stops answering for a minute.
            "startupProbe": {**health, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 180},
            "livenessProbe": {**health, "periodSeconds": 10, "timeoutSeconds": 10, "failureThreshold": 6},
            "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(_PRE_STOP_S)]}}},
        }
    if spec.device == "cuda":
        gpus = {"nvidia.com/gpu": str(spec.gpus_per_pod)}
        container["resources"] = {"requests": gpus, "limits": gpus}
    container["volumeMounts"] = [{"name": "shm", "mountPath": "/dev/shm"}]
    return container


def _pod_template(spec: ClusterSpec, role: Role, *, is_worker: bool = False) -> Obj:
    return {
        "metadata": {"labels": {**labels(spec, role), ROLE_LABEL: role}},
        "spec": {
            "containers": [_vllm_container(spec, role, is_worker=is_worker)],
            # NCCL and vLLM's workers share tensors through /dev/shm; a container's default is 64 MiB.
            "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"}}],
            "terminationGracePeriodSeconds": _PRE_STOP_S + 50,
        },
    }


def _instances(spec: ClusterSpec, role: Role) -> Obj:
    name = f"{spec.name}-{role}"
    replicas = spec.role(role).count
    if not spec.is_multi_node:
        return {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": _meta(spec, name, role),
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": labels(spec, role)},
                "template": _pod_template(spec, role),
            },
        }
    return {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": _meta(spec, name, role),
        "spec": {
            "replicas": replicas,
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": spec.pods_per_instance,
                # A pipeline stage lost is the whole instance lost: restart the group together.
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": _pod_template(spec, role),
                "workerTemplate": _pod_template(spec, role, is_worker=True),
            },
        },
    }


def _proxy(spec: ClusterSpec) -> Obj:
    args = ["--log-level", "info", "proxy", "--host", "0.0.0.0", "--port", str(spec.proxy_port)]
    args += ["--k8s-namespace", spec.namespace, "--k8s-port", "http"]
    args += [
        "--k8s-prefill-selector",
        selector(spec, "prefill"),
        "--k8s-decode-selector",
        selector(spec, "decode"),
    ]
    if spec.kv_lease_s is not None:
        args += ["--kv-lease", f"{spec.kv_lease_s:g}"]
    container = {
        "name": "proxy",
        "image": spec.proxy_image,
        "command": ["pdserve"],
        "args": args,
        "ports": [{"name": "http", "containerPort": spec.proxy_port}],
        # Ready (in the Service) once it can serve: at least one prefill and one decode pod discovered.
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5},
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(spec, f"{spec.name}-proxy", "proxy"),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels(spec, "proxy")},
            "template": {
                "metadata": {"labels": labels(spec, "proxy")},
                "spec": {"serviceAccountName": f"{spec.name}-proxy", "containers": [container]},
            },
        },
    }


def _service(spec: ClusterSpec) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(spec, spec.name, "proxy"),
        "spec": {
            "selector": labels(spec, "proxy"),
            "ports": [{"name": "http", "port": spec.proxy_port, "targetPort": "http"}],
        },
    }
