"""Policy-gradient losses as pure functions over tensors.

Shapes are named by suffix: `_B` rows (sequences), `_T` token positions, `_V` vocabulary.
Nothing here holds state or reads a config; callers pass plain values.

How normalisation composes (the invariant the trainer relies on): a tenant's loss is
`sum_{b,t} w_BT[b, t] * l_BT[b, t]`, where `l_BT` is the per-token surrogate and `w_BT`
comes from `token_weights` computed once over that tenant's *whole* step batch. Because
the loss is a plain weighted sum, any split of the rows into micro-batches, and any mix
of several tenants' rows in one micro-batch, gives exactly the full-batch loss and
gradient when the caller passes each row's slice of `w_BT` and sums the results. To get
one tenant's loss and metrics out of a mixed micro-batch, call `policy_loss` on that
tenant's rows (row slicing is cheap; every op here is per token).

Metrics are detached 0-dim tensors (no device sync). Means are over the valid tokens of
the rows passed in; `tokens` is that count, so micro-batch metrics combine by a
token-weighted mean (`ratio_min`/`ratio_max` by min/max, skipping empty ones).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

from marlaas.errors import ConfigError
from marlaas.model import kernels

LossNorm = Literal["token", "sequence", "constant"]
KLEstimator = Literal["k1", "k3"]


def token_weights(
    mask_BT: Tensor, loss_norm: LossNorm, *, constant_norm_tokens: float | None = None
) -> Tensor:
    """The weight each valid token carries in one tenant's loss; zero on masked tokens.

    Pass the mask of the tenant's whole step batch (all its micro-batches), then slice
    rows. Returns float32 `[B, T]`.

    - `"token"`: `1 / N` with `N` the number of valid tokens in the batch, the
      token-level loss of the DAPO objective (Yu et al. 2025, sec. 3.3): every token
      weighs the same, so long answers weigh more.
    - `"sequence"`: `1 / (|o_b| * B')`, the per-sequence mean then the mean over
      sequences of the original GRPO objective (Shao et al. 2024, eq. 3). `B'` counts
      the rows with at least one valid token: an empty row (padding, or a trajectory
      whose tokens are all observations) adds nothing and does not dilute the rest.
    - `"constant"`: `1 / constant_norm_tokens` (Dr. GRPO, Liu et al. 2025, Fig. 1: the
      `1/|o_i|` term is dropped; their code divides by the generation budget, i.e.
      pass rows x max new tokens). The weights
      then do not depend on the lengths sampled at all. Required in this mode and
      ignored in the others.

    A batch with no valid token gets all-zero weights (a zero loss, not NaN).
    """
    if mask_BT.dim() != 2:
        raise ConfigError(f"mask must have shape [B, T], got {tuple(mask_BT.shape)}")
    valid_BT = (mask_BT != 0).to(torch.float32)
    if loss_norm == "token":
        return valid_BT / valid_BT.sum().clamp_min(1.0)
    if loss_norm == "sequence":
        lengths_B = valid_BT.sum(dim=1, keepdim=True)
        rows = (lengths_B > 0).sum().clamp_min(1)
        return valid_BT / (lengths_B.clamp_min(1.0) * rows)
    if loss_norm == "constant":
        if constant_norm_tokens is None or not constant_norm_tokens > 0:
            raise ConfigError(
                "loss_norm='constant' needs constant_norm_tokens > 0 (Dr. GRPO: rows x "
                f"max new tokens), got {constant_norm_tokens!r}"
            )
        return valid_BT / float(constant_norm_tokens)
    raise ConfigError(f"loss_norm must be 'token', 'sequence' or 'constant', got {loss_norm!r}")


def policy_loss(
    logprobs_BT: Tensor,
    behaviour_logprobs_BT: Tensor,
    advantages: Tensor,
    mask_BT: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    tis_cap: float | None = None,
    loss_norm: LossNorm | None = None,
    constant_norm_tokens: float | None = None,
    weights_BT: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate against the behaviour policy, reduced with token weights.

    Per valid token, with `r = exp(logprobs - behaviour_logprobs) = pi_theta / mu` and the
    token's advantage `A` (`advantages` is `[B]`, one per row as in GRPO, or `[B, T]`, one
    per token) (Schulman et al. 2017, eq. 7, with the decoupled clip range of
    DAPO's clip-higher, Yu et al. 2025, sec. 3.1):

        l = -min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)

    `mu` is the policy that actually sampled the token (log-probs recorded by the rollout
    engine, whatever adapter version and kernels it used), so `r` is the exact
    importance ratio for asynchronous, stale data and the trust region is centred on it.
    Where the clipped branch is selected the token has zero gradient.

    Truncated importance sampling (`tis_cap = C`): an unclipped token's gradient is
    `-r * A * grad(log pi)`, and `r` is unbounded when `A < 0` (the upper clip only acts
    on `A > 0`). With `C` set, each token's `l` is multiplied by the detached factor
    `min(1, C / r)`, so what is capped is the importance weight `r` itself: the token's
    value and gradient carry `min(r, C)` in place of `r` (Ionides 2008; the TIS
    correction of Yao et al. 2025 with their proximal policy taken as the current one,
    which is exact for one update per batch). Clipped tokens keep a zero gradient.

    Reduction: `loss = sum(w * l)` over valid tokens. `weights_BT` (from `token_weights`
    over the tenant's whole step batch, then sliced to these rows) makes per-micro-batch
    losses add up to the full-batch loss; without it, the weights are computed here from
    `mask_BT` with `loss_norm` (default `"token"`), i.e. these rows are the whole batch.
    Pass one or the other. Masked tokens (prompt, tool output, padding) get exactly
    zero gradient even if their log-probs are not finite.

    Metrics (detached, over valid tokens): `clip_frac` (tokens on the clipped branch),
    `clip_frac_low` (`A < 0`, `r < 1 - clip_low`), `clip_frac_high` (`A > 0`,
    `r > 1 + clip_high`), `ratio_mean`, `ratio_min`, `ratio_max`, `tis_frac` (tokens
    with `r > C`), `kl_behaviour` (k3 estimate of KL(mu || pi_theta)) and `tokens`.
    """
    if not 0.0 <= clip_low < 1.0 or clip_high < 0.0:
        raise ConfigError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if tis_cap is not None and not tis_cap > 0:
        raise ConfigError(f"tis_cap must be > 0 or None, got {tis_cap}")
    _check_shapes(logprobs_BT, behaviour_logprobs_BT=behaviour_logprobs_BT, mask_BT=mask_BT)
    if advantages.shape not in (logprobs_BT.shape[:1], logprobs_BT.shape):
        raise ConfigError(
            f"advantages must have shape [B] = {tuple(logprobs_BT.shape[:1])} or [B, T] = "
            f"{tuple(logprobs_BT.shape)}, got {tuple(advantages.shape)}"
        )
    if weights_BT is None:
        weights_BT = token_weights(
            mask_BT, loss_norm or "token", constant_norm_tokens=constant_norm_tokens
        )
    elif loss_norm is not None or constant_norm_tokens is not None:
        raise ConfigError("pass either weights_BT or loss_norm/constant_norm_tokens, not both")
    else:
        _check_shapes(logprobs_BT, weights_BT=weights_BT)

    valid_BT = mask_BT != 0
    t = surrogate(
        logprobs_BT, behaviour_logprobs_BT, advantages, valid_BT, weights_BT,
        clip_low=clip_low, clip_high=clip_high, tis_cap=tis_cap,
    )  # fmt: skip
    log_ratio_BT, ratio_BT = t.log_ratio_BT, t.ratio_BT
    loss = t.weighted_BT.sum()

    with torch.no_grad():
        # Masked reductions, not boolean indexing: no data-dependent shapes, no sync.
        tokens = valid_BT.sum()
        n = tokens.clamp_min(1).to(ratio_BT.dtype)
        low_BT, high_BT = t.low_BT, t.high_BT
        inf = torch.full_like(ratio_BT, torch.inf)
        one = ratio_BT.new_ones(())
        metrics = {
            "clip_frac": (low_BT | high_BT).sum() / n,
            "clip_frac_low": low_BT.sum() / n,
            "clip_frac_high": high_BT.sum() / n,
            "ratio_mean": torch.where(valid_BT, ratio_BT, 0.0).sum() / n,
            "ratio_min": torch.where(tokens > 0, torch.where(valid_BT, ratio_BT, inf).amin(), one),
            "ratio_max": torch.where(tokens > 0, torch.where(valid_BT, ratio_BT, -inf).amax(), one),
            "tis_frac": (valid_BT & (ratio_BT > tis_cap)).sum() / n
            if tis_cap is not None
            else n.new_zeros(()),
            # k3 is exactly 0 where the log-ratio was zeroed, so this sum is masked.
            "kl_behaviour": (torch.expm1(log_ratio_BT) - log_ratio_BT).sum() / n,
            "tokens": tokens,
        }
    return loss, metrics


class Surrogate(NamedTuple):
    """The per-token terms of the clipped surrogate (`surrogate`): the masked log-ratio
    and ratio, the weighted loss `w * l` (with gradient; zero where masked), and which
    valid tokens sit on the lower and the upper clip (detached)."""

    log_ratio_BT: Tensor
    ratio_BT: Tensor
    weighted_BT: Tensor
    low_BT: Tensor
    high_BT: Tensor


def surrogate(
    logprobs_BT: Tensor,
    behaviour_logprobs_BT: Tensor,
    advantages: Tensor,
    valid_BT: Tensor,
    weights_BT: Tensor,
    *,
    clip_low: float | Tensor,
    clip_high: float | Tensor,
    tis_cap: float | Tensor | None = None,
) -> Surrogate:
    """The per-token terms of `policy_loss` (see it for the maths), unreduced. The clip
    range and the TIS cap are numbers, or `[B, 1]` tensors (one per row: rows of several
    tenants with their own settings in one set of ops; a row without a cap holds `inf`).
    `advantages` is `[B]` or `[B, T]`."""
    # Masked positions get log-ratio 0 before the exp, so a garbage log-prob there can
    # neither overflow nor leak a NaN into the gradient through 0 * inf.
    log_ratio_BT = torch.where(
        valid_BT, logprobs_BT - behaviour_logprobs_BT, torch.zeros_like(logprobs_BT)
    )
    ratio_BT = torch.exp(log_ratio_BT)
    adv_BT = advantages.to(ratio_BT.dtype)
    adv_BT = adv_BT.unsqueeze(1) if adv_BT.dim() == 1 else adv_BT
    unclipped_BT = ratio_BT * adv_BT
    # Numbers and per-row settings alike, rounded to the ratio's dtype once.
    low = _setting(1.0 - clip_low, ratio_BT)
    high = _setting(1.0 + clip_high, ratio_BT)
    clipped_BT = torch.clamp(ratio_BT, low, high) * adv_BT
    loss_BT = -torch.minimum(unclipped_BT, clipped_BT)
    if tis_cap is not None:
        # A number as it is (torch divides a number by a tensor its own way).
        cap = _setting(tis_cap, ratio_BT) if isinstance(tis_cap, Tensor) else tis_cap
        capped_BT = (cap / ratio_BT.detach()).clamp(max=1.0)
        if isinstance(cap, Tensor):  # a row without a cap (inf): a factor of exactly 1
            capped_BT = torch.where(torch.isinf(cap), 1.0, capped_BT)
        loss_BT = loss_BT * capped_BT
    w_BT = torch.where(valid_BT, weights_BT.to(loss_BT.dtype), torch.zeros_like(loss_BT))
    with torch.no_grad():
        low_BT = valid_BT & (adv_BT < 0) & (ratio_BT < low)
        high_BT = valid_BT & (adv_BT > 0) & (ratio_BT > high)
    return Surrogate(log_ratio_BT, ratio_BT, w_BT * loss_BT, low_BT, high_BT)


def _setting(value: float | Tensor, like: Tensor) -> Tensor:
    """A setting (a number, or one per row) as a tensor of `like`'s dtype, rounded as
    torch rounds a number it meets in an op on `like`."""
    return torch.as_tensor(value, dtype=torch.float64).to(like)


def kl_penalty(
    logprobs_BT: Tensor,
    ref_logprobs_BT: Tensor,
    estimator: KLEstimator = "k3",
    *,
    mask_BT: Tensor | None = None,
) -> Tensor:
    """Per-token estimates of KL(pi_theta || pi_ref) at the sampled tokens, `[B, T]`.

    Schulman 2020, "Approximating KL divergence", with `r = pi_ref / pi_theta`:
    `k1 = -log r = log pi_theta - log pi_ref` (unbiased, can be negative) and
    `k3 = (r - 1) - log r` (unbiased, always >= 0, lower variance; the estimator of the
    GRPO objective, Shao et al. 2024, eq. 4). Reduce with the same `token_weights` as
    the policy loss: `kl_coef * sum(w * kl_BT)`. With `mask_BT`, masked positions are
    exactly zero with zero gradient, whatever their log-probs.
    """
    _check_shapes(logprobs_BT, ref_logprobs_BT=ref_logprobs_BT)
    log_ratio_BT = ref_logprobs_BT - logprobs_BT  # log r
    if mask_BT is not None:
        _check_shapes(logprobs_BT, mask_BT=mask_BT)
        log_ratio_BT = torch.where(mask_BT != 0, log_ratio_BT, torch.zeros_like(log_ratio_BT))
    if estimator == "k1":
        return -log_ratio_BT
    if estimator == "k3":
        return torch.expm1(log_ratio_BT) - log_ratio_BT
    raise ConfigError(f"kl estimator must be 'k1' or 'k3', got {estimator!r}")


def entropy_from_logits(logits_BTV: Tensor) -> Tensor:
    """Entropy of the next-token distribution at each position, `[B, T]`.

    `H = -sum_v p_v log p_v` with `log p = log_softmax(logits)` computed in at least
    float32 (half-precision logits are upcast inside the op; float64 stays float64; the
    max-shifted log-sum-exp inside `log_softmax` keeps it stable for any logit scale).
    Logits of `-inf` (banned tokens) contribute exactly 0 and a finite gradient.
    """
    dtype = torch.promote_types(logits_BTV.dtype, torch.float32)
    if not logits_BTV.requires_grad:  # a metric's: one native pass where it applies
        flat = kernels.entropy_rows(logits_BTV.reshape(-1, logits_BTV.shape[-1]))
        if flat is not None:
            return flat.view(logits_BTV.shape[:-1])
    logp_BTV = torch.log_softmax(logits_BTV, dim=-1, dtype=dtype)
    # p * log p at p == 0 is 0 * -inf; clamping log p to the lowest finite float turns it
    # into 0 * finite, and the clamp passes no gradient to those entries.
    safe_BTV = logp_BTV.clamp_min(torch.finfo(dtype).min)
    return -(logp_BTV.exp() * safe_BTV).sum(dim=-1)


def token_logprobs(logits_BTV: Tensor, target_ids_BT: Tensor, temperature: float = 1.0) -> Tensor:
    """`log_softmax(logits / temperature)[target]` at each position, `[B, T]`.

    The same quantity the rollout engine records as behaviour log-probs (see
    `SamplingParams`), so importance ratios are exact. Computed as
    `z[target] - logsumexp(z)`: the full `[B, T, V]` log-softmax is never built; the only
    vocabulary-sized temporaries are the float32 upcast and the temperature division
    (each skipped when not needed) and what `logsumexp` saves for the backward pass.
    Half-precision logits are upcast to float32 (float64 stays float64).
    `logits_BTV[b, t]` must be the logits that predict `target_ids_BT[b, t]` (shift the
    model's outputs by one before calling).
    """
    if not temperature > 0:
        raise ConfigError(f"temperature must be > 0 (use 1.0 for greedy), got {temperature}")
    if logits_BTV.dim() != 3 or target_ids_BT.shape != logits_BTV.shape[:2]:
        raise ConfigError(
            f"need logits [B, T, V] and targets [B, T], got {tuple(logits_BTV.shape)} and "
            f"{tuple(target_ids_BT.shape)}"
        )
    z_BTV = logits_BTV.to(torch.promote_types(logits_BTV.dtype, torch.float32))
    if temperature != 1.0:
        # In place only on our own upcast copy, never on the caller's tensor.
        z_BTV = z_BTV.div_(temperature) if z_BTV is not logits_BTV else z_BTV / temperature
    target_BT = torch.gather(z_BTV, -1, target_ids_BT.long().unsqueeze(-1)).squeeze(-1)
    return target_BT - torch.logsumexp(z_BTV, dim=-1)


def _check_shapes(reference_BT: Tensor, **others: Tensor) -> None:
    if reference_BT.dim() != 2:
        raise ConfigError(f"logprobs must have shape [B, T], got {tuple(reference_BT.shape)}")
    for name, tensor in others.items():
        if tensor.shape != reference_BT.shape:
            raise ConfigError(
                f"{name} must have the shape of logprobs {tuple(reference_BT.shape)}, "
                f"got {tuple(tensor.shape)}"
            )
