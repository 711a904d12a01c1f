"""Connecting to Ray and placing the backend's actors by resources.

`connect` joins the cluster named by `RaySpec.address`, or starts a private single-node
Ray bound to loopback (`_node_ip_address="127.0.0.1"`, no dashboard). Ray's own
servers may still listen on wildcard addresses and probe a public DNS address to find
the node's IP; where that matters, run the driver in a network namespace that has only
`lo` (see the README and `tests/distributed`).

`place` turns a plain actor class of `actors.py` into a Ray actor of one role:
engine replicas and the trainer ask for a GPU when the cluster has GPUs (unless the
spec says otherwise), environment workers for CPUs only. Replicas and environment
workers are restarted by Ray (`max_restarts`); their in-flight calls fail with
`RayActorError` and the clients retry them. The trainer is not restarted by Ray: its
client builds a new one and restores it from checkpoints (`trainer_client.py`).
"""

from __future__ import annotations

from typing import Any, Literal

import ray

from marlaas.config.ray import ActorResources, RaySpec
from marlaas.errors import ConfigError

Role = Literal["engine", "trainer", "env"]

#: Environment variables every worker process gets (offline Hugging Face, quiet tokenizers).
WORKER_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def connect(spec: RaySpec) -> None:
    """Initialise Ray for this process unless it already is (see the module docstring)."""
    if ray.is_initialized():
        return
    kwargs: dict[str, Any] = {
        "include_dashboard": False,
        "log_to_driver": False,
        "runtime_env": {"env_vars": dict(WORKER_ENV)},
    }
    if spec.address is None:
        kwargs["_node_ip_address"] = "127.0.0.1"
        if spec.num_cpus is not None:
            kwargs["num_cpus"] = spec.num_cpus
        if spec.object_store_mb is not None:
            kwargs["object_store_memory"] = spec.object_store_mb * 2**20
    else:
        kwargs.pop("include_dashboard")
        kwargs["address"] = spec.address
    try:
        ray.init(**kwargs)
    except ConnectionError as e:
        raise ConfigError(
            f"cannot reach the Ray cluster at {spec.address!r}: {e}; start it with "
            "`ray start --head` or set ray.address to None for a private local Ray"
        ) from e


def cluster_gpus() -> float:
    return float(ray.cluster_resources().get("GPU", 0.0))


def actor_options(role: Role, res: ActorResources, spec: RaySpec) -> dict[str, Any]:
    """Ray actor options of one role: resources, restarts, concurrency."""
    gpus = res.num_gpus
    if gpus is None:
        gpus = 1.0 if role != "env" and cluster_gpus() > 0 else 0.0
    options: dict[str, Any] = {
        "num_cpus": res.num_cpus,
        "num_gpus": gpus,
        "resources": dict(res.resources),
        "max_restarts": 0 if role == "trainer" else spec.max_restarts,
        "max_task_retries": 0,  # retried by the clients, who know what is safe to resend
    }
    if role == "trainer":
        options["max_concurrency"] = 1
    _check_feasible(role, options)
    return options


def place(cls: type, role: Role, res: ActorResources, spec: RaySpec) -> Any:
    """`cls` as a Ray actor class of `role` (call `.remote(...)` on the result)."""
    return ray.remote(cls).options(**actor_options(role, res, spec))


def _check_feasible(role: Role, options: dict[str, Any]) -> None:
    """Fail fast with a clear message when no node could ever host the role (Ray would
    otherwise wait for such a node forever)."""
    wanted = {"CPU": options["num_cpus"], "GPU": options["num_gpus"], **options["resources"]}
    wanted = {k: v for k, v in wanted.items() if v > 0}
    for node in ray.nodes():
        if node.get("Alive") and all(
            node.get("Resources", {}).get(k, 0.0) >= v for k, v in wanted.items()
        ):
            return
    raise ConfigError(
        f"no node of the Ray cluster offers what a {role} actor asks for ({wanted}); start "
        "nodes with these resources (`ray start --resources ...`) or lower ray.<role> in the "
        "Ray spec"
    )


def node_id(handle: Any) -> str:
    """The node an actor runs on."""
    return str(ray.get(handle.info.remote()).node_id)
