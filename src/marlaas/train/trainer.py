"""The multi-lane trainer: one forward/backward over the shared base computes the losses
and gradients of every tenant in it, each tenant with its own data and objective; each
tenant's gradients accumulate until its optimizer step.

`forward_backward(inputs)` packs the rows of all the given tenants' data into
micro-batches of at most `max_tokens_per_microbatch` padded tokens (rows of different
tenants mixed), runs each micro-batch once with one LoRA lane per tenant present (lane
tensors stacked from the tenants' flat leaf parameters, `marlaas.train.lanes`), and
backpropagates the sum of the tenants' losses, so each tenant's flat gradient
accumulates its own rows' gradient only. `forward(inputs)` is
the same pass under `no_grad`. `optim_step(steps)` then clips each named tenant's
accumulated gradient by its own norm and takes one AdamW step per tenant (batched over
tenants, `train.optim`), clears the gradient and bumps the version.

Per tenant, per micro-batch, on that tenant's contiguous slice of rows, the tenant's
objective (`train.objectives`) maps `LossInputs` to its loss and sums; where every
tenant's objective allows it (`objectives.lane_rows`: policy gradients without a KL
term), one set of ops runs all the rows, each under its tenant's settings, and each
tenant's sums are its rows' (the same values up to rounding). Log-probs are
`log_softmax(logits / temperature)` at the input's temperature; an objective with
`needs_base_logprobs` also gets the plain base's log-probs of its rows (the rows run
again with no lane batch, under `no_grad`). Rows that start with the same unweighted
prefix (a GRPO group's prompt) are planned into one micro-batch, where the prefix runs
once and its rows share its cache (`marlaas.train.prefix`), when that saves tokens.

Invariants:
- Training tenants together gives the adapters each would get alone (same data, same
  seeds), up to floating-point noise: losses are per-tenant weighted sums, lanes are
  independent, optimizer updates are element-wise per tenant. Likewise one call or the
  same data split over several calls before one `optim_step`.
- A tenant's version goes up by exactly one per optimizer step.
- `forward_backward` and `forward` validate every input before touching any state; a
  bad input raises `TrainBatchError` naming its tenant and changes nothing (drop it and
  retry the rest). A failure after validation (the device itself) leaves gradients
  half-accumulated: it is fatal for the device's owner.
- Memory is bounded by the token budget: a micro-batch never exceeds it and holds lanes
  only for the tenants among its rows (`stats.max_microbatch_tokens` records it).
- The base is never written. No module-level state: everything lives in the trainer.

Not thread-safe: one call at a time per trainer (the rollout engine may run forwards
in other threads; `LoRAModel.lanes` serialises the lane batches).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from marlaas.config.specs import LoRASpec
from marlaas.errors import ConfigError, ModelError, TenantNotFound
from marlaas.model.attention import install_attention
from marlaas.model.kernels import torch_path_on
from marlaas.model.lane_layers import LaneBatch
from marlaas.model.lora import AdapterTensors, LoRAModel
from marlaas.packing import MIN_FILL
from marlaas.train.batch import TrainBatchError
from marlaas.train.decoder import TokenLogits, TrainDecoder
from marlaas.train.lanes import MicroLanes
from marlaas.train.losses import token_logprobs
from marlaas.train.objectives import LossInputs, lane_rows
from marlaas.train.optim import (
    AdamParams,
    AdamState,
    AdapterLayout,
    TenantSnapshot,
    clipped_adamw_step_,
)
from marlaas.train.prefix import SharedPrefix
from marlaas.train.records import OptimResult, TrainInput, TrainOutput, tenants_of
from marlaas.train.rows import MicroBatch, Rows, check_rows, concat_rows, plan_microbatches


@dataclass
class TrainerStats:
    """Counters over the trainer's life (the memory bound is checked against these)."""

    passes: int = 0
    optim_steps: int = 0
    microbatches: int = 0
    rows: int = 0
    max_microbatch_tokens: int = 0
    max_microbatch_lanes: int = 0
    #: Micro-batches whose rows shared their prompts' forwards (`marlaas.train.prefix`).
    shared_prefix_microbatches: int = 0


@dataclass(eq=False)
class _Tenant:
    name: str
    lora: LoRASpec
    layout: AdapterLayout
    flat_P: Tensor  # the leaf parameter: every module's A and B, flattened
    adam: AdamState
    version: int


#: The least fill of a micro-batch's rows (`plan_microbatches`) under the compact
#: forward, which packs the valid tokens (`marlaas.train.decoder.Packed`): padding then
#: costs only the attention layout's copies, so far fewer micro-batches pay off. Measured
#: (`marlaas bench trainer`'s 32 tenants of mixed lengths, one thread): 0.75 (three
#: micro-batches) 145 ms a round, 0.5 (two) 137, 0 (one) 133.
PACKED_MIN_FILL = 0.25


def vocab_size(model: LoRAModel) -> int:
    """Rows of the input embedding: token ids must lie in `[0, vocab_size)`."""
    embedding = model.base.get_input_embeddings()
    if isinstance(embedding, nn.Embedding):
        return int(embedding.num_embeddings)
    return int(model.base.config.vocab_size)


class MultiLaneTrainer:
    """Trains many tenants' LoRA adapters on one shared `LoRAModel`."""

    def __init__(self, model: LoRAModel, max_tokens_per_microbatch: int = 8192) -> None:
        if max_tokens_per_microbatch < 1:
            raise ConfigError("max_tokens_per_microbatch must be >= 1")
        self.model = model
        # The engine's attention route (`marlaas.model.attention`): the model's own
        # products, grouped key/value heads attended without copies.
        if model.base._can_set_attn_implementation():
            install_attention(model.base)
        self.max_tokens_per_microbatch = max_tokens_per_microbatch
        #: The compact forward where it covers the base (`marlaas.train.decoder`).
        self.decoder = TrainDecoder.of(model)
        self.stats = TrainerStats()
        self._tenants: dict[str, _Tenant] = {}
        self._vocab = vocab_size(model)

    # -- tenants ---------------------------------------------------------------------

    def add(
        self,
        tenant: str,
        lora: LoRASpec,
        *,
        seed: int = 0,
        snapshot: TenantSnapshot | None = None,
    ) -> int:
        """Add a tenant: a fresh PEFT-style adapter from `seed` at version 0, or the
        state of `snapshot` (adapter, optimizer, version). Returns the version."""
        if tenant in self._tenants:
            raise ConfigError(f"tenant {tenant!r} is already registered; remove it first")
        self._tenants[tenant] = self._build(tenant, lora, seed, snapshot)
        return self._tenants[tenant].version

    def restore(self, snapshot: TenantSnapshot) -> int:
        """Put `snapshot.tenant` (back) in exactly the state of `snapshot`, replacing it
        if present (an invalid snapshot leaves it as it was). Returns the version."""
        self._tenants[snapshot.tenant] = self._build(snapshot.tenant, snapshot.lora, 0, snapshot)
        return snapshot.version

    def remove(self, tenant: str) -> None:
        del self._tenants[self._get(tenant).name]

    def tenants(self) -> list[str]:
        return list(self._tenants)

    def __contains__(self, tenant: object) -> bool:
        return tenant in self._tenants

    def version(self, tenant: str) -> int:
        return self._get(tenant).version

    def adapter(self, tenant: str) -> AdapterTensors:
        """A detached float32 CPU copy of the tenant's adapter (PEFT layout), ready for
        `AdapterBank.publish(tenant, trainer.version(tenant), ..., owned=True)`: views of
        one new vector that nothing else holds (one copy, not one per tensor)."""
        state = self._get(tenant)
        return state.layout.unflatten(state.flat_P.detach().to("cpu", torch.float32, copy=True))

    def snapshot(self, tenant: str) -> TenantSnapshot:
        """The tenant's state at its version (accumulated gradients are not in it)."""
        s = self._get(tenant)
        return TenantSnapshot(
            tenant=s.name,
            lora=s.lora,
            version=s.version,
            tensors=self.adapter(tenant),
            adam=s.adam.copy("cpu"),
        )

    def _build(
        self, tenant: str, lora: LoRASpec, seed: int, snapshot: TenantSnapshot | None
    ) -> _Tenant:
        if lora.rank < 1:
            raise ConfigError(f"tenant {tenant!r}: a rank-0 adapter has nothing to train")
        if snapshot is not None and snapshot.lora != lora:
            raise ConfigError(
                f"tenant {tenant!r}: the snapshot is of another LoRA spec ({snapshot.lora}); "
                "add the tenant with the snapshot's spec"
            )
        layout = AdapterLayout.for_spec(self.model, lora)
        if snapshot is None:
            tensors = self.model.init_adapter(lora, seed)
        else:
            tensors = snapshot.tensors
            self.model.check_tensors(lora, tensors)
        flat_P = layout.flatten(tensors, self.model.device).requires_grad_(True)
        adam = AdamState.zeros_like(flat_P.detach())
        if snapshot is not None and snapshot.adam is not None:
            if tuple(snapshot.adam.exp_avg_P.shape) != tuple(flat_P.shape):
                raise ModelError(
                    f"tenant {tenant!r}: the snapshot's optimizer state has "
                    f"{snapshot.adam.exp_avg_P.numel()} entries, the adapter {layout.numel}"
                )
            adam = snapshot.adam.copy(self.model.device)
        version = 0 if snapshot is None else snapshot.version
        if version < 0:
            raise ConfigError(f"tenant {tenant!r}: a snapshot's version must be >= 0")
        return _Tenant(tenant, lora, layout, flat_P, adam, version)

    # -- passes and steps ------------------------------------------------------------

    def forward_backward(self, inputs: Sequence[TrainInput]) -> dict[str, TrainOutput]:
        """Each input's loss and sums; its gradient accumulates into its tenant's."""
        return self._pass(inputs, backward=True)

    def forward(self, inputs: Sequence[TrainInput]) -> dict[str, TrainOutput]:
        """Each input's loss and sums (and log-probs when asked), without gradient."""
        with torch.no_grad():
            return self._pass(inputs, backward=False)

    def optim_step(self, steps: Sequence[tuple[str, AdamParams]]) -> dict[str, OptimResult]:
        """One AdamW step for each named tenant on its accumulated (clipped) gradient,
        all batched; each tenant's version goes up by one and its gradient is cleared."""
        names = [tenant for tenant, _ in steps]
        if len(set(names)) != len(names):
            raise ConfigError("an optimizer step takes each tenant at most once")
        states = [self._get(name) for name in names]
        params = [p for _, p in steps]
        if not states:
            return {}
        try:
            grads = [
                s.flat_P.grad if s.flat_P.grad is not None else torch.zeros_like(s.flat_P)
                for s in states
            ]
            norms, lrs = clipped_adamw_step_(
                [s.flat_P for s in states], grads, [s.adam for s in states], params
            )
        finally:
            for s in states:
                s.flat_P.grad = None
        for s in states:
            s.version += 1
        self.stats.optim_steps += 1
        return {
            s.name: OptimResult(s.name, s.version, norm, lr)
            for s, norm, lr in zip(states, norms, lrs, strict=True)
        }

    def _get(self, tenant: str) -> _Tenant:
        state = self._tenants.get(tenant)
        if state is None:
            raise TenantNotFound(f"no tenant {tenant!r} is registered in the trainer")
        return state

    def _admit(self, inputs: Sequence[TrainInput]) -> list[_Tenant]:
        tenants_of(inputs)  # one input per tenant
        states = [self._get(i.tenant) for i in inputs]
        for inp, state in zip(inputs, states, strict=True):
            if inp.version is not None and inp.version != state.version:
                raise TrainBatchError(
                    inp.tenant,
                    f"batch is for step {inp.version} but the adapter is at version "
                    f"{state.version}; build batches for the current version",
                )
        return states

    def _pass(self, inputs: Sequence[TrainInput], *, backward: bool) -> dict[str, TrainOutput]:
        if not inputs:
            return {}
        states = self._admit(inputs)
        rows = concat_rows([i.rows for i in inputs])
        check_rows([i.tenant for i in inputs], rows, self._vocab, self.max_tokens_per_microbatch)
        # The compact forward packs the valid tokens: padding costs it little, so rows
        # of different lengths share micro-batches (fewer forwards).
        min_fill = PACKED_MIN_FILL if self._compact() is not None else MIN_FILL
        plans = plan_microbatches(rows, self.max_tokens_per_microbatch, min_fill)
        sums = _Sums(len(inputs))
        want = any(i.return_logprobs for i in inputs)
        lp_NT = torch.zeros(rows.weights_NT.shape) if want else None
        for plan in plans:
            self._run_microbatch(plan, rows, inputs, states, sums, lp_NT, backward)
        self.stats.passes += 1
        self.stats.rows += int(rows.tenant_N.shape[0])
        return self._outputs(inputs, states, rows, sums, lp_NT)

    def _outputs(
        self,
        inputs: Sequence[TrainInput],
        states: Sequence[_Tenant],
        rows: Rows,
        sums: _Sums,
        lp_NT: Tensor | None,
    ) -> dict[str, TrainOutput]:
        by_tenant = sums.values()
        out: dict[str, TrainOutput] = {}
        first = 0
        for k, (inp, state) in enumerate(zip(inputs, states, strict=True)):
            logprobs = None
            if inp.return_logprobs and lp_NT is not None:
                logprobs = tuple(
                    tuple(lp_NT[first + i, : len(d.input_ids)].tolist())
                    for i, d in enumerate(inp.data)
                )
            first += len(inp.data)
            out[inp.tenant] = TrainOutput(
                inp.tenant, state.version, by_tenant[k], len(inp.data), logprobs
            )
        return out

    def _logits(
        self, ids_BT: Tensor, attn_BT: Tensor, lanes: LaneBatch | None = None
    ) -> TokenLogits:
        """Logits of right-padded rows (`attn_BT`: the valid tokens), each under its lane
        of `lanes` (None: the plain base)."""
        decoder = self._compact()
        if decoder is None:
            with self.model.lanes(lanes) if lanes is not None else contextlib.nullcontext():
                out = self.model.base(input_ids=ids_BT, attention_mask=attn_BT, use_cache=False)
            return TokenLogits(out.logits)
        pos_BT = torch.arange(ids_BT.shape[1], device=ids_BT.device).expand_as(ids_BT)
        return decoder.forward(ids_BT, attn_BT, pos_BT, lanes=lanes)[0]

    def _compact(self) -> TrainDecoder | None:
        """The compact forward, unless `kernels.torch_path()` asks for the modules."""
        return None if torch_path_on() else self.decoder

    def _run_microbatch(
        self,
        plan: MicroBatch,
        rows: Rows,
        inputs: Sequence[TrainInput],
        states: Sequence[_Tenant],
        sums: _Sums,
        lp_NT: Tensor | None,
        backward: bool,
    ) -> None:
        dev = self.model.device
        T, idx_B = plan.length, plan.rows_B
        ids_BT = rows.input_ids_NT[idx_B, :T].to(dev)
        tgt_BT = rows.target_ids_NT[idx_B, :T].to(dev)
        beh_BT = rows.behaviour_NT[idx_B, :T].to(dev)
        w_BT = rows.weights_NT[idx_B, :T].to(dev)
        adv_BT = rows.advantages_NT[idx_B, :T].to(dev)
        attn_BT = (torch.arange(T) < rows.lengths_N[idx_B, None]).long().to(dev)
        lane_inputs = [inputs[k] for k in plan.lanes]
        lane_states = [states[k] for k in plan.lanes]
        lane_B = plan.lane_B.to(dev)
        temps_L = [i.temperature for i in lane_inputs]
        temp_B = (
            None if all(t == 1.0 for t in temps_L) else torch.tensor(temps_L, device=dev)[lane_B]
        )
        self.stats.microbatches += 1
        self.stats.max_microbatch_tokens = max(self.stats.max_microbatch_tokens, plan.tokens)
        self.stats.max_microbatch_lanes = max(self.stats.max_microbatch_lanes, len(plan.lanes))

        ref_BT = None
        base_lanes = [lane for lane, i in enumerate(lane_inputs) if i.loss.needs_base_logprobs]
        if base_lanes:  # the plain base on the rows that need it: no lane batch set
            sel = torch.cat(
                [torch.arange(plan.offsets[lane], plan.offsets[lane + 1]) for lane in base_lanes]
            ).to(dev)
            with torch.no_grad():
                base = self._logits(ids_BT[sel], attn_BT[sel])
                lp_base, _ = _logprobs(base, tgt_BT[sel], None if temp_B is None else temp_B[sel])
                ref_BT = torch.zeros_like(beh_BT)
                ref_BT[sel] = lp_base
                del base

        lanes = MicroLanes.of(self.model, lane_states, lane_B, grad=backward)
        lane_batch = lanes.batch
        shared = SharedPrefix.plan(rows, plan)
        if shared is None:
            logits = self._logits(ids_BT, attn_BT, lane_batch)
        else:  # from here on, every [B, T] tensor is in the suffix layout
            self.stats.shared_prefix_microbatches += 1
            ids_BT, tgt_BT, beh_BT, w_BT, adv_BT = (
                shared.suffix(x) for x in (ids_BT, tgt_BT, beh_BT, w_BT, adv_BT)
            )
            ref_BT = None if ref_BT is None else shared.suffix(ref_BT)
            logits = shared.logits(self.model, lane_batch, ids_BT, self._compact())
        # The backward needs no lane context: autograd keeps the lane tensors it used.
        lp_BT, z = _logprobs(logits, tgt_BT, temp_B)
        if lp_NT is not None and shared is None:  # rows that want log-probs never share
            lp_NT[idx_B, :T] = lp_BT.detach().to("cpu", torch.float32)
        mask_BT = w_BT != 0
        z_NV = z.detach()[logits.tokens(mask_BT)]  # the weighted positions', row-major
        losses: list[Tensor] = []
        # Every lane's rows in one set of ops where their objectives allow it.
        loss_in = LossInputs(lp_BT, z_NV, w_BT, beh_BT, adv_BT, ref_BT)
        together = lane_rows([i.loss for i in lane_inputs], lane_B, loss_in)
        if together is not None:
            loss, row_sums = together
            losses.append(loss)
            sums.add_rows(plan.lanes, torch.tensor(plan.lanes, device=dev)[lane_B], row_sums)
        else:
            for lane, inp in enumerate(lane_inputs):
                loss, lane_sums = inp.loss(loss_in.rows(plan.offsets[lane], plan.offsets[lane + 1]))
                losses.append(loss)
                sums.add(plan.lanes[lane], lane_sums)
        if backward:
            (losses[0] if len(losses) == 1 else torch.stack(losses).sum()).backward()
            lanes.accumulate()


class _Sums:
    """The sums of a pass's inputs, per name a float64 `[K]` vector (one device sync for
    the whole pass when read), and which names each input has."""

    def __init__(self, inputs: int) -> None:
        self.inputs = inputs
        self.totals: dict[str, Tensor] = {}
        self.names: list[set[str]] = [set() for _ in range(inputs)]

    def _total(self, name: str, like: Tensor) -> Tensor:
        total = self.totals.get(name)
        if total is None:
            total = torch.zeros(self.inputs, dtype=torch.float64, device=like.device)
            self.totals[name] = total
        return total

    def add(self, k: int, sums: Mapping[str, Tensor]) -> None:
        """Input `k`'s sums (0-dim tensors)."""
        for name, value in sums.items():
            self._total(name, value)[k] += value.to(torch.float64)
            self.names[k].add(name)

    def add_rows(self, ks: Sequence[int], input_B: Tensor, sums: Mapping[str, Tensor]) -> None:
        """Per-row sums `[B]` of inputs `ks`, row `b` of input `input_B[b]`."""
        for name, value_B in sums.items():
            self._total(name, value_B).index_add_(0, input_B, value_B.to(torch.float64))
            for k in ks:
                self.names[k].add(name)

    def values(self) -> list[dict[str, float]]:
        """Each input's sums as numbers (`loss` and `tokens` at least, 0 when none)."""
        names = sorted(self.totals)
        table = torch.stack([self.totals[n] for n in names]).tolist() if names else []
        out: list[dict[str, float]] = [{"loss": 0.0, "tokens": 0.0} for _ in range(self.inputs)]
        for row, name in zip(table, names, strict=True):
            for k, value in enumerate(row):
                if name in self.names[k]:
                    out[k][name] = value
        return out


def _logprobs(
    logits: TokenLogits, targets_BT: Tensor, temp_B: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The log-probs `[B, T]` of `targets_BT` under `logits` divided by each row's
    sampling temperature (zeros at the padding of packed logits), and those scaled
    logits, in at least float32, at the logits' positions."""
    z = logits.values.to(torch.promote_types(logits.values.dtype, torch.float32))
    if temp_B is not None:
        z = z / logits.tokens(temp_B[:, None].expand(targets_BT.shape))[..., None]
    return logits.padded(token_logprobs(z, logits.tokens(targets_BT))), z
