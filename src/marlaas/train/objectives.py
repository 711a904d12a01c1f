"""Training objectives: the loss a `forward_backward` call names for a tenant's data, as
pure functions over that tenant's per-token inputs, found through one registry.

Shapes are named by suffix: `_B` rows, `_T` token positions, `_V` vocabulary. An
objective is a small frozen dataclass (its configuration) whose `__call__` maps the
`LossInputs` of one tenant's rows in one micro-batch to `(loss, sums)`:

- `loss` is a 0-dim tensor, a plain sum over tokens `sum_{b,t} w[b, t] * l[b, t]` with
  the data's own weights `w` (the `weights` of each `Datum`). Because it is a sum, any
  split of the rows into micro-batches, and any split of a batch into several
  `forward_backward` calls before one `optim_step`, gives the same gradient: a caller
  that wants a mean (GRPO's normalisation over a tenant's whole step batch, `"token"`,
  `"sequence"` or `"constant"`) passes weights that already carry it
  (`marlaas.train.losses.token_weights`). Tinker's losses are sums with the data's
  weights as they come.
- `sums` are detached 0-dim tensors, each a sum over these rows' weighted tokens, so
  they add up across micro-batches and calls: always `"loss"` and `"tokens"` (positions
  with a non-zero weight), plus the objective's own (means are `sum / tokens`).

The registry holds the trainer's own `cross_entropy` and `policy_gradient`, and
Tinker's `importance_sampling`, `ppo`, `cispo` and `dro` (the Tinker-compatible API,
`marlaas.service.tinker`, names them as Tinker clients do). Adding an objective is one
dataclass here and one entry in `OBJECTIVES`; `inputs` names the per-token inputs it
needs beyond targets and weights, so bad data is refused before the shared pass.

Nothing here holds state or reads a config file; the device runs whatever objective
each tenant's data names, several in one multi-lane pass.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor

from marlaas.errors import ConfigError
from marlaas.train.losses import (
    KLEstimator,
    entropy_from_logits,
    kl_penalty,
    surrogate,
)

#: Per-token inputs an objective may need beyond targets and weights (see `Datum`).
SAMPLING_LOGPROBS = "sampling_logprobs"
ADVANTAGES = "advantages"


@dataclass(frozen=True)
class LossInputs:
    """One tenant's rows of one micro-batch; every `[B, T]` tensor covers the same rows.

    `logprobs_BT` is `log_softmax(logits / temperature)` at each target, with gradient;
    `logits_NV` the temperature-scaled logits it came from at the weighted positions
    (`mask_BT`, row-major), without gradient, for the metrics (entropy, accuracy).
    Positions whose weight is 0 (prompt, tool output, padding) carry no loss and count
    as no token; `sampling_logprobs_BT` and `advantages_BT` are 0 where the data gave
    none. `base_logprobs_BT` (the plain base, no gradient) is set only for objectives
    with `needs_base_logprobs`.
    """

    logprobs_BT: Tensor
    logits_NV: Tensor
    weights_BT: Tensor
    sampling_logprobs_BT: Tensor
    advantages_BT: Tensor
    base_logprobs_BT: Tensor | None = None

    @property
    def mask_BT(self) -> Tensor:
        return self.weights_BT != 0

    def rows(self, a: int, b: int) -> LossInputs:
        """Rows `a:b` alone, with their weighted positions' logits."""
        mask_BT = self.mask_BT
        first = int(mask_BT[:a].sum())
        last = first + int(mask_BT[a:b].sum())
        return LossInputs(
            logprobs_BT=self.logprobs_BT[a:b],
            logits_NV=self.logits_NV[first:last],
            weights_BT=self.weights_BT[a:b],
            sampling_logprobs_BT=self.sampling_logprobs_BT[a:b],
            advantages_BT=self.advantages_BT[a:b],
            base_logprobs_BT=None if self.base_logprobs_BT is None else self.base_logprobs_BT[a:b],
        )


class Objective(Protocol):
    """A loss over one tenant's per-token inputs (see the module docstring)."""

    #: The registry name (what a `TrainInput` is made from on the wire).
    name: ClassVar[str]
    #: Per-token inputs every datum must carry (`SAMPLING_LOGPROBS`, `ADVANTAGES`).
    inputs: ClassVar[frozenset[str]]

    @property
    def needs_base_logprobs(self) -> bool:
        """Whether the device must also run the rows on the plain base (no adapter)."""
        ...

    def __call__(self, x: LossInputs) -> tuple[Tensor, dict[str, Tensor]]: ...


@dataclass(frozen=True)
class CrossEntropy:
    """Supervised next-token loss with per-token weights:

        loss = -sum_{b,t} w[b, t] * log pi_theta(y[b, t] | x[b, :t + 1])

    (the negative log-likelihood, e.g. Radford et al. 2018, eq. 1, with weights; Tinker's
    `cross_entropy`). Sums: `loss`, `tokens`, `nll` (unweighted, over weighted tokens),
    `correct` (weighted tokens whose target is the most likely token).
    """

    name: ClassVar[str] = "cross_entropy"
    inputs: ClassVar[frozenset[str]] = frozenset()

    @property
    def needs_base_logprobs(self) -> bool:
        return False

    def __call__(self, x: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
        mask_BT = x.mask_BT
        # `where`, not a product: a masked position's log-prob may be -inf.
        lp_BT = torch.where(mask_BT, x.logprobs_BT, torch.zeros_like(x.logprobs_BT))
        loss = -(x.weights_BT.to(lp_BT.dtype) * lp_BT).sum()
        with torch.no_grad():
            # The target is the argmax when its log-prob is the largest one (ties count);
            # only weighted positions are looked at.
            z_NV = x.logits_NV
            top_N = z_NV.max(dim=-1).values - torch.logsumexp(z_NV, dim=-1)
            correct = (x.logprobs_BT.detach()[mask_BT] >= top_N - 1e-6).sum()
            sums = {
                "loss": loss.detach(),
                "tokens": mask_BT.sum(),
                "nll": -lp_BT.detach().sum(),
                "correct": correct,
            }
        return loss, sums


@dataclass(frozen=True)
class PolicyGradient:
    """The trainer's RL objective: the clipped surrogate against the sampling policy with
    the decoupled clip range, optional truncated importance sampling and an optional
    KL penalty to the plain base (`marlaas.train.losses.policy_loss`, `kl_penalty`):

        loss = sum_{b,t} w * l_PPO(r, A; clip_low, clip_high, tis_cap)
               + kl_coef * sum_{b,t} w * KL_est(pi_theta || pi_base)

    (Schulman et al. 2017, eq. 7; Yu et al. 2025, sec. 3.1; Shao et al. 2024, eq. 4).
    With per-row advantages broadcast to tokens and GRPO's weights it is the GRPO step.
    Sums: `loss`, `tokens`, and over tokens `clipped`, `ratio`, `kl_behaviour` (k3 of
    KL(mu || pi)), `entropy` (of pi at the temperature), plus `kl_base` when `kl_coef > 0`.
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    tis_cap: float | None = None
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"

    name: ClassVar[str] = "policy_gradient"
    inputs: ClassVar[frozenset[str]] = frozenset({SAMPLING_LOGPROBS, ADVANTAGES})

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_low < 1.0 or self.clip_high < 0.0:
            raise ConfigError(
                f"need 0 <= clip_low < 1 and clip_high >= 0, got {self.clip_low}, {self.clip_high}"
            )
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ConfigError(f"tis_cap must be > 0 or None, got {self.tis_cap}")
        if self.kl_coef < 0:
            raise ConfigError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.kl_estimator not in ("k1", "k3"):
            raise ConfigError(f"kl_estimator must be 'k1' or 'k3', got {self.kl_estimator!r}")

    @property
    def needs_base_logprobs(self) -> bool:
        return self.kl_coef > 0

    def __call__(self, x: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
        loss, row_sums = _surrogate_rows(x, self.clip_low, self.clip_high, self.tis_cap)
        sums = {name: value.sum() for name, value in row_sums.items()}
        if self.kl_coef > 0:
            if x.base_logprobs_BT is None:
                raise ConfigError("policy_gradient with kl_coef > 0 needs the base log-probs")
            kl_BT = kl_penalty(
                x.logprobs_BT, x.base_logprobs_BT, self.kl_estimator, mask_BT=x.mask_BT
            )
            kl_loss = self.kl_coef * (x.weights_BT.to(kl_BT.dtype) * kl_BT).sum()
            loss = loss + kl_loss
            sums["loss"] = sums["loss"] + kl_loss.detach()
            sums["kl_base"] = kl_BT.detach().sum()
        return loss, sums

    @staticmethod
    def rows(
        objectives: Sequence[PolicyGradient], lane_B: Tensor, x: LossInputs
    ) -> tuple[Tensor, dict[str, Tensor]] | None:
        """The rows of several lanes in one set of ops, row `b` under
        `objectives[lane_B[b]]`: the loss of them all (the sum of each lane's) and each
        row's sums `[B]` (a lane's sums are those of its rows). None where a lane has a
        KL term (its base log-probs are the lane's own): the caller runs each lane."""
        if any(o.kl_coef > 0 for o in objectives):
            return None
        first = objectives[0]
        low: float | Tensor = first.clip_low
        high: float | Tensor = first.clip_high
        cap: float | Tensor | None = first.tis_cap
        if any(o != first for o in objectives):  # each row its lane's settings
            dev = x.logprobs_BT.device

            def per_row(values: list[float]) -> Tensor:
                return torch.tensor(values, dtype=torch.float64, device=dev)[lane_B][:, None]

            low = per_row([o.clip_low for o in objectives])
            high = per_row([o.clip_high for o in objectives])
            caps = [o.tis_cap for o in objectives]
            cap = (
                None
                if all(c is None for c in caps)
                else per_row([math.inf if c is None else c for c in caps])
            )
        return _surrogate_rows(x, low, high, cap)


def _surrogate_rows(
    x: LossInputs,
    clip_low: float | Tensor,
    clip_high: float | Tensor,
    tis_cap: float | Tensor | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """`PolicyGradient`'s clipped surrogate over `x` without its KL term: the loss and
    each row's sums `[B]` (settings as `losses.surrogate` takes them)."""
    mask_BT = x.mask_BT
    t = surrogate(
        x.logprobs_BT, x.sampling_logprobs_BT, x.advantages_BT, mask_BT, x.weights_BT,
        clip_low=clip_low, clip_high=clip_high, tis_cap=tis_cap,
    )  # fmt: skip
    with torch.no_grad():
        log_ratio_BT = t.log_ratio_BT
        # Only weighted positions count: the entropy of those alone (a micro-batch's
        # padding and prompt positions are often half its layout).
        entropy_BT = torch.zeros_like(log_ratio_BT)
        entropy_BT[mask_BT] = entropy_from_logits(x.logits_NV[None])[0]
        sums = {
            "loss": t.weighted_BT.detach().sum(dim=1),
            "tokens": mask_BT.sum(dim=1),
            "clipped": (t.low_BT | t.high_BT).sum(dim=1),
            "ratio": torch.where(mask_BT, t.ratio_BT, 0.0).sum(dim=1),
            "kl_behaviour": (torch.expm1(log_ratio_BT) - log_ratio_BT).sum(dim=1),
            "entropy": torch.where(mask_BT, entropy_BT, 0.0).sum(dim=1),
        }
    return t.weighted_BT.sum(), sums


def lane_rows(
    objectives: Sequence[Objective], lane_B: Tensor, x: LossInputs
) -> tuple[Tensor, dict[str, Tensor]] | None:
    """The loss and per-row sums `[B]` of a micro-batch's rows in one set of ops, row `b`
    under `objectives[lane_B[b]]` (each lane its tenant's objective), where those
    objectives allow it (every lane a `PolicyGradient` without a KL term); else None and
    the caller runs each lane's objective on its rows. Equal, up to rounding, to the
    lanes' own calls: the loss is their sum and a lane's sums are its rows' sums."""
    pg = [o for o in objectives if isinstance(o, PolicyGradient)]
    if len(pg) != len(objectives):
        return None
    return PolicyGradient.rows(pg, lane_B, x)


# -- Tinker's policy-gradient losses ---------------------------------------------------
#
# Tinker's semantics (tinker-docs.thinkingmachines.ai/tinker/losses): a plain sum over
# tokens, `p` the trained policy's log-prob of each target, `q` the sampler's
# (`sampling_logprobs`), `A` the per-token advantage, `r = exp(p - q)`. Here each
# token's term also carries the data's weight `w` (a position of weight 0 has none),
# as every objective of this module does.


def _masked(x: LossInputs) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`(mask, w, p, log r)` with masked positions zeroed, so that no `-inf` log-prob
    of a padding position reaches a product or an `exp`."""
    mask_BT = x.mask_BT
    zero = torch.zeros_like(x.logprobs_BT)
    p_BT = torch.where(mask_BT, x.logprobs_BT, zero)
    q_BT = torch.where(mask_BT, x.sampling_logprobs_BT.to(p_BT.dtype), zero)
    return mask_BT, x.weights_BT.to(p_BT.dtype), p_BT, p_BT - q_BT


def _ratio_sums(loss: Tensor, mask_BT: Tensor, ratio_BT: Tensor) -> dict[str, Tensor]:
    with torch.no_grad():
        return {
            "loss": loss.detach(),
            "tokens": mask_BT.sum(),
            "ratio": torch.where(mask_BT, ratio_BT.detach(), 0.0).sum(),
        }


def _check_thresholds(name: str, low: float, high: float) -> None:
    if not 0.0 <= low <= 1.0 <= high:
        raise ConfigError(
            f"loss {name!r} needs 0 <= clip_low_threshold <= 1 <= clip_high_threshold "
            f"(bounds on the ratio itself, e.g. 0.8 and 1.2), got {low} and {high}"
        )


@dataclass(frozen=True)
class ImportanceSampling:
    """REINFORCE with an importance weight against the sampler (Tinker's
    `importance_sampling`; the off-policy policy gradient of Degris et al. 2012, eq. 6):

        loss = -sum_{b,t} w * r * A,    r = pi_theta / q

    Sums: `loss`, `tokens`, `ratio` (sum of `r` over weighted tokens)."""

    name: ClassVar[str] = "importance_sampling"
    inputs: ClassVar[frozenset[str]] = frozenset({SAMPLING_LOGPROBS, ADVANTAGES})

    @property
    def needs_base_logprobs(self) -> bool:
        return False

    def __call__(self, x: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
        mask_BT, w_BT, _, log_r_BT = _masked(x)
        ratio_BT = torch.exp(log_r_BT)
        loss = -(w_BT * ratio_BT * x.advantages_BT.to(ratio_BT.dtype)).sum()
        return loss, _ratio_sums(loss, mask_BT, ratio_BT)


@dataclass(frozen=True)
class _RatioClip:
    """What PPO and CISPO share: the clip range as bounds on the importance ratio, over
    the sampler's log-probs and the advantages."""

    clip_low_threshold: float = 0.8
    clip_high_threshold: float = 1.2

    name: ClassVar[str]
    inputs: ClassVar[frozenset[str]] = frozenset({SAMPLING_LOGPROBS, ADVANTAGES})

    def __post_init__(self) -> None:
        _check_thresholds(self.name, self.clip_low_threshold, self.clip_high_threshold)

    @property
    def needs_base_logprobs(self) -> bool:
        return False


@dataclass(frozen=True)
class PPO(_RatioClip):
    """The clipped surrogate (Tinker's `ppo`; Schulman et al. 2017, eq. 7), with the
    clip range given as bounds on the ratio itself:

        loss = -sum_{b,t} w * min(r * A, clip(r, clip_low_threshold, clip_high_threshold) * A)

    Sums: `loss`, `tokens`, `ratio`, `clipped` (tokens on the clipped branch)."""

    name: ClassVar[str] = "ppo"

    def __call__(self, x: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
        mask_BT, w_BT, _, log_r_BT = _masked(x)
        ratio_BT = torch.exp(log_r_BT)
        adv_BT = x.advantages_BT.to(ratio_BT.dtype)
        clipped_BT = ratio_BT.clamp(self.clip_low_threshold, self.clip_high_threshold)
        unclipped_obj_BT, clipped_obj_BT = ratio_BT * adv_BT, clipped_BT * adv_BT
        loss = -(w_BT * torch.minimum(unclipped_obj_BT, clipped_obj_BT)).sum()
        sums = _ratio_sums(loss, mask_BT, ratio_BT)
        with torch.no_grad():
            on_clip_BT = mask_BT & (clipped_obj_BT < unclipped_obj_BT)
            sums["clipped"] = on_clip_BT.sum()
        return loss, sums


@dataclass(frozen=True)
class CISPO(_RatioClip):
    """Clipped importance-sampling policy optimisation (Tinker's `cispo`; MiniMax 2025,
    arXiv 2506.13585, eq. 4): the ratio is clipped and detached, so every token keeps a
    gradient (none is dropped, unlike PPO's clipped branch):

        loss = -sum_{b,t} w * sg(clip(r, clip_low_threshold, clip_high_threshold)) * A * log pi_theta

    Sums: `loss`, `tokens`, `ratio`, `clipped` (tokens whose ratio was clipped)."""

    name: ClassVar[str] = "cispo"

    def __call__(self, x: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
        mask_BT, w_BT, p_BT, log_r_BT = _masked(x)
        ratio_BT = torch.exp(log_r_BT.detach())
        coef_BT = ratio_BT.clamp(self.clip_low_threshold, self.clip_high_threshold)
        loss = -(w_BT * coef_BT * x.advantages_BT.to(p_BT.dtype) * p_BT).sum()
        sums = _ratio_sums(loss, mask_BT, ratio_BT)
        with torch.no_grad():
            sums["clipped"] = (mask_BT & (coef_BT != ratio_BT)).sum()
        return loss, sums


@dataclass(frozen=True)
class DRO:
    """Direct reward optimisation (Tinker's `dro`; Richemond et al. 2024, arXiv
    2405.19107, eq. 9, as a per-token objective): the log-likelihood weighted by the
    advantage, with a quadratic penalty on the log-ratio instead of a clip:

        loss = -sum_{b,t} w * (A * log pi_theta - beta / 2 * (log pi_theta - log q)^2)

    Sums: `loss`, `tokens`, `ratio`, `quadratic` (sum of `(log r)^2`)."""

    beta: float = 0.05

    name: ClassVar[str] = "dro"
    inputs: ClassVar[frozenset[str]] = frozenset({SAMPLING_LOGPROBS, ADVANTAGES})

    def __post_init__(self) -> None:
        if not self.beta >= 0:
            raise ConfigError(f"loss 'dro' needs beta >= 0, got {self.beta}")

    @property
    def needs_base_logprobs(self) -> bool:
        return False

    def __call__(self, x: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
        mask_BT, w_BT, p_BT, log_r_BT = _masked(x)
        quadratic_BT = log_r_BT.square()
        objective_BT = x.advantages_BT.to(p_BT.dtype) * p_BT - 0.5 * self.beta * quadratic_BT
        loss = -(w_BT * objective_BT).sum()
        sums = _ratio_sums(loss, mask_BT, torch.exp(log_r_BT))
        with torch.no_grad():
            sums["quadratic"] = torch.where(mask_BT, quadratic_BT.detach(), 0.0).sum()
        return loss, sums


_ObjectiveClass = (
    type[CrossEntropy]
    | type[PolicyGradient]
    | type[ImportanceSampling]
    | type[PPO]
    | type[CISPO]
    | type[DRO]
)

#: Every objective by its registry name.
OBJECTIVES: dict[str, _ObjectiveClass] = {
    cls.name: cls for cls in (CrossEntropy, PolicyGradient, ImportanceSampling, PPO, CISPO, DRO)
}


def make_objective(name: str, config: Mapping[str, Any] | None = None) -> Objective:
    """The objective registered as `name` with `config` (its fields, e.g. `clip_low`).

    Raises `ConfigError` naming the known objectives, or the fields a config may set."""
    cls = OBJECTIVES.get(name)
    if cls is None:
        raise ConfigError(f"unknown loss {name!r}; known: {', '.join(sorted(OBJECTIVES))}")
    allowed = {f.name for f in fields(cls)}
    unknown = sorted(set(config or {}) - allowed)
    if unknown:
        raise ConfigError(
            f"loss {name!r} has no option {', '.join(map(repr, unknown))}; "
            f"its options: {', '.join(sorted(allowed)) or 'none'}"
        )
    try:
        return cls(**dict(config or {}))
    except TypeError as e:
        raise ConfigError(f"loss {name!r}: {e}") from e
