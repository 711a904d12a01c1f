"""The records of the trainer's calls, which the device port passes through
(`marlaas.device.port`): a tenant's input to a training pass, its output, and the result
of its optimizer step.

`Datum` (one row of data) lives in `marlaas.types` with the other stage records; the
objectives a `TrainInput` names live in `marlaas.train.objectives`; `AdamParams` and
`TenantSnapshot` in `marlaas.train.optim`. Records are frozen and plain, so they pickle
across processes and Ray.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from marlaas.errors import ConfigError
from marlaas.train.batch import TrainBatchError
from marlaas.train.objectives import Objective
from marlaas.train.rows import Rows, tensorise_data
from marlaas.types import Datum


@dataclass(frozen=True)
class TrainInput:
    """One tenant's part of a `forward_backward` or `forward` call.

    `loss` is the objective its data are scored with; log-probs are
    `log_softmax(logits / temperature)` (the sampling temperature of RL data; 1.0 for
    supervised data). `version`, when given, is the adapter version the data are for:
    the call is refused (`TrainBatchError`) if the tenant is at another version when it
    runs. `return_logprobs` asks for every position's log-prob in the output.
    """

    tenant: str
    data: tuple[Datum, ...]
    loss: Objective
    temperature: float = 1.0
    version: int | None = None
    return_logprobs: bool = False
    #: The data as the trainer's tensors (`tensorise_data`: whole rows where every
    #: log-prob is wanted), made with the input: where it is made (a tenant's
    #: coroutine, on the event loop), not in the device's pass, which concatenates them.
    rows: Rows = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.data:
            raise TrainBatchError(self.tenant, "a train input needs at least one datum")
        if not self.temperature > 0:
            raise TrainBatchError(
                self.tenant, f"temperature must be > 0 (use 1.0 for greedy), got {self.temperature}"
            )
        needs = self.loss.inputs
        for i, d in enumerate(self.data):
            missing = [
                name
                for name, given in (
                    ("sampling_logprobs", d.sampling_logprobs_T),
                    ("advantages", d.advantages_T),
                )
                if name in needs and not given
            ]
            if missing:
                raise TrainBatchError(
                    self.tenant,
                    f"datum {i}: loss {self.loss.name!r} needs {' and '.join(missing)} "
                    "for every position",
                )
        object.__setattr__(self, "rows", tensorise_data([self.data], [self.return_logprobs]))


@dataclass(frozen=True)
class TrainOutput:
    """What one `forward_backward` or `forward` call did for one tenant.

    `version` is the adapter version the pass ran at. `sums` are the objective's
    per-token sums over the tenant's data (`loss`, `tokens`, ...; they add up across
    calls: divide by `tokens` for means), `rows` the number of its data. `logprobs`, when
    asked for, holds per datum the log-prob of every target (0.0 where not computed:
    never on a weighted position).
    """

    tenant: str
    version: int
    sums: Mapping[str, float]
    rows: int
    logprobs: tuple[tuple[float, ...], ...] | None = None

    @property
    def loss(self) -> float:
        return float(self.sums["loss"])

    @property
    def tokens(self) -> int:
        return round(self.sums["tokens"])


@dataclass(frozen=True)
class OptimResult:
    """One `optim_step` of one tenant: the new adapter `version` (published to the
    sampler before this result is delivered), the gradient norm before clipping and the
    learning rate used."""

    tenant: str
    version: int
    grad_norm: float
    lr: float


def tenants_of(inputs: Sequence[TrainInput]) -> list[str]:
    """The tenants of a call, in order; `ConfigError` for a tenant given twice (one
    input per tenant per call) or a call without inputs."""
    if not inputs:
        raise ConfigError("a training call needs at least one tenant's input")
    names = [i.tenant for i in inputs]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ConfigError(f"one train input per tenant per call; repeated: {', '.join(dup)}")
    return names
