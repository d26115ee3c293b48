"""The flags and entry point of `pdserve k8s render` (cli.py adds the subcommand), and the Kubernetes
discovery flags of `pdserve proxy`.

Kept out of cli.py so the manifests' many knobs live next to the ``ClusterSpec`` they fill.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from typing import Any

from pdserve.configparts import K8sDiscovery
from pdserve.k8s.manifests import to_yaml
from pdserve.k8s.spec import ClusterSpec, RolePods, parse_env


def cmd_k8s_render(a: argparse.Namespace) -> int:
    spec = ClusterSpec(
        model=a.model, name=a.name, namespace=a.namespace, image=a.image, proxy_image=a.proxy_image,
        prefill=RolePods(a.prefill, tuple(shlex.split(a.prefill_args))),
        decode=RolePods(a.decode, tuple(shlex.split(a.decode_args))), gpus_per_pod=a.gpus_per_pod,
        pods_per_instance=a.pods_per_instance, device=a.device, kv_lease_s=a.kv_lease,
        vllm_args=tuple(shlex.split(a.vllm_args)), env=parse_env(a.env),
    )  # fmt: skip
    sys.stdout.write(to_yaml(spec))
    return 0


def add_k8s_render(sub: Any) -> None:
    k8s = sub.add_parser("k8s", help="Kubernetes: `pdserve k8s render` writes the manifests to apply")
    render = k8s.add_subparsers(dest="k8s_command", required=True).add_parser(
        "render",
        help="print prefill/decode Deployments (or LeaderWorkerSets), the proxy, its Service and RBAC",
    )
    d = {f.name: f.default for f in dataclasses.fields(ClusterSpec)}
    render.add_argument(
        "--model", required=True, help="what `vllm serve` loads in every pod (hub name or path)"
    )
    render.add_argument("--name", default=d["name"], help="prefix of every object (default %(default)s)")
    render.add_argument("--namespace", default=d["namespace"], help="(default %(default)s)")
    render.add_argument("--image", default=d["image"], help="the vLLM image (default %(default)s)")
    render.add_argument("--proxy-image", default=d["proxy_image"],
                        help="the proxy's image, as `make image` builds it (default %(default)s)")  # fmt: skip
    pods = RolePods()
    render.add_argument("--prefill", type=int, default=pods.count, metavar="N", help="prefill instances")
    render.add_argument("--decode", type=int, default=pods.count, metavar="M", help="decode instances")
    render.add_argument("--gpus-per-pod", type=int, default=d["gpus_per_pod"], metavar="G",
                        help="nvidia.com/gpu per pod, and vLLM's --tensor-parallel-size (default %(default)s)")  # fmt: skip
    render.add_argument("--pods-per-instance", type=int, default=d["pods_per_instance"], metavar="K",
                        help="K > 1: each instance a LeaderWorkerSet group of K pods, vLLM on Ray")  # fmt: skip
    render.add_argument("--device", choices=("cuda", "cpu"), default=d["device"])
    render.add_argument(
        "--kv-lease", type=float, metavar="S", help="vLLM's kv_lease_duration (default vLLM's 30 s)"
    )
    render.add_argument(
        "--vllm-args", default="", metavar="'ARGS'", help="extra `vllm serve` arguments, one string"
    )
    render.add_argument(
        "--prefill-args", default="", metavar="'ARGS'", help="extra arguments for prefill only"
    )
    render.add_argument("--decode-args", default="", metavar="'ARGS'", help="extra arguments for decode only")
    render.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="environment for the vLLM containers (repeatable), e.g. UCX_TLS=all")  # fmt: skip
    render.set_defaults(func=cmd_k8s_render)


def add_k8s_discovery(p: argparse.ArgumentParser) -> None:
    """`pdserve proxy`'s discovery flags; their defaults are K8sDiscovery's own."""
    d = K8sDiscovery()
    g = p.add_argument_group("Kubernetes discovery (pip install 'pdserve[k8s]'; docs/deploying.md)")
    g.add_argument("--k8s-prefill-selector", metavar="K=V,…",
                   help="prefill pods: Ready ones matching these labels join the prefill pool")  # fmt: skip
    g.add_argument("--k8s-decode-selector", metavar="K=V,…", help="decode pods, as --k8s-prefill-selector")
    g.add_argument(
        "--k8s-namespace", help="the pods' namespace (default: the proxy's own, or the kubeconfig's)"
    )
    g.add_argument("--k8s-port", default=d.port, metavar="PORT|NAME",
                   help="the pods' HTTP port: a number or a container port name (default %(default)s)")  # fmt: skip
    g.add_argument("--k8s-port-annotation", default=d.port_annotation, metavar="KEY",
                   help="a pod annotation whose port number overrides --k8s-port (default %(default)s)")  # fmt: skip
    g.add_argument("--k8s-api-server", metavar="URL",
                   help="the API server (e.g. `kubectl proxy`'s); default: in-cluster, then the kubeconfig")  # fmt: skip


def k8s_discovery(a: argparse.Namespace) -> K8sDiscovery:
    """Where those flags find pods; their selectors name the pools' pods (cli.py, ``PoolSpec.selector``)."""
    return K8sDiscovery(
        namespace=a.k8s_namespace,
        port=a.k8s_port,
        port_annotation=a.k8s_port_annotation,
        api_server=a.k8s_api_server,
    )
