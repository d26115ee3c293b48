"""What `pdserve k8s render` is asked for: a frozen, validated ``ClusterSpec`` (the CLI builds it)."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from pdserve.config import ROLES, Role
from pdserve.errors import ConfigError
from pdserve.topology import Device

# Object names become DNS labels (RFC 1035) with a suffix ("-prefill"): keep room for it.
_NAME = re.compile(r"[a-z]([-a-z0-9]{0,48}[a-z0-9])?")
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Flags the manifests own: a user value would break the ports, roles or parallelism they wire up.
_RESERVED_FLAGS = ("--host", "--port", "--kv-transfer-config", "--tensor-parallel-size",
                   "--pipeline-parallel-size", "--distributed-executor-backend")  # fmt: skip
# The image `make image` builds from the Dockerfile, tagged with the package's version: manifests rendered
# by a release name that release's proxy.


def _own_version() -> str:
    """pdserve's version: its package metadata, or, in a checkout run from src/ without installing (as on a
    GPU host without network), the pyproject.toml beside src/."""
    try:
        return version("pdserve")
    except PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[3] / "pyproject.toml"
        try:
            return str(tomllib.loads(pyproject.read_text())["project"]["version"])
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "dev"


PROXY_IMAGE = f"pdserve:{_own_version()}"
# Variables the manifests set themselves: the side channel is the pod's own address, never a guess.
_RESERVED_ENV = ("VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT")


@dataclass(frozen=True)
class RolePods:
    """One role's instances in the cluster."""

    count: int = 1  # instances (Deployment replicas, or LeaderWorkerSet groups)
    args: tuple[str, ...] = ()  # extra `vllm serve` arguments for this role (after vllm_args)


@dataclass(frozen=True)
class ClusterSpec:
    model: str  # what `vllm serve` loads: a hub name, or a path the image or a volume provides
    name: str = "pdserve"  # prefix of every object's name, and the app.kubernetes.io/instance label
    namespace: str = "default"
    image: str = "vllm/vllm-openai:v0.32.0"  # the vLLM image: the same version on both roles
    proxy_image: str = PROXY_IMAGE  # an image with `pip install 'pdserve[k8s]'` (docs/deploying.md)
    prefill: RolePods = field(default_factory=RolePods)
    decode: RolePods = field(default_factory=RolePods)
    gpus_per_pod: int = 1  # nvidia.com/gpu of each pod; also vLLM's --tensor-parallel-size
    pods_per_instance: int = 1  # > 1: a LeaderWorkerSet group per instance, vLLM on Ray across its pods
    device: Device = "cuda"  # "cpu": no GPU requests, KV buffers in host memory
    port: int = 8000  # vLLM's HTTP port in each pod
    side_channel_port: int = 5600  # VLLM_NIXL_SIDE_CHANNEL_PORT in each pod
    proxy_port: int = 8000  # the Service's port
    kv_lease_s: float | None = None  # vLLM's kv_lease_duration; the proxy is told the same
    vllm_args: tuple[str, ...] = ()  # extra `vllm serve` arguments for every instance
    env: tuple[tuple[str, str], ...] = ()  # extra environment for the vLLM containers (UCX_TLS, …)

    def __post_init__(self) -> None:
        if not self.model.strip():
            raise ConfigError("k8s.model must name a model (--model)")
        if not _NAME.fullmatch(self.name):
            raise ConfigError(
                f"k8s.name must be a lowercase DNS label of at most 50 characters, got {self.name!r}"
            )
        if not _NAMESPACE.fullmatch(self.namespace):
            raise ConfigError(f"k8s.namespace must be a lowercase DNS label, got {self.namespace!r}")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"k8s.device must be 'cpu' or 'cuda', got {self.device!r}")
        counts = {f"{name}.count": pods.count for name, pods in self.roles()}
        counts |= {"gpus_per_pod": self.gpus_per_pod, "pods_per_instance": self.pods_per_instance}
        for field_name, value in counts.items():
            if value < 1:
                raise ConfigError(f"k8s.{field_name} must be >= 1, got {value}")
        if self.device == "cpu" and self.pods_per_instance > 1:
            raise ConfigError("k8s: instances spanning several pods need GPUs (--device cuda)")
        ports = (self.port, self.side_channel_port)
        if any(not 0 < p <= 65535 for p in (*ports, self.proxy_port)) or ports[0] == ports[1]:
            raise ConfigError(
                "k8s: port, side_channel_port and proxy_port must be TCP ports; the first two differ"
            )
        if self.kv_lease_s is not None and self.kv_lease_s < 6:
            # decode heartbeats every lease/6 s (integer division in vLLM): below 6 s that is 0
            raise ConfigError(f"k8s.kv_lease_s must be >= 6 s, got {self.kv_lease_s}")
        for arg in (*self.vllm_args, *(arg for _, pods in self.roles() for arg in pods.args)):
            if arg.split("=", 1)[0] in _RESERVED_FLAGS:
                raise ConfigError(f"k8s: {arg.split('=', 1)[0]} is set by the manifests; leave it out")
        for name, _ in self.env:
            if not _ENV_NAME.fullmatch(name) or name in _RESERVED_ENV:
                raise ConfigError(f"k8s.env: {name!r} is not a variable the manifests let you set")

    def roles(self) -> tuple[tuple[Role, RolePods], ...]:
        return tuple((name, self.role(name)) for name in ROLES)

    def role(self, name: Role) -> RolePods:
        return {"prefill": self.prefill, "decode": self.decode}[name]

    @property
    def is_multi_node(self) -> bool:
        return self.pods_per_instance > 1


def parse_env(items: list[str]) -> tuple[tuple[str, str], ...]:
    """``["UCX_TLS=tcp,cuda_copy"]`` → ``(("UCX_TLS", "tcp,cuda_copy"),)``."""
    pairs = []
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--env {item!r}: expected NAME=VALUE")
        pairs.append((name, value))
    return tuple(pairs)
