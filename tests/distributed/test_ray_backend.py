"""The Ray backend on a local three-node cluster (one machine), inside a network
namespace that has only `lo` (started by `test_ray_netns.py`; skipped elsewhere).

One cluster and one Ray context serve the whole module, as a long-lived pipeline would:
each test runs its own jobs (distinct names) through an `Orchestrator` on it.

Layout: the head node hosts the trainer (`{"trainer": 1}`), a second node the two
rollout replicas (`{"engine": 2}`), a third the two environment workers (`{"env": 2}`).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
from ray_support import (
    NETNS_ENV,
    RAY_ENV,
    interfaces,
    is_loopback,
    isolated,
    listening_addresses,
    ray_pids,
)

if not (isolated() and os.environ.get(NETNS_ENV) == "1"):
    pytest.skip(
        "runs only inside the private network namespace that test_ray_netns.py starts",
        allow_module_level=True,
    )

import ray
from pipeline_support import MemoryRecorder, job, save_tiny_llama
from ray.cluster_utils import Cluster

from marlaas.config.job import EngineSpec, JobSpec, RunSpec
from marlaas.config.ray import ActorResources, RaySpec
from marlaas.distributed import build_ray_context
from marlaas.distributed.engine_client import RayEngineClient
from marlaas.distributed.envs import RayEnvPool
from marlaas.distributed.trainer_client import RayTrainerClient
from marlaas.errors import ConfigError
from marlaas.pipeline import Orchestrator, PipelineContext, PipelineOptions
from marlaas.pipeline.data import build_task
from marlaas.pipeline.tenant import TenantState

pytestmark = pytest.mark.ray
ON_MODULE_LOOP = pytest.mark.asyncio(loop_scope="module")

STORE = 100 * 2**20
SPEC = RaySpec(
    engine_replicas=2,
    env_workers=2,
    torch_threads=1,
    max_restarts=2,
    request_retries=3,
    engine=ActorResources(num_cpus=0, resources={"engine": 1}),
    trainer=ActorResources(num_cpus=0, resources={"trainer": 1}),
    env=ActorResources(num_cpus=0, resources={"env": 1}),
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    os.environ.update(RAY_ENV)
    node = {"node_ip_address": "127.0.0.1", "object_store_memory": STORE, "num_cpus": 1}
    c = Cluster(
        initialize_head=True,
        head_node_args={**node, "include_dashboard": False, "resources": {"trainer": 1}},
    )
    c.add_node(**node, resources={"engine": 2})
    c.add_node(**node, resources={"env": 2})
    c.wait_for_nodes()
    ray.init(
        address=c.address,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        runtime_env={"env_vars": dict(RAY_ENV)},
    )
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ctx(
    cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[PipelineContext]:
    base = save_tiny_llama(tmp_path_factory.mktemp("ray-tiny-llama"))
    run = RunSpec(
        base_model=str(base),
        backend="ray",
        jobs=(job("warmup", steps=1),),
        engine=EngineSpec(max_batch_size=16, max_rank=4),
    )
    out = tmp_path_factory.mktemp("ray-run")
    context = await asyncio.to_thread(
        build_ray_context, run, out, PipelineOptions(device="cpu"), ray_spec=SPEC, max_staleness=2
    )
    context.executor.start()
    try:
        yield context
    finally:
        await context.executor.stop()
        await asyncio.to_thread(context.engine.shutdown)


class Runner:
    """Runs jobs on the shared context, with a fresh recorder per run."""

    def __init__(self, ctx: PipelineContext) -> None:
        self.ctx = ctx

    async def run(
        self, jobs: Sequence[JobSpec], recorder: MemoryRecorder
    ) -> dict[str, TenantState]:
        ctx = self.ctx
        ctx.recorder = ctx.executor.recorder = ctx.envs.recorder = recorder
        self.trainer.recorder = recorder
        tasks = dict(ctx.tasks)
        for spec in jobs:
            tasks[spec.name] = ctx.envs.place(build_task(spec))
        ctx.tasks = tasks
        return await Orchestrator(ctx, jobs).run()

    @property
    def engine(self) -> RayEngineClient:
        engine = self.ctx.engine
        assert isinstance(engine, RayEngineClient)
        return engine

    @property
    def trainer(self) -> RayTrainerClient:
        trainer = self.ctx.trainer
        assert isinstance(trainer, RayTrainerClient)
        return trainer

    @property
    def envs(self) -> RayEnvPool:
        assert isinstance(self.ctx.envs, RayEnvPool)
        return self.ctx.envs


@pytest.fixture(scope="module")
def runner(ctx: PipelineContext) -> Runner:
    return Runner(ctx)


def small(name: str, family: str = "arithmetic", **kw: Any) -> JobSpec:
    kw.setdefault("steps", 3)
    kw.setdefault("eval_episodes", 2)
    return job(name, family, P=2, G=2, max_new_tokens=12, **kw)


def check_finished(states: dict[str, TenantState], recorder: MemoryRecorder) -> None:
    """Every job done, every step once and in order, every step trained on one full
    batch (P x G trajectories, none counted twice)."""
    for name, state in states.items():
        assert state.status == "done", (name, state.reason)
        steps = state.job.steps
        assert recorder.train_steps(name) == list(range(1, steps + 1))
        P, G = state.job.algorithm.prompts_per_step, state.job.algorithm.group_size
        assert [m["rows"] for m in recorder.train_metrics(name)] == [float(P * G)] * steps


# -- the network and the placement ---------------------------------------------------


def test_only_loopback_exists_and_every_ray_socket_is_on_it(ctx: PipelineContext) -> None:
    assert interfaces() == {"lo"}
    nodes = [n for n in ray.nodes() if n["Alive"]]
    assert len(nodes) == 3
    assert {n["NodeManagerAddress"] for n in nodes} == {"127.0.0.1"}
    bound = listening_addresses(ray_pids())
    assert bound, "the cluster's servers should be found listening"
    assert all(is_loopback(a) or a in ("0.0.0.0", "::") for a in bound), bound
    # A wildcard bind in a namespace whose only interface is `lo` reaches loopback only.


def test_roles_are_placed_on_the_nodes_that_offer_their_resources(runner: Runner) -> None:
    by_resource = {
        key: n["NodeID"]
        for n in ray.nodes()
        if n["Alive"]
        for key in ("engine", "trainer", "env")
        if key in n["Resources"]
    }
    assert len(set(by_resource.values())) == 3
    replicas = [ray.get(h.info.remote()).node_id for h in runner.engine.handles]
    workers = [ray.get(w.info.remote()).node_id for w in runner.envs.workers]
    assert replicas == [by_resource["engine"]] * 2
    assert workers == [by_resource["env"]] * 2
    assert runner.trainer.info.node_id == by_resource["trainer"]
    assert runner.ctx.model.device == torch.device("meta")  # no weights on the driver


def test_a_role_no_node_can_host_fails_fast_with_a_clear_error(
    ctx: PipelineContext, tmp_path: Path
) -> None:
    spec = SPEC.model_copy(update={"env": ActorResources(num_cpus=0, resources={"gpu-box": 1})})
    with pytest.raises(ConfigError, match="no node of the Ray cluster offers"):
        build_ray_context(ctx.run, tmp_path, PipelineOptions(device="cpu"), ray_spec=spec)


# -- runs ----------------------------------------------------------------------------


@ON_MODULE_LOOP
async def test_jobs_finish_and_every_replica_holds_the_published_versions(
    runner: Runner,
) -> None:
    recorder = MemoryRecorder()
    jobs = [small("plain-a", staleness=1), small("plain-b", "reverse", staleness=0)]
    states = await runner.run(jobs, recorder)
    check_finished(states, recorder)
    kept = runner.ctx.bank.versions_kept
    held = await asyncio.to_thread(runner.engine.held_versions)
    assert sorted(held) == [0, 1]
    for name, state in states.items():
        expected = list(range(max(0, state.version - kept + 1), state.version + 1))
        assert [held[i][name] for i in (0, 1)] == [expected, expected]
        assert runner.engine.latest_version(name) == state.version == state.job.steps
    # Requests went to both replicas.
    stats = await asyncio.to_thread(runner.engine.replica_stats)
    assert len(stats) == 2 and all(s.tokens > 0 for s in stats)


@ON_MODULE_LOOP
async def test_killed_env_worker_and_replica_restart_and_every_job_finishes(
    runner: Runner,
) -> None:
    recorder = MemoryRecorder()
    engine, envs = runner.engine, runner.envs
    before = (engine.stats.recoveries, engine.restarts, envs.workers_lost)
    killed: list[str] = []

    def kill(tenant: str, step: int) -> None:
        # Mid-run: the tenants still have groups in flight (staleness 1 lets them run
        # ahead of their train steps).
        if (tenant, step) == ("faulty-a", 1) and not killed:
            ray.kill(envs.workers[0], no_restart=False)
            ray.kill(engine.handles[0], no_restart=False)
            killed.append(tenant)

    recorder.on_metrics = kill
    jobs = [
        small("faulty-a", staleness=1, steps=4),
        small("faulty-b", "calculator", staleness=1, steps=4),
    ]
    states = await runner.run(jobs, recorder)
    assert killed
    check_finished(states, recorder)
    # The replica came back (a new incarnation) and got the kept versions again.
    await _until(lambda: engine.stats.recoveries > before[0])
    assert engine.restarts > before[1]
    held = await asyncio.to_thread(engine.held_versions)
    assert sorted(held) == [0, 1]
    for name, state in states.items():
        assert held[0][name] == held[1][name] and held[0][name][-1] == state.version
    # Nothing was delivered twice, and what was in flight was retried, not dropped.
    assert engine.stats.duplicates_dropped == 0
    retried = engine.stats.retries + sum(s.stats.episode_retries for s in states.values())
    assert retried > 0 or envs.workers_lost > before[2]


@ON_MODULE_LOOP
async def test_killed_trainer_is_restored_from_checkpoints_with_the_same_adapter(
    runner: Runner,
) -> None:
    recorder = MemoryRecorder()
    trainer = runner.trainer
    restores = trainer.restores
    seen: dict[str, Any] = {}

    def kill(tenant: str, step: int) -> None:
        if (tenant, step) != ("ckpt-a", 2) or seen:
            return
        # Hold the client's lock so no train step lands between the three calls.
        with trainer._lock:
            seen["version"] = trainer.version(tenant)
            seen["before"] = trainer.adapter(tenant)
            ray.kill(trainer.actor, no_restart=True)
            seen["after"] = trainer.adapter(tenant)  # dies, restores, answers
            seen["version_after"] = trainer.version(tenant)

    recorder.on_metrics = kill
    jobs = [
        small("ckpt-a", steps=4, checkpoint_every=1),
        small("ckpt-b", "reverse", steps=4, checkpoint_every=2, staleness=0),
    ]
    states = await runner.run(jobs, recorder)
    check_finished(states, recorder)
    assert trainer.restores == restores + 1
    assert seen["version_after"] == seen["version"] >= 2
    for path, (A, B) in seen["before"].items():
        A2, B2 = seen["after"][path]
        torch.testing.assert_close(A2, A)
        torch.testing.assert_close(B2, B)
    events = {t: f for n, t, f in recorder.events if n == "trainer_restored"}
    # Every tenant registered at the time was restored (ckpt-b may have finished).
    assert "ckpt-a" in events and set(events) <= {"ckpt-a", "ckpt-b"}
    # ckpt-a resumed from a checkpoint written in this run (not from scratch).
    assert 1 <= int(str(events["ckpt-a"]["from_version"])) <= seen["version"]
    assert events["ckpt-a"]["version"] == seen["version"]


async def _until(predicate: Any, timeout_s: float = 120.0) -> None:
    """Wait until `predicate()` (a background recovery) holds; fail after the timeout."""
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.2)
