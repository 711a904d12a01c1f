"""The multi-lane trainer: one forward/backward over the shared base updates the adapters
of every tenant that has a ready batch, each with its own loss, optimizer and clipping.

A step packs the rows of all the given batches into micro-batches of at most
`max_tokens_per_microbatch` padded tokens (rows of different tenants mixed), runs each
micro-batch once with one LoRA lane per tenant present (lane tensors are views of the
tenants' flat leaf parameters, stacked by `LoRAModel.lane_batch`), and accumulates
gradients; then every tenant takes one AdamW step on its own clipped gradient.

Per tenant, per micro-batch, on that tenant's contiguous slice of rows:
`loss = policy_loss(log pi, log mu, A, mask; clip_low, clip_high, tis_cap)` with
`weights_BT` from `token_weights` over the tenant's whole step batch, plus
`kl_coef * sum(w * kl_penalty(log pi, log pi_base))` when `kl_coef > 0`, where
`log pi_base` comes from the same rows run with no lane batch (the plain base) under
`no_grad`. Log-probs are `log_softmax(logits / temperature)` at the tenant's sampling
temperature. The micro-batch's loss is the sum over its tenants, so its gradient
reaches each tenant's adapter from that tenant's rows only. Where a micro-batch holds
several samples of one prompt (GRPO groups), the prompt runs once and its rows share its
cache (`marlaas.train.prefix`), when that saves tokens.

Invariants:
- Training tenants together gives the adapters each would get alone (same batches,
  same seeds), up to floating-point noise: losses are per-tenant weighted sums, lanes
  are independent, optimizer updates are element-wise per tenant.
- A tenant's version goes up by exactly one per optimizer step, and `step` takes at
  most one batch per tenant, built for the tenant's current version, with staleness
  within its `max_staleness`.
- `step` validates every batch before touching any state; a bad batch raises
  `TrainBatchError` naming its tenant and changes nothing (drop it and retry the rest).
- Memory is bounded by the token budget: a micro-batch never exceeds it and holds lanes
  only for the tenants among its rows (`stats.max_microbatch_tokens` records it).
- The base is never written. No module-level state: everything lives in the trainer.

Not thread-safe: one `step` at a time per trainer (the rollout engine may run forwards
in other threads; `LoRAModel.lanes` serialises the lane batches).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from marlaas.config.specs import GRPOSpec, LoRASpec
from marlaas.errors import ConfigError, TenantNotFound
from marlaas.model.lora import AdapterTensors, LoRAModel
from marlaas.train.batch import (
    NUM_SUMS,
    MicroBatch,
    Rows,
    TenantStepResult,
    TrainBatch,
    TrainBatchError,
    check_rows,
    plan_microbatches,
)
from marlaas.train.batch import tensorise as tensorise_rows
from marlaas.train.losses import entropy_from_logits, kl_penalty, policy_loss, token_logprobs
from marlaas.train.optim import (
    AdamState,
    AdamWConfig,
    AdapterLayout,
    TenantSnapshot,
    adamw_step_,
    clip_grad_norms_,
)
from marlaas.train.prefix import SharedPrefix


@dataclass
class TrainerStats:
    """Counters over the trainer's life (the memory bound is checked against these)."""

    steps: int = 0
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
    algo: GRPOSpec
    optim: AdamWConfig
    temperature: float
    constant_norm_tokens: float | None
    layout: AdapterLayout
    flat_P: Tensor  # the leaf parameter: every module's A and B, flattened
    adam: AdamState
    version: int
    generator: torch.Generator


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
        self.max_tokens_per_microbatch = max_tokens_per_microbatch
        self.stats = TrainerStats()
        self._tenants: dict[str, _Tenant] = {}
        self._vocab = vocab_size(model)

    # -- tenants ---------------------------------------------------------------------

    def register(
        self,
        tenant: str,
        lora: LoRASpec,
        algo: GRPOSpec,
        tensors: AdapterTensors | None = None,
        seed: int = 0,
        temperature: float = 1.0,
        *,
        warmup_steps: int = 0,
        constant_norm_tokens: float | None = None,
    ) -> None:
        """Add a tenant at version 0 with `tensors` or a fresh PEFT-style init from `seed`.

        `temperature` is the rollout's sampling temperature (log-probs are computed at
        it; pass 1.0 for greedy). `warmup_steps` gives a linear learning-rate warmup.
        `constant_norm_tokens` is required by `loss_norm="constant"` (Dr. GRPO: rows x
        max new tokens).
        """
        if tenant in self._tenants:
            raise ConfigError(f"tenant {tenant!r} is already registered; remove it first")
        if lora.rank < 1:
            raise ConfigError(f"tenant {tenant!r}: a rank-0 adapter has nothing to train")
        if not temperature > 0:
            raise ConfigError(f"temperature must be > 0 (use 1.0 for greedy), got {temperature}")
        if algo.loss_norm == "constant" and constant_norm_tokens is None:
            raise ConfigError(
                f"tenant {tenant!r}: loss_norm='constant' needs constant_norm_tokens "
                "(rows per step x max new tokens)"
            )
        layout = AdapterLayout.for_spec(self.model, lora)
        if tensors is None:
            tensors = self.model.init_adapter(lora, seed)
        else:
            self.model.check_tensors(lora, tensors)
        flat_P = layout.flatten(tensors, self.model.device).requires_grad_(True)
        self._tenants[tenant] = _Tenant(
            name=tenant,
            lora=lora,
            algo=algo,
            optim=AdamWConfig.from_spec(algo, warmup_steps),
            temperature=float(temperature),
            constant_norm_tokens=constant_norm_tokens,
            layout=layout,
            flat_P=flat_P,
            adam=AdamState.zeros_like(flat_P.detach()),
            version=0,
            generator=torch.Generator().manual_seed(seed),
        )

    def remove(self, tenant: str) -> None:
        del self._tenants[self._get(tenant).name]

    def tenants(self) -> list[str]:
        return list(self._tenants)

    def __contains__(self, tenant: object) -> bool:
        return tenant in self._tenants

    def version(self, tenant: str) -> int:
        return self._get(tenant).version

    def generator(self, tenant: str) -> torch.Generator:
        """The tenant's own RNG (seeded at registration, saved in checkpoints), for
        callers that need tenant-scoped randomness; a step itself draws nothing."""
        return self._get(tenant).generator

    def adapter(self, tenant: str) -> AdapterTensors:
        """A detached float32 CPU copy of the tenant's adapter (PEFT layout), ready for
        `AdapterBank.publish(tenant, trainer.version(tenant), ...)`."""
        state = self._get(tenant)
        views = state.layout.unflatten(state.flat_P.detach().to("cpu", copy=True))
        return {p: (A.clone(), B.clone()) for p, (A, B) in views.items()}

    def snapshot(self, tenant: str) -> TenantSnapshot:
        s = self._get(tenant)
        return TenantSnapshot(
            tenant=s.name,
            lora=s.lora,
            algo=s.algo,
            temperature=s.temperature,
            warmup_steps=s.optim.warmup_steps,
            constant_norm_tokens=s.constant_norm_tokens,
            version=s.version,
            tensors=self.adapter(tenant),
            adam=s.adam.copy("cpu"),
            rng_state=s.generator.get_state(),
        )

    def restore(self, snapshot: TenantSnapshot) -> None:
        """Put a tenant (back) in exactly the state of `snapshot`, replacing it if present."""
        previous = self._tenants.pop(snapshot.tenant, None)
        try:
            self.register(
                snapshot.tenant,
                snapshot.lora,
                snapshot.algo,
                snapshot.tensors,
                temperature=snapshot.temperature,
                warmup_steps=snapshot.warmup_steps,
                constant_norm_tokens=snapshot.constant_norm_tokens,
            )
        except Exception:
            if previous is not None:  # an invalid snapshot leaves the tenant as it was
                self._tenants[snapshot.tenant] = previous
            raise
        state = self._tenants[snapshot.tenant]
        state.adam = snapshot.adam.copy(self.model.device)
        state.version = snapshot.version
        state.generator.set_state(snapshot.rng_state.clone())

    # -- the step --------------------------------------------------------------------

    def step(self, batches: Sequence[TrainBatch]) -> dict[str, TenantStepResult]:
        """One optimizer step for each batch's tenant, all in one pass over the base."""
        if not batches:
            return {}
        states = self._admit(batches)
        rows = tensorise_rows(batches, [(s.algo.loss_norm, s.constant_norm_tokens) for s in states])
        check_rows(batches, rows, self._vocab, self.max_tokens_per_microbatch)
        plans = plan_microbatches(rows, self.max_tokens_per_microbatch)
        acc_KM = torch.zeros(len(states), NUM_SUMS, device=self.model.device)
        try:
            for plan in plans:
                self._run_microbatch(plan, rows, states, acc_KM)
            grads = [
                s.flat_P.grad if s.flat_P.grad is not None else torch.zeros_like(s.flat_P)
                for s in states
            ]
            norms_K = clip_grad_norms_(grads, [s.optim.max_grad_norm for s in states])
            lrs = adamw_step_(
                [s.flat_P for s in states],
                grads,
                [s.adam for s in states],
                [s.optim for s in states],
            )
        finally:
            for s in states:
                s.flat_P.grad = None
        for s in states:
            s.version += 1
        self.stats.steps += 1
        self.stats.rows += int(rows.tenant_N.shape[0])
        return {
            s.name: TenantStepResult.from_sums(batch, s.version, sums, norm, lr, s.algo.kl_coef > 0)
            for batch, s, sums, norm, lr in zip(
                batches, states, acc_KM.tolist(), norms_K.tolist(), lrs, strict=True
            )
        }

    def _get(self, tenant: str) -> _Tenant:
        state = self._tenants.get(tenant)
        if state is None:
            raise TenantNotFound(f"no tenant {tenant!r} is registered in the trainer")
        return state

    def _admit(self, batches: Sequence[TrainBatch]) -> list[_Tenant]:
        names = [b.tenant for b in batches]
        if len(set(names)) != len(names):
            raise ConfigError("a trainer step takes at most one batch per tenant")
        states = [self._get(name) for name in names]
        for batch, state in zip(batches, states, strict=True):
            if batch.step != state.version:
                raise TrainBatchError(
                    batch.tenant,
                    f"batch is for step {batch.step} but the adapter is at version "
                    f"{state.version}; build batches for the current version",
                )
            staleness = batch.staleness()
            if min(staleness) < 0:
                raise TrainBatchError(batch.tenant, "a trajectory has a version from the future")
            if max(staleness) > state.algo.max_staleness:
                raise TrainBatchError(
                    batch.tenant,
                    f"batch staleness {max(staleness)} exceeds max_staleness "
                    f"{state.algo.max_staleness}",
                )
        return states

    def _logits(self, ids_BT: Tensor, attn_BT: Tensor) -> Tensor:
        return self.model.base(input_ids=ids_BT, attention_mask=attn_BT, use_cache=False).logits

    def _run_microbatch(
        self, plan: MicroBatch, rows: Rows, states: Sequence[_Tenant], acc_KM: Tensor
    ) -> None:
        dev = self.model.device
        T, idx_B = plan.length, plan.rows_B
        ids_BT = rows.input_ids_NT[idx_B, :T].to(dev)
        tgt_BT = rows.target_ids_NT[idx_B, :T].to(dev)
        mask_BT = rows.mask_NT[idx_B, :T].to(dev)
        beh_BT = rows.behaviour_NT[idx_B, :T].to(dev)
        w_BT = rows.weights_NT[idx_B, :T].to(dev)
        adv_B = rows.advantages_N[idx_B].to(dev)
        attn_BT = (torch.arange(T) < rows.lengths_N[idx_B, None]).long().to(dev)
        lane_states = [states[k] for k in plan.lanes]
        lane_B = plan.lane_B.to(dev)
        temps_L = [s.temperature for s in lane_states]
        temp_B = (
            None if all(t == 1.0 for t in temps_L) else torch.tensor(temps_L, device=dev)[lane_B]
        )
        self.stats.microbatches += 1
        self.stats.max_microbatch_tokens = max(self.stats.max_microbatch_tokens, plan.tokens)
        self.stats.max_microbatch_lanes = max(self.stats.max_microbatch_lanes, len(plan.lanes))

        ref_BT = None
        kl_lanes = [lane for lane, s in enumerate(lane_states) if s.algo.kl_coef > 0]
        if kl_lanes:  # the plain base on the rows that need it: no lane batch set
            sel = torch.cat(
                [torch.arange(plan.offsets[lane], plan.offsets[lane + 1]) for lane in kl_lanes]
            ).to(dev)
            with torch.no_grad():
                z_base = _scaled(
                    self._logits(ids_BT[sel], attn_BT[sel]),
                    None if temp_B is None else temp_B[sel],
                )
                ref_BT = torch.zeros_like(beh_BT)
                ref_BT[sel] = token_logprobs(z_base, tgt_BT[sel])
                del z_base

        lane_batch = self.model.lane_batch(
            [(s.lora, s.layout.unflatten(s.flat_P)) for s in lane_states], lane_B
        )
        shared = SharedPrefix.plan(rows, plan)
        if shared is None:
            with self.model.lanes(lane_batch):
                logits_BTV = self._logits(ids_BT, attn_BT)
        else:  # from here on, every [B, T] tensor is in the suffix layout
            self.stats.shared_prefix_microbatches += 1
            ids_BT, tgt_BT, mask_BT, beh_BT, w_BT = (
                shared.suffix(x) for x in (ids_BT, tgt_BT, mask_BT, beh_BT, w_BT)
            )
            ref_BT = None if ref_BT is None else shared.suffix(ref_BT)
            logits_BTV = shared.logits(self.model, lane_batch, ids_BT)
        # The backward needs no lane context: autograd keeps the lane tensors it used.
        z_BTV = _scaled(logits_BTV, temp_B)
        lp_BT = token_logprobs(z_BTV, tgt_BT)
        losses: list[Tensor] = []
        stats: list[Tensor] = []
        for lane, s in enumerate(lane_states):
            a, b = plan.offsets[lane], plan.offsets[lane + 1]
            loss, m = policy_loss(
                lp_BT[a:b],
                beh_BT[a:b],
                adv_B[a:b],
                mask_BT[a:b],
                clip_low=s.algo.clip_low,
                clip_high=s.algo.clip_high,
                tis_cap=s.algo.tis_cap,
                weights_BT=w_BT[a:b],
            )
            kl_sum = loss.new_zeros(())
            if ref_BT is not None and s.algo.kl_coef > 0:
                kl_BT = kl_penalty(
                    lp_BT[a:b], ref_BT[a:b], s.algo.kl_estimator, mask_BT=mask_BT[a:b]
                )
                loss = loss + s.algo.kl_coef * (w_BT[a:b] * kl_BT).sum()
                kl_sum = kl_BT.detach().sum()
            losses.append(loss)
            tokens = m["tokens"].to(loss.dtype)
            # Columns LOSS .. KL_BASE of `batch.NUM_SUMS`; ENTROPY is appended below.
            stats.append(
                torch.stack(
                    [
                        loss.detach(),
                        tokens,
                        m["clip_frac"] * tokens,
                        m["ratio_mean"] * tokens,
                        m["kl_behaviour"] * tokens,
                        kl_sum,
                    ]
                )
            )
        torch.stack(losses).sum().backward()
        with torch.no_grad():
            ent_B = torch.where(mask_BT, entropy_from_logits(z_BTV.detach()), 0.0).sum(1)
            ent_L = torch.zeros(len(lane_states), device=dev).index_add_(0, lane_B, ent_B)
            lane_KM = torch.cat([torch.stack(stats), ent_L[:, None]], dim=1)
            acc_KM.index_add_(0, torch.tensor(plan.lanes, device=dev), lane_KM.to(acc_KM.dtype))


def _scaled(logits_BTV: Tensor, temp_B: Tensor | None) -> Tensor:
    """Logits in at least float32, divided by each row's sampling temperature."""
    z_BTV = logits_BTV.to(torch.promote_types(logits_BTV.dtype, torch.float32))
    return z_BTV if temp_B is None else z_BTV / temp_B[:, None, None]
