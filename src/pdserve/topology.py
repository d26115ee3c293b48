"""Frozen, validated topology: what `pdserve up` starts, one ``RoleSpec`` per role (instances, their
arguments, addresses and Ray resources), the engine, the device and the ports. The proxy's own
configuration is config.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pdserve.addresses import check_addresses, reachable
from pdserve.configparts import ROLES, Role, check_port, check_positive
from pdserve.errors import ConfigError
from pdserve.tppairing import UNKNOWN_SHAPE, KVShape, TPPairing, block_size, pair_tp, tensor_parallel_size

Device = Literal["cpu", "cuda"]
EngineKind = Literal["vllm", "sim"]
OnInstanceExit = Literal["restart", "stop"]
# How prefill's KV reaches decode (docs/handover.md): decode READs it (pull, vLLM's NixlConnector) or
# prefill WRITEs it into blocks decode registered beforehand (push, NixlPushConnector).
KVTransfer = Literal["pull", "push"]

Resources = tuple[tuple[str, float], ...]  # Ray resources as sorted (name, amount) pairs


@dataclass(frozen=True)
class RoleSpec:
    """What a topology asks of one role: how many instances, and what each of them gets."""

    count: int = 1
    args: tuple[str, ...] = ()  # extra vLLM arguments for this role's instances (after vllm_args)
    # One address per instance (empty: all at the topology's host): it binds HTTP and its NIXL side
    # channel there, and prefill advertises it to decode as the side channel to dial (addresses.py).
    hosts: tuple[str, ...] = ()
    resources: Resources = ()  # Ray resources each instance needs (topology.ray)

    def check(self, where: str, *, is_on_ray: bool) -> None:
        """ConfigError naming ``where`` (``topology.prefill``) and the field when a value is wrong."""
        if not isinstance(self.args, tuple) or not all(isinstance(a, str) for a in self.args):
            raise ConfigError(f"{where}.args must be a list of strings")
        resources = self.resources
        if resources and not is_on_ray:
            raise ConfigError(f"{where}.resources are Ray resources: they need topology.ray")
        if not isinstance(resources, tuple) or not all(
            isinstance(p, tuple) and len(p) == 2 for p in resources
        ):
            raise ConfigError(f"{where}.resources must map Ray resource names to amounts")
        for name, amount in resources:
            if not isinstance(name, str) or not name or isinstance(amount, bool) or not amount > 0:
                raise ConfigError(f"{where}.resources: {name!r}: {amount!r} must be a name and an amount > 0")


@dataclass(frozen=True)
class Topology:
    """What `pdserve up` starts: N prefill and M decode vLLM instances plus the proxy, on one host; or,
    with ``elastic``, an elastic pool of N instances that each take any role.

    Each role is a ``RoleSpec`` (``topology.prefill``, ``topology.decode``, ``topology.elastic``, or
    ``topology.role(name)``): its count, arguments, addresses and Ray resources, as the topology file
    writes them. ``roles()`` lists the roles the topology starts, and everything that plans, places or
    names instances iterates it, so an elastic pool is one more role, not a mode."""

    engine: EngineKind = "vllm"  # "sim": pdserve's simulator instead of vLLM (scale and fault tests)
    sim_profile: str = "zero"  # the simulator's timing profile: a shipped name or a YAML file
    model: str | None = (
        None  # local directory or hub name; None → SmolLM2-135M-Instruct; "tiny": the random test model
    )
    prefill: RoleSpec = field(default_factory=RoleSpec)
    decode: RoleSpec = field(default_factory=RoleSpec)
    # Instead of prefill and decode: an elastic pool, instances of role "elastic" (elastic-0, ...) that
    # each can prefill for another, decode from another or serve a request whole; the proxy decides per
    # request (the proxy's elastic pool). None: a PD topology.
    elastic: RoleSpec | None = None
    host: str = "127.0.0.1"
    proxy_port: int = 8000
    first_port: int = 8100  # instance i (prefill first, then decode) listens on first_port + i
    first_side_channel_port: int = 5600  # NIXL side channel of instance i: first_side_channel_port + i
    device: Device = "cpu"
    # GPU placement (device cuda). gpus_per_instance >= 1 (whole) gives each instance its own GPUs;
    # below 1 (0.5, 0.25) instances share one GPU, as does instances_per_gpu: N. Neither set: one GPU
    # each when there are enough, else the instances share them evenly (the single-GPU 1P1D demo).
    gpus_per_instance: float | None = None
    instances_per_gpu: int | None = None
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE on CPU hosts
    # Microseconds NIXL's progress thread waits between polls (engines/enginesite); NIXL's own is 0, a
    # spinning core per instance. None: 100 on cpu (few cores, every one counts), 0 (NIXL's) on cuda.
    nixl_progress_delay_us: int | None = None
    kv_lease_s: float | None = None  # vLLM's kv_lease_duration (whole seconds); None: vLLM's 30 s
    # pull: decode reads the KV once prefill answered; push: prefill writes it into blocks decode
    # registered, so the proxy may send decode its request while prefill still runs (docs/handover.md)
    kv_transfer: KVTransfer = "pull"
    max_model_len: int | None = None  # None: 2048 for the models pdserve builds, the model's own otherwise
    vllm_args: tuple[str, ...] = ()  # extra arguments for every instance (a role's own args follow)
    engine_python: str | None = None  # python of the vLLM venv; None → discovered (engines/venv.py)
    startup_timeout: float = 600.0
    run_dir: str | None = None  # logs go here; None → runs/<timestamp>
    # vLLM exports its own spans here (--otlp-traces-endpoint, OTLP/HTTP); the proxy's join them
    otlp_traces_endpoint: str | None = None
    # restart: `up` restarts an instance that exits (engines/supervisor.py); stop: `up` exits with it
    on_instance_exit: OnInstanceExit = "restart"
    # Every prefill and decode instance able to take any role, as an elastic pool's are (the simulator's
    # role "both"): each can prefill for a remote decode, decode from a remote prefill, or serve a request
    # whole, so `bench --compare` can measure PD and colocated serving on the very same instances, one run
    # after the other, without restarting anything (engines/placement.py: what that takes of vLLM).
    kv_both: bool = False
    # A Ray cluster's address ("10.0.0.2:6379", "auto"): each instance then runs as a Ray actor on a node
    # with its role's resources (custom ones, e.g. {"pdserve_prefill": 1}; GPUs on cuda), at that node's
    # IP (engines/ray_cluster.py). None: on this host.
    ray: str | None = None

    def __post_init__(self) -> None:
        self._check_elastic()
        self._check_ray()
        # The model's KV heads are not known yet: the rules that need them run again once the stack has
        # resolved the model (stack.py, Stack.start); here, those that hold for every model.
        self.tp_pairing()
        if self.elastic is None and (self.prefill.count < 1 or self.decode.count < 1):
            raise ConfigError(
                f"topology needs >= 1 prefill and >= 1 decode instance, got "
                f"{self.prefill.count} prefill and {self.decode.count} decode"
            )
        if self.engine not in ("vllm", "sim"):
            raise ConfigError(f"topology.engine must be 'vllm' or 'sim', got {self.engine!r}")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"topology.device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.on_instance_exit not in ("restart", "stop"):
            raise ConfigError(
                f"topology.on_instance_exit must be 'restart' or 'stop', got {self.on_instance_exit!r}"
            )
        for name in ("proxy_port", "first_port", "first_side_channel_port"):
            check_port("topology", name, getattr(self, name))
        check_positive("topology", kv_cache_gib=self.kv_cache_gib, startup_timeout=self.startup_timeout)
        roles = [(name, spec.hosts, spec.count) for name, spec in self.roles()]
        check_addresses(self.host, roles, self.instance_hosts)
        self._check_gpu_placement()
        if self.max_model_len is not None:
            check_positive("topology", max_model_len=self.max_model_len)
        delay = self.nixl_progress_delay_us
        if delay is not None and (not isinstance(delay, int) or isinstance(delay, bool) or delay < 0):
            raise ConfigError(f"topology.nixl_progress_delay_us must be a whole number >= 0, got {delay!r}")
        if self.kv_transfer not in ("pull", "push"):
            raise ConfigError(f"topology.kv_transfer must be 'pull' or 'push', got {self.kv_transfer!r}")
        if self.kv_transfer == "push" and (self.elastic is not None or self.kv_both):
            # vLLM refuses to pair a push and a pull connector, and an instance of any role would
            # register blocks with itself: push is for a prefill pool and a decode pool
            raise ConfigError(
                "topology.kv_transfer push needs separate prefill and decode pools (not elastic, not kv_both)"
            )
        if self.kv_lease_s is not None and self.kv_lease_s < 6:
            # decode heartbeats every lease/6 s (integer division in vLLM): below 6 s that is 0
            raise ConfigError(f"topology.kv_lease_s must be >= 6 s, got {self.kv_lease_s}")
        last = max(self.first_port, self.first_side_channel_port) + self.num_instances - 1
        if last > 65535:
            raise ConfigError(f"topology has {self.num_instances} instances; ports would pass 65535")
        http = set(range(self.first_port, self.first_port + self.num_instances))
        side = set(range(self.first_side_channel_port, self.first_side_channel_port + self.num_instances))
        if http & side or self.proxy_port in http | side:
            raise ConfigError(
                "topology ports overlap: proxy_port, the HTTP ports from first_port and the side-channel "
                "ports from first_side_channel_port must all differ"
            )

    def roles(self) -> tuple[tuple[Role, RoleSpec], ...]:
        """Every role this topology starts, with its spec, in plan order (prefill first)."""
        if self.elastic is not None:
            return (("elastic", self.elastic),)
        return (("prefill", self.prefill), ("decode", self.decode))

    def role(self, name: Role) -> RoleSpec:
        """The spec of role ``name``; an elastic pool not asked for reads as the default spec."""
        spec: RoleSpec | None = getattr(self, name)
        return spec if spec is not None else RoleSpec()

    def vllm_args_for(self, name: Role) -> tuple[str, ...]:
        """The extra vLLM arguments role ``name``'s instances get: ``vllm_args``, then the role's own."""
        return (*self.vllm_args, *self.role(name).args)

    def tp_pairing(self, shape: KVShape = UNKNOWN_SHAPE, default_tp: int = 1) -> TPPairing | None:
        """How decode's tensor-parallel ranks read prefill's (tppairing.py), from the roles' vLLM arguments
        (``vllm_args``, then the role's own; ``default_tp`` where neither sets --tensor-parallel-size).
        ConfigError when vLLM's NixlConnector cannot pair them for a model of ``shape``. None for an
        elastic pool, whose instances share one set of arguments."""
        if self.elastic is not None:
            return None
        p_args, d_args = (self.vllm_args_for(r) for r in ROLES)
        try:
            return pair_tp(
                tensor_parallel_size(p_args, default_tp),
                tensor_parallel_size(d_args, default_tp),
                shape,
                prefill_block_size=block_size(p_args),
                decode_block_size=block_size(d_args),
            )
        except ConfigError as exc:
            raise ConfigError(f"topology.prefill.args / topology.decode.args: {exc}") from None

    @property
    def is_elastic(self) -> bool:
        return self.elastic is not None

    @property
    def instance_hosts(self) -> tuple[str, ...]:
        """The address of each instance in plan order (prefill first): its own, else ``host``; a
        wildcard ``host`` (0.0.0.0) is bound as given but reached and advertised as 127.0.0.1."""
        return tuple(
            host for _, spec in self.roles() for host in spec.hosts or (reachable(self.host),) * spec.count
        )

    @property
    def has_own_hosts(self) -> bool:
        """Whether some role names its instances' addresses (else they all bind ``host``)."""
        return any(spec.hosts for _, spec in self.roles())

    def _check_elastic(self) -> None:
        spec = self.elastic
        if spec is None:
            return
        if not isinstance(spec, RoleSpec):
            raise ConfigError(
                "topology.elastic must be a mapping with 'count', 'args', 'hosts' and/or 'resources'"
            )
        count = spec.count
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigError(f"topology.elastic needs >= 1 instance, got {count!r}")
        if self.prefill != RoleSpec() or self.decode != RoleSpec():
            raise ConfigError(
                "topology.elastic replaces prefill and decode (its instances take either role per request): "
                "set elastic, or prefill and decode, not both"
            )
        if self.kv_both:
            raise ConfigError(
                "topology.kv_both is for a prefill/decode topology (bench --compare); an elastic pool's "
                "instances take any role already"
            )

    def _check_ray(self) -> None:
        if self.ray is not None and (not isinstance(self.ray, str) or not self.ray.strip()):
            raise ConfigError(
                f"topology.ray must be a Ray address such as 10.0.0.2:6379 or auto, got {self.ray!r}"
            )
        if self.ray is not None and self.has_own_hosts:
            raise ConfigError(
                "topology sets ray and prefill/decode hosts: on Ray each instance runs at the IP of the node "
                "Ray places it on; name the nodes with resources (prefill.resources) instead"
            )
        for name, spec in self.roles():
            spec.check(f"topology.{name}", is_on_ray=self.ray is not None)

    def _check_gpu_placement(self) -> None:
        per_instance, per_gpu = self.gpus_per_instance, self.instances_per_gpu
        if per_instance is not None and per_gpu is not None:
            raise ConfigError(
                f"topology sets both gpus_per_instance ({per_instance}) and instances_per_gpu ({per_gpu}); "
                "set one of them"
            )
        if per_gpu is not None and (isinstance(per_gpu, bool) or not isinstance(per_gpu, int) or per_gpu < 1):
            raise ConfigError(f"topology.instances_per_gpu must be a whole number >= 1, got {per_gpu!r}")
        if per_instance is None:
            return
        if isinstance(per_instance, bool) or not isinstance(per_instance, int | float) or per_instance <= 0:
            raise ConfigError(f"topology.gpus_per_instance must be a number > 0, got {per_instance!r}")
        if per_instance >= 1 and per_instance != int(per_instance):
            raise ConfigError(
                f"topology.gpus_per_instance must be a whole number of GPUs when >= 1, got {per_instance}"
            )
        # Below 1 a GPU is split between N instances: 0.5 is two, 0.25 four. 0.3 splits nothing evenly.
        if per_instance < 1 and abs(1 / per_instance - round(1 / per_instance)) > 1e-6:
            raise ConfigError(
                f"topology.gpus_per_instance={per_instance} is not 1/N of a GPU for a whole N "
                f"(0.5, 0.25, ...); to put N instances on each GPU set instances_per_gpu: N instead"
            )

    @property
    def num_instances(self) -> int:
        return sum(spec.count for _, spec in self.roles())
