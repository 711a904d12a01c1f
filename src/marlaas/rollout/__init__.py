"""The rollout stage: a continuous-batching, multi-LoRA generation engine.

`RolloutEngine.submit(request)` returns a future of the `Completion` (and, given
`on_token`, streams its tokens as they are sampled); rows of every tenant share each
decode iteration, each with its own adapter slot.
"""

from marlaas.errors import EngineClosed, InvalidRequest
from marlaas.rollout.core import EngineStats
from marlaas.rollout.engine import RolloutEngine

__all__ = ["EngineClosed", "EngineStats", "InvalidRequest", "RolloutEngine"]
