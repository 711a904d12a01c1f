"""The Ray backend on a local three-node cluster (one machine), inside a network
namespace that has only `lo` (started by `test_ray_netns.py`; skipped elsewhere).

One cluster and one Ray context serve the whole module, as a long-lived pipeline would:
each test runs its own jobs (distinct names) through an `Orchestrator` on it. The last
tests build contexts of their own on the same cluster: the service (`PipelineBackend`
with `backend: ray`, as `marlaas serve --backend ray` builds it) and `marlaas bench
paper --backend ray`; their actors ask for no resources, so they fit beside the
module's context, whose actors hold the nodes' custom resources.

Layout: the head node hosts the trainer (`{"trainer": 1}`), a second node the two
rollout replicas (`{"engine": 2}`), a third the two environment workers (`{"env": 2}`).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
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
import yaml
from fastapi.testclient import TestClient
from ray.cluster_utils import Cluster
from typer.testing import CliRunner

from helpers.pipeline_support import MemoryRecorder, job, save_tiny_llama
from helpers.service_support import ADMIN, ADMIN_KEY, Tenants
from marlaas.cli.main import app as cli
from marlaas.config.job import EngineSpec, JobSpec, PipelineSpec, RunSpec
from marlaas.config.ray import ActorResources, RaySpec
from marlaas.device import BASE
from marlaas.device.device import ExecutorDevice
from marlaas.distributed import RayCompute, open_ray_backend
from marlaas.distributed.engine_client import RayEngineClient
from marlaas.distributed.envs import RayEnvPool
from marlaas.distributed.ray_backend import build_ray_backend
from marlaas.distributed.trainer_client import RayTrainerClient
from marlaas.errors import ConfigError
from marlaas.obs.recorder import NullRecorder
from marlaas.pipeline import Orchestrator, PipelineContext, PipelineOptions
from marlaas.pipeline.data import build_task
from marlaas.pipeline.runtime import PipelineRuntime
from marlaas.pipeline.tenant import TenantState
from marlaas.service.app import create_app, open_context
from marlaas.service.pipeline_backend import PipelineBackend
from marlaas.service.settings import ServiceSettings

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


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("ray-tiny-llama"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ctx(
    cluster: Cluster, tiny_base: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[PipelineContext]:
    run = RunSpec(
        base_model=str(tiny_base),
        backend="ray",
        ray=SPEC,
        jobs=(job("warmup", steps=1),),
        engine=EngineSpec(max_batch_size=16, max_rank=4),
        max_staleness=2,
    )
    out = tmp_path_factory.mktemp("ray-run")
    context = await PipelineContext.open(
        run,
        out,
        backend=open_ray_backend,
        recorder=NullRecorder(),
        options=PipelineOptions(device="cpu"),
    )
    try:
        yield context
    finally:
        await context.backend.close()


class Runner:
    """Runs jobs on the shared context, with a fresh recorder per run."""

    def __init__(self, ctx: PipelineContext) -> None:
        self.ctx = ctx

    async def run(
        self, jobs: Sequence[JobSpec], recorder: MemoryRecorder
    ) -> dict[str, TenantState]:
        ctx = self.ctx
        ctx.recorder = self.device.recorder = ctx.envs.recorder = recorder
        self.trainer.recorder = recorder
        tasks = dict(ctx.tasks)
        for spec in jobs:
            tasks[spec.name] = ctx.envs.place(build_task(spec))
        ctx.tasks = tasks
        return await Orchestrator(ctx, jobs).run()

    @property
    def device(self) -> ExecutorDevice:
        device = self.ctx.device
        assert isinstance(device, ExecutorDevice)
        return device

    @property
    def compute(self) -> RayCompute:
        compute = self.device.compute
        assert isinstance(compute, RayCompute)
        return compute

    @property
    def engine(self) -> RayEngineClient:
        return self.compute.engine

    @property
    def trainer(self) -> RayTrainerClient:
        return self.compute.trainer

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
    assert runner.ctx.device.model.device == torch.device("meta")  # no weights on the driver


def test_a_role_no_node_can_host_fails_fast_with_a_clear_error(
    ctx: PipelineContext, tmp_path: Path
) -> None:
    spec = SPEC.model_copy(update={"env": ActorResources(num_cpus=0, resources={"gpu-box": 1})})
    run = ctx.run.model_copy(update={"ray": spec})
    with pytest.raises(ConfigError, match="no node of the Ray cluster offers"):
        build_ray_backend(run, options=PipelineOptions(device="cpu"), recorder=NullRecorder())


# -- runs ----------------------------------------------------------------------------


@ON_MODULE_LOOP
async def test_jobs_finish_and_every_replica_holds_the_published_versions(
    runner: Runner,
) -> None:
    recorder = MemoryRecorder()
    jobs = [small("plain-a", staleness=1), small("plain-b", "reverse", staleness=0)]
    states = await runner.run(jobs, recorder)
    check_finished(states, recorder)
    kept = runner.ctx.device.versions_kept
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


# -- the service and the bench on Ray ------------------------------------------------

#: One replica, one environment worker, actors that ask for no resources.
SMALL = RaySpec(
    engine_replicas=1,
    env_workers=1,
    torch_threads=1,
    engine=ActorResources(num_cpus=0),
    trainer=ActorResources(num_cpus=0),
    env=ActorResources(num_cpus=0),
)


def _wait_done(client: TestClient, headers: dict[str, str], job_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        found: dict[str, Any] = client.get(f"/v1/jobs/{job_id}", headers=headers).json()
        assert found["status"] != "failed", found
        if found["status"] == "done":
            return found
        time.sleep(0.2)
    pytest.fail(f"job {job_id} did not finish: {found}")


def test_the_service_runs_a_job_on_ray_and_serves_its_models(
    cluster: Cluster, tiny_base: Path, tmp_path: Path
) -> None:
    """`marlaas serve --backend ray` in-process: a job submitted over HTTP trains on the
    Ray actors to done; the OpenAI endpoint serves its live adapter, its checkpoints
    (PEFT files registered on the replicas as serving adapters, the least recently used
    one removed from them again) and the base."""
    settings = ServiceSettings(
        data_dir=tmp_path / "data", admin_key=ADMIN_KEY, max_serving_adapters=1
    )
    spec = PipelineSpec(
        base_model=str(tiny_base),
        backend="ray",
        ray=SMALL,
        max_staleness=1,
        engine=EngineSpec(max_batch_size=16, max_rank=4),
    )
    service, _ = open_context(settings)
    factory = PipelineBackend.factory(service.db, spec=spec, options=PipelineOptions(device="cpu"))
    with TestClient(create_app(service, factory)) as client:
        acme = Tenants(client).create("acme")
        body = {
            "name": "rev",
            "task": {"family": "reverse"},
            "steps": 2,
            "checkpoint_every": 1,
            "eval_episodes": 2,
            "lora": {"rank": 4},
            "algorithm": {"group_size": 2, "prompts_per_step": 2, "max_staleness": 1},
            "sampling": {"max_new_tokens": 8},
        }
        r = client.post("/v1/jobs", json=body, headers=acme)
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        assert _wait_done(client, acme, job_id)["steps_done"] == 2
        backend = client.app.state.context.backend  # type: ignore[attr-defined]
        assert isinstance(backend, PipelineBackend)
        runtime: PipelineRuntime = client.portal.call(backend.ready)  # type: ignore[union-attr]
        device = runtime.ctx.device
        assert isinstance(device, ExecutorDevice) and isinstance(device.compute, RayCompute)
        engine = bank = device.compute.engine
        assert job_id in bank and engine.latest_version(job_id) == 2

        def complete(model: str) -> str:
            r = client.post(
                "/v1/completions",
                json={
                    "model": model,
                    "prompt": "Reverse: abc\n",
                    "max_tokens": 6,
                    "temperature": 0,
                },
                headers=acme,
            )
            assert r.status_code == 200, r.text
            return str(r.json()["choices"][0]["text"])

        live = complete(job_id)  # the job's adapter in the replicas' banks
        assert complete(f"{job_id}:ckpt-2") == live  # its last checkpoint, from disk
        complete(f"{job_id}:ckpt-1")  # capacity 1: ckpt-2's serving adapter is removed
        complete("base")
        (replica,) = engine.handles
        assert ray.get(replica.held.remote(f"serve:{job_id}:1")) == [0]
        assert ray.get(replica.held.remote(f"serve:{job_id}:2")) == []
        assert f"serve:{job_id}:2" not in bank and BASE in bank
        models = client.get("/v1/models", headers=acme).json()["data"]
        assert {job_id, f"{job_id}:ckpt-1", f"{job_id}:ckpt-2"} <= {m["id"] for m in models}
        assert client.get("/metrics", headers=ADMIN).status_code == 200


TINY_WORKLOAD = {
    "workload": "tiny",
    "version": 1,
    "regime": "compute",
    "samples_per_step": 4,
    "steps": 2,
    "quick_steps": 1,
    "seed": 7,
    "run": {"engine": {"max_batch_size": 32, "adapter_slots": 8, "max_rank": 4}},
    "defaults": {
        "lora": {"rank": 4, "alpha": 8},
        # Strictly on-policy: what each step trains on does not depend on timing.
        "algorithm": {
            "group_size": 2,
            "prompts_per_step": 2,
            "learning_rate": 5.0e-3,
            "max_staleness": 0,
        },
        "sampling": {"temperature": 1.0, "max_new_tokens": 8},
        "eval_episodes": 8,
    },
    "tenants": [
        {"name": "arith", "task": {"family": "arithmetic"}},
        {"name": "reverse", "task": {"family": "reverse"}},
    ],
}


def test_bench_paper_on_ray_matches_the_in_process_backend(
    cluster: Cluster, tmp_path: Path
) -> None:
    """`marlaas bench paper --backend ray` on a tiny workload (2 tenants x 2 steps, the
    embedded base): the same per-tenant eval accuracies as in-process, for marlaas and
    the sync baseline alike, and the JSON names the backend and its Ray spec."""
    workload = tmp_path / "tiny-v1.yaml"
    workload.write_text(yaml.safe_dump(TINY_WORKLOAD), encoding="utf-8")
    ray_file = tmp_path / "ray.yaml"
    ray_file.write_text(yaml.safe_dump(SMALL.model_dump(mode="json")), encoding="utf-8")
    results: dict[str, dict[str, Any]] = {}
    for backend in ("inprocess", "ray"):
        out = tmp_path / f"{backend}.json"
        args = [
            "bench", "paper", "--json", str(out), "--no-trl", "--regime", "compute",
            "--compute-workload", str(workload), "--tenants", "2",
            "--out", str(tmp_path / backend), "--backend", backend,
        ]  # fmt: skip
        if backend == "ray":
            args += ["--ray-spec", str(ray_file)]
        t0 = time.perf_counter()
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
        results[backend] = json.loads(out.read_text())
        results[backend]["command_s"] = time.perf_counter() - t0
    local, remote = results["inprocess"], results["ray"]
    assert local["config"]["backend"] == "inprocess" and local["config"]["ray"] is None
    assert remote["config"]["backend"] == "ray"
    assert remote["config"]["ray"]["engine_replicas"] == 1
    for system in ("async", "sync"):
        runs = {}
        for backend in ("inprocess", "ray"):
            run_dir = tmp_path / backend / "compute" / "n002" / system
            assert json.loads((run_dir / "run.json").read_text())["backend"] == backend
            tenants = json.loads((run_dir / "result.json").read_text())["tenants"]
            runs[backend] = {name: t["eval_accuracy"] for name, t in tenants.items()}
            assert all(t["status"] == "done" for t in tenants.values()), tenants
        assert runs["ray"] == runs["inprocess"], system
        assert len(runs["ray"]) == 2
    (local_row,) = local["regimes"][0]["rows"]
    (remote_row,) = remote["regimes"][0]["rows"]
    assert remote_row["eval"]["tenants"] == local_row["eval"]["tenants"]
    for row in (local_row, remote_row):  # the replicas' prompt counts reach the report
        device = row["marlaas_async"]["device"]
        assert device["prefill_tokens"] > 0 and device["shared_prefill_tokens"] > 0
    print(  # the Ray backend's overhead on this workload (shown with -s)
        "bench paper tiny, wall s (inprocess -> ray): "
        + ", ".join(
            f"{k} {local_row[k]['wall_s']:.2f} -> {remote_row[k]['wall_s']:.2f}"
            for k in ("marlaas_async", "sync")
        )
        + f"; whole command {local['command_s']:.1f} -> {remote['command_s']:.1f}"
    )


def test_the_tinker_sdk_trains_and_samples_on_the_ray_device(
    cluster: Cluster, tiny_base: Path, tmp_path: Path
) -> None:
    """The Tinker-compatible API on `marlaas serve --backend ray`: the hub uses the
    pipeline's Ray device, so the unmodified SDK's training client is a tenant of the
    trainer actor and its samples come from the replicas."""
    import httpx
    import tinker
    from tinker import types

    from helpers.live_support import LiveServer

    settings = ServiceSettings(data_dir=tmp_path / "data", admin_key=ADMIN_KEY)
    spec = PipelineSpec(
        base_model=str(tiny_base),
        backend="ray",
        ray=SMALL,
        max_staleness=1,
        engine=EngineSpec(max_batch_size=16, max_rank=4),
    )
    service, _ = open_context(settings)
    factory = PipelineBackend.factory(service.db, spec=spec, options=PipelineOptions(device="cpu"))
    app = create_app(service, factory)
    with LiveServer(app) as server:
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        httpx.post(f"{server.url}/v1/admin/tenants", json={"name": "t"}, headers=admin)
        key = httpx.post(
            f"{server.url}/v1/admin/tenants/t/keys", json={"format": "tml"}, headers=admin
        ).json()["key"]
        rest = tinker.RestClient(base_url=server.url, api_key=key)
        base = rest.get_server_capabilities().result().supported_models[0].model_name
        assert base == str(tiny_base.resolve())
        sdk = tinker.ServiceClient(base_url=server.url, api_key=key)
        client = sdk.create_lora_training_client(base_model=base, rank=4).result()
        ids = [5, 6, 7, 8, 9, 10]
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(ids[:-1]),
            loss_fn_inputs={"target_tokens": ids[1:]},
        )
        fb = client.forward_backward([datum], "cross_entropy")
        step = client.optim_step(types.AdamParams(learning_rate=1e-2))
        assert fb.result().metrics["tokens:sum"] == 5.0
        assert step.result().metrics["adapter_version"] == 1.0
        sampler = client.save_weights_and_get_sampling_client().result()
        out = sampler.sample(types.ModelInput.from_ints(ids), 2, types.SamplingParams(max_tokens=4))
        assert [len(s.tokens) for s in out.result().sequences] == [4, 4]
        provider = app.state.context.backend.inference_provider()
        assert isinstance(provider.device.compute, RayCompute)  # the pipeline's Ray device
        sdk.close("success").result()
