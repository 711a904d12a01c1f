"""Training calls of the Tinker-compatible API, over the device port.

Every call answers a future at once (`wire.UntypedFuture`) and runs in the background:
- `create_model` and a `load_weights` that creates its model (`session_id` +
  `model_seq_id`) add a trainable tenant to the device (fresh from the seed, or from a
  saved state) and record the run;
- the calls of a model (`forward_backward`, `optim_step`, `save_weights`,
  `save_weights_for_sampler`, `load_weights` by `model_id`) run in its `seq_id` order
  (`sequence`): each queues its device call in its turn and the result arrives later,
  so a client's `forward_backward` and the `optim_step` after it are queued back to
  back, and calls of different tenants pending together share one multi-lane pass.

Chunks of one large batch are separate `forward_backward` calls of one tenant; their
gradients add up on the device until the `optim_step` (the losses are sums).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from marlaas.config.specs import LoRASpec
from marlaas.service.tinker import convert, state_io, wire
from marlaas.service.tinker.errors import UserError, category_of
from marlaas.service.tinker.futures import JsonReply, Reply
from marlaas.service.tinker.hub import LiveRun, TinkerHub
from marlaas.service.tinker.paths import TinkerPath, check_name, model_id
from marlaas.service.tinker.sampling import ephemeral_sampler
from marlaas.service.tinker.sequence import ModelSequence
from marlaas.service.tinker.sessions import Session
from marlaas.train.optim import TenantSnapshot
from marlaas.train.records import TrainInput, TrainOutput

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ForwardBackwardReply:
    """A `ForwardBackwardOutput`: each datum's target log-probs, and the loss's sums as
    `<name>:sum` metrics (the SDK combines chunks by the suffix)."""

    logprobs: Sequence[Sequence[float]]
    metrics: dict[str, float]

    @classmethod
    def of(cls, out: TrainOutput, lengths: Sequence[int]) -> ForwardBackwardReply:
        rows = out.logprobs or tuple(() for _ in lengths)
        return cls(
            logprobs=[tuple(r[:n]) for r, n in zip(rows, lengths, strict=True)],
            metrics={f"{name}:sum": float(v) for name, v in out.sums.items()},
        )

    def json(self) -> dict[str, Any]:
        outputs = [
            {"logprobs": {"data": list(r), "dtype": "float32", "shape": [len(r)]}}
            for r in self.logprobs
        ]
        return {
            "loss_fn_output_type": "ArrayRecord",
            "loss_fn_outputs": outputs,
            "metrics": self.metrics,
        }

    def protobuf(self) -> bytes:
        from marlaas.service.tinker.protobuf import encode_forward_backward

        return encode_forward_backward(self.logprobs, self.metrics)


def _deliver(hub: TinkerHub, request_id: str, work: Awaitable[Reply]) -> None:
    """Resolve the future with `work`'s reply, or fail it with its error."""

    async def run() -> None:
        try:
            hub.futures.resolve(request_id, await work)
        except Exception as e:
            hub.futures.fail(request_id, str(e) or type(e).__name__, category_of(e))
            if category_of(e) == "server":
                log.exception("tinker request %s failed", request_id)

    hub.spawn(run(), f"tinker-{request_id}")


async def _ordered(
    hub: TinkerHub,
    owner: str,
    model: str,
    seq_id: int | None,
    start: Callable[[LiveRun, str], Awaitable[None]],
) -> wire.UntypedFuture:
    """Queue a call of a model in its `seq_id` turn (a resend gets its first answer)."""
    run = await hub.live_run(owner, model)
    if seq_id is None:
        raise UserError("this call needs a seq_id (the SDK numbers a model's requests)")
    known = run.sequence.known(seq_id)
    if known is not None:
        return wire.UntypedFuture(request_id=known, model_id=run.id)
    request_id = hub.futures.create(owner)

    async def turn() -> None:
        try:
            await start(run, request_id)
        except Exception as e:
            hub.futures.fail(request_id, str(e) or type(e).__name__, category_of(e))

    run.sequence.put(seq_id, request_id, turn)
    return wire.UntypedFuture(request_id=request_id, model_id=run.id)


# -- creating models ------------------------------------------------------------------


async def create_model(
    hub: TinkerHub, owner: str, body: wire.CreateModelRequest
) -> wire.UntypedFuture:
    session = hub.sessions.get(owner, body.session_id)
    run_id = model_id(session.id, body.model_seq_id)
    known = session.models.get(body.model_seq_id)
    if known is not None:
        return wire.UntypedFuture(request_id=known, model_id=run_id)
    if body.optimizer_config.type != "adamw":
        raise UserError(f"optimizer {body.optimizer_config.type!r} is not supported; use adamw")
    base = await hub.base_model(body.base_model)
    device = (await hub.device()).port
    lora = convert.lora_spec(body.lora_config, device.model.target_roles)
    try:
        device.model.validate_spec(lora)
    except Exception as e:
        raise UserError(f"lora_config: {e}") from e
    seed = body.lora_config.seed if body.lora_config and body.lora_config.seed is not None else None
    request_id = hub.futures.create(owner)
    session.models[body.model_seq_id] = request_id

    async def work() -> Reply:
        await _add_run(hub, session, run_id, base, lora, body.user_metadata, seed=seed)
        return JsonReply({"model_id": run_id, "type": "create_model"})

    _deliver(hub, request_id, work())
    return wire.UntypedFuture(request_id=request_id, model_id=run_id)


async def _add_run(
    hub: TinkerHub,
    session: Session,
    run_id: str,
    base: str,
    lora: LoRASpec,
    user_metadata: dict[str, Any] | None,
    *,
    seed: int | None = None,
    snapshot: TenantSnapshot | None = None,
) -> LiveRun:
    """Record a run and add its tenant to the device (its row is closed if that fails,
    and it is dropped again if its session finished meanwhile)."""
    await asyncio.to_thread(
        hub.store.create_run, session.owner, run_id, session.id, base, lora, user_metadata
    )
    run = LiveRun(run_id, session.owner, session.id, base, lora, ModelSequence(run_id, next_seq=1))
    try:
        device = (await hub.device()).port
        if snapshot is not None:
            snapshot = replace(snapshot, tenant=run.device_name)
        await device.add_tenant(
            run.device_name,
            lora,
            seed=secrets.randbelow(2**31) if seed is None else seed,
            snapshot=snapshot,
        )
    except BaseException:
        await asyncio.to_thread(hub.store.close_run, run_id)
        raise
    hub.runs[run_id] = run
    session.runs.add(run_id)
    if session.finished is not None:
        await hub.drop_run(run_id, f"its session finished ({session.finished})")
        raise UserError(f"session {session.id!r} finished while its model was being created")
    return run


async def get_info(hub: TinkerHub, owner: str, model: str) -> wire.GetInfoResponse:
    run = hub.runs.get(model)
    if run is None or run.owner != owner:
        record = await asyncio.to_thread(hub.store.run, owner, model)
        base, rank = record.base_model, record.lora.rank
    else:
        base, rank = run.base_model, run.lora.rank
    config = (await hub.device()).port.model.base.config
    arch = (getattr(config, "architectures", None) or [None])[0]
    return wire.GetInfoResponse(
        model_data=wire.ModelData(arch=arch, model_name=base, tokenizer_id=base),
        model_id=model,
        lora_rank=rank,
        model_name=base,
    )


# -- the calls of a model, in order ---------------------------------------------------


async def forward_backward(
    hub: TinkerHub, owner: str, body: wire.ForwardBackwardBody
) -> wire.UntypedFuture:
    limits = await hub.limits()
    try:  # a refusal fails the call in its turn: the later calls still run in order
        loss = convert.objective(body.loss_fn, body.loss_fn_config)
        # Off the event loop: a large batch is many thousands of values to check.
        data = await asyncio.to_thread(convert.datums, body, loss, limits)
        problem: UserError | None = None
    except UserError as e:
        problem = e

    async def start(run: LiveRun, request_id: str) -> None:
        if problem is not None:
            raise problem
        device = (await hub.device()).port
        inputs = [TrainInput(run.device_name, data, loss, return_logprobs=True)]
        call = device.forward(inputs) if body.forward_only else device.forward_backward(inputs)
        if not body.forward_only:
            hub.counters.forward_backward_calls += 1
        hub.counters.count(owner, "forward" if body.forward_only else "forward_backward")
        hub.counters.add(hub.counters.train_tokens, owner, sum(len(d.input_ids) for d in data))

        async def reply() -> Reply:
            out = (await call)[run.device_name]
            return ForwardBackwardReply.of(out, [len(d.input_ids) for d in data])

        _deliver(hub, request_id, reply())

    return await _ordered(hub, owner, body.model_id, body.seq_id, start)


async def optim_step(hub: TinkerHub, owner: str, body: wire.OptimStepRequest) -> wire.UntypedFuture:
    params = convert.adam(body.adam_params, body.optimizer_params)

    async def start(run: LiveRun, request_id: str) -> None:
        await asyncio.to_thread(hub.store.reserve_step, owner, run.id)  # quota, counted
        call = (await hub.device()).port.optim_step(run.device_name, params)
        hub.counters.count(owner, "optim_step")

        async def reply() -> Reply:
            try:
                result = await call
            except BaseException:
                await asyncio.to_thread(hub.store.release_step, run.id)
                raise
            metrics = {
                "grad_norm": result.grad_norm,
                "learning_rate": result.lr,
                "adapter_version": float(result.version),
            }
            return JsonReply({"metrics": metrics})

        _deliver(hub, request_id, reply())

    return await _ordered(hub, owner, body.model_id, body.seq_id, start)


async def save_weights(
    hub: TinkerHub, owner: str, body: wire.SaveWeightsRequest
) -> wire.UntypedFuture:
    if body.path is None:
        raise UserError("save_state needs a name for the saved state")
    name = check_name(body.path)

    async def start(run: LiveRun, request_id: str) -> None:
        path = TinkerPath(run.id, "training", name)
        await asyncio.to_thread(hub.store.check_free, owner, path, body.overwrite)
        call = (await hub.device()).port.snapshot(run.device_name)
        hub.counters.count(owner, "save_weights")

        async def reply() -> Reply:
            snapshot = await call
            directory = hub.store.directory(owner, path)
            size = await asyncio.to_thread(
                state_io.write_state, directory, snapshot, run.base_model
            )
            await asyncio.to_thread(
                hub.store.add_checkpoint,
                owner,
                path,
                size,
                snapshot.version,
                body.user_metadata,
                body.ttl_seconds,
            )
            return JsonReply({"path": str(path), "type": "save_weights"})

        _deliver(hub, request_id, reply())

    return await _ordered(hub, owner, body.model_id, body.seq_id, start)


async def save_weights_for_sampler(
    hub: TinkerHub, owner: str, body: wire.SaveWeightsForSamplerRequest
) -> wire.UntypedFuture:
    if body.kind != "snapshot":
        raise UserError(f"sampling client kind {body.kind!r} is not supported; use 'snapshot'")
    name = None if body.path is None else check_name(body.path)
    if name is None and body.sampling_session_seq_id is None:
        raise UserError("save_weights_for_sampler needs a name or a sampling_session_seq_id")

    async def start(run: LiveRun, request_id: str) -> None:
        path = None if name is None else TinkerPath(run.id, "sampler", name)
        if path is not None:
            await asyncio.to_thread(hub.store.check_free, owner, path, True)
        # A snapshot, not an export: it says which version its weights are.
        call = (await hub.device()).port.snapshot(run.device_name)
        hub.counters.count(owner, "save_weights_for_sampler")

        async def reply() -> Reply:
            snapshot = await call
            tensors, version = snapshot.tensors, snapshot.version
            if path is None:
                assert body.sampling_session_seq_id is not None
                sampler = await ephemeral_sampler(
                    hub, owner, run.session_id, body.sampling_session_seq_id, run, tensors
                )
                return JsonReply(
                    {"sampling_session_id": sampler.id, "type": "save_weights_for_sampler"}
                )
            directory = hub.store.directory(owner, path)
            size = await asyncio.to_thread(
                state_io.write_sampler_weights, directory, run.lora, tensors, run.base_model
            )
            await asyncio.to_thread(
                hub.store.add_checkpoint,
                owner,
                path,
                size,
                version,
                body.user_metadata,
                body.ttl_seconds,
            )
            return JsonReply({"path": str(path), "type": "save_weights_for_sampler"})

        _deliver(hub, request_id, reply())

    return await _ordered(hub, owner, body.model_id, body.seq_id, start)


async def _read_snapshot(
    hub: TinkerHub, owner: str, where: str, tenant: str, optimizer: bool
) -> TenantSnapshot:
    """The state at `where` (a saved state, or sampler weights: adapter only) for
    `tenant` of this server's base."""
    path = TinkerPath.parse(where)
    record = await asyncio.to_thread(hub.store.checkpoint, owner, path)
    model = (await hub.device()).port.model
    if path.kind == "training":
        return await asyncio.to_thread(
            state_io.read_state, record.directory, model, tenant, optimizer=optimizer
        )
    if optimizer:
        raise UserError(
            f"{where} holds sampler weights, no optimizer state; load it without the "
            "optimizer (create_training_client_from_state) or use a path from save_state"
        )
    lora, tensors = await asyncio.to_thread(state_io.read_adapter, record.directory, model)
    return TenantSnapshot(tenant=tenant, lora=lora, version=record.version, tensors=tensors)


async def load_weights(
    hub: TinkerHub, owner: str, body: wire.LoadWeightsRequest
) -> wire.UntypedFuture:
    if body.session_id is None:  # the legacy form: a load into an existing model
        if body.model_id is None:
            raise UserError("load_weights needs a model_id, or a session_id and model_seq_id")

        async def start(run: LiveRun, request_id: str) -> None:
            snapshot = await _read_snapshot(hub, owner, body.path, run.device_name, body.optimizer)
            call = (await hub.device()).port.restore(snapshot)

            async def reply() -> Reply:
                await call
                return JsonReply({"path": body.path, "model_id": run.id, "type": "load_weights"})

            _deliver(hub, request_id, reply())

        return await _ordered(hub, owner, body.model_id, body.seq_id, start)
    if body.model_seq_id is None:
        raise UserError("load_weights with a session_id needs the model_seq_id")
    session = hub.sessions.get(owner, body.session_id)
    run_id = model_id(session.id, body.model_seq_id)
    known = session.models.get(body.model_seq_id)
    if known is not None:
        return wire.UntypedFuture(request_id=known, model_id=run_id)
    base = await hub.base_model(body.base_model)
    # At once, not in the future: a foreign or missing path is this call's 404.
    await asyncio.to_thread(hub.store.checkpoint, owner, TinkerPath.parse(body.path))
    request_id = hub.futures.create(owner)
    session.models[body.model_seq_id] = request_id

    async def work() -> Reply:
        snapshot = await _read_snapshot(hub, owner, body.path, run_id, body.optimizer)
        await _add_run(
            hub, session, run_id, base, snapshot.lora, body.user_metadata, snapshot=snapshot
        )
        return JsonReply({"path": body.path, "model_id": run_id, "type": "load_weights"})

    _deliver(hub, request_id, work())
    return wire.UntypedFuture(request_id=request_id, model_id=run_id)
