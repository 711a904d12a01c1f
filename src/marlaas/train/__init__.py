"""Training: losses as pure functions over tensors, the multi-lane trainer, the
multi-tenant optimizer.

The loss functions never hold state or read configs; the trainer passes the few plain
values of a tenant's `GRPOSpec` they need.
"""

from marlaas.train.advantages import group_advantages
from marlaas.train.losses import (
    KLEstimator,
    LossNorm,
    entropy_from_logits,
    kl_penalty,
    policy_loss,
    token_logprobs,
    token_weights,
)

__all__ = [
    "KLEstimator",
    "LossNorm",
    "entropy_from_logits",
    "group_advantages",
    "kl_penalty",
    "policy_loss",
    "token_logprobs",
    "token_weights",
]
