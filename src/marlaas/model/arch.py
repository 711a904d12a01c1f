"""What marlaas can do with a base architecture: which layers LoRA adapts, the targets a
spec resolves to, and what is refused before any work starts.

- Adaptable layers are the base's `nn.Linear` and `Conv1D` (GPT-2 family) modules, but
  its output head: the same set as PEFT's `all-linear`. Fused MoE expert weights
  (Mixtral's and Qwen2-MoE's `experts.gate_up_proj` / `experts.down_proj`, 3-D
  parameters) are not layers; they stay frozen.
- `resolve_targets` is the one function that turns a spec's `target_modules` (leaf
  names, `"all-linear"` or None) into the leaf names of one base, in module order;
  every error names the option to change and lists what the base has.
- `layer_roles` says which leaf names are attention projections and which feed-forward
  ones, from where each layer sits (inside an attention module or not), for options
  that name a role rather than layers (Tinker's `train_attn` / `train_mlp`).
- `check_attention` refuses attention layers other than full and sliding-window ones
  (chunked, linear attention): the rollout engine and the trainer's shared-prefix cache
  handle those two, windows included (Mistral's `sliding_window`, Qwen2's
  `use_sliding_window`, Gemma2/3's `layer_types`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, Literal

from torch import nn
from transformers.pytorch_utils import Conv1D

from marlaas.config.specs import ALL_LINEAR, TargetModules
from marlaas.errors import ConfigError, ModelError

#: Module types a multi-LoRA layer can wrap (`Conv1D` holds its weight as `[in, out]`).
ADAPTABLE_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, Conv1D)


def layer_features(layer: nn.Module) -> tuple[int, int]:
    """`(in_features, out_features)` of an adaptable layer."""
    if isinstance(layer, nn.Linear):
        return layer.in_features, layer.out_features
    if isinstance(layer, Conv1D):
        fan_in, fan_out = layer.weight.shape
        return int(fan_in), int(fan_out)
    raise ModelError(f"{type(layer).__name__} is not a linear layer marlaas can adapt")


def adaptable_layers(base: nn.Module) -> dict[str, nn.Module]:
    """Module path -> layer, for every layer LoRA can adapt, in the base's module order."""
    head = output_head(base)
    return {
        name: module
        for name, module in base.named_modules()
        if isinstance(module, ADAPTABLE_TYPES) and module is not head
    }


def output_head(base: nn.Module) -> nn.Module | None:
    """The base's output head (`lm_head`), which LoRA leaves alone, as PEFT does."""
    get: Any = getattr(base, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if isinstance(head, nn.Module) else None


def leaf(path: str) -> str:
    return path.rsplit(".", 1)[-1]


def resolve_targets(
    requested: TargetModules,
    layers: Sequence[str],
    *,
    model_name: str,
    frozen: Mapping[str, str] | None = None,
    head: str | None = None,
    skipped: Collection[str] = (),
    option: str = "lora.target_modules",
) -> tuple[str, ...]:
    """The leaf names `requested` covers among the adaptable `layers` (module paths), in
    module order. None and `"all-linear"` cover every layer.

    `frozen` maps leaf names of the base's fused (non-layer) weights to one of their
    paths, and `head` is the output head's path: naming one is refused with a message
    saying why, as is one of `skipped`: adaptable leaf names left out of `layers` (not
    injected). Raises `ConfigError` naming `option`.
    """
    leaves = list(dict.fromkeys(leaf(p) for p in layers))
    if requested is None or requested == ALL_LINEAR:
        if not leaves:
            raise ConfigError(f"{model_name} has no linear layers LoRA can adapt")
        return tuple(leaves)
    unknown = [name for name in requested if name not in leaves]
    if unknown:
        reasons: list[str] = []
        for name in unknown:
            if frozen and name in frozen:
                reasons.append(
                    f"{name!r} is a fused expert weight ({frozen[name]}), a frozen "
                    "parameter rather than a linear layer; marlaas trains the attention "
                    "and shared/dense layers of MoE models only"
                )
            elif name in skipped:
                reasons.append(
                    f"{name!r} was not injected into this model (build it with that name in "
                    "LoRAModel's target_modules)"
                )
            elif head is not None and name == leaf(head):
                reasons.append(f"{name!r} is the output head, which LoRA does not adapt")
            else:
                reasons.append(f"{name!r} matches no linear layer")
        raise ConfigError(
            f"{option}: {'; '.join(reasons)}. {model_name}'s adaptable layers are "
            f"{leaves} (or give 'all-linear')"
        )
    wanted = set(requested)
    return tuple(name for name in leaves if name in wanted)


#: What a layer does in its block: an attention projection, or part of the feed-forward.
Role = Literal["attention", "mlp"]


def layer_roles(base: nn.Module, paths: Iterable[str]) -> dict[str, frozenset[Role]]:
    """Leaf name -> the roles of the layers at `paths` with that name, in path order.

    A layer is "attention" when one of its enclosing modules is an attention module (its
    class name says Attention or Attn: Llama's `self_attn`, GPT-2's `attn`, OPT's and
    Phi's attention), else "mlp": the rest of a block (Llama's `mlp`, OPT's `fc1`/`fc2`
    directly in the block, MoE routers and shared experts). A leaf name can have both
    (GPT-2's `c_proj` is the attention's and the MLP's output projection)."""
    roles: dict[str, set[Role]] = {}
    for path in paths:
        parts = path.split(".")
        role: Role = "mlp"
        for i in range(1, len(parts)):
            name = type(base.get_submodule(".".join(parts[:i]))).__name__.lower()
            if "attention" in name or "attn" in name:
                role = "attention"
                break
        roles.setdefault(parts[-1], set()).add(role)
    return {name: frozenset(r) for name, r in roles.items()}


def fused_weights(base: nn.Module) -> dict[str, str]:
    """Leaf name -> path of the base's parameters of three or more dimensions that
    belong to no adaptable layer (fused MoE experts), for error messages."""
    out: dict[str, str] = {}
    for path, param in base.named_parameters():
        if param.dim() >= 3:
            out.setdefault(leaf(path), path)
    return out


def context_length(config: Any) -> int | None:
    """The positions the base's text decoder takes (`max_position_embeddings` of its
    text config), or None when the config does not say."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    positions = getattr(text, "max_position_embeddings", None)
    return int(positions) if positions else None


#: Attention layer types the rollout engine's cache and the trainer's shared-prefix
#: cache handle (a sliding window is a mask over a full cache there).
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


def check_attention(config: Any) -> None:
    """Raise `ModelError` for attention layers other than full and sliding-window ones
    (chunked, linear attention), naming them and the config option."""
    text: Any = (
        config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    )
    unknown = sorted(set(getattr(text, "layer_types", None) or ()) - set(ATTENTION_LAYER_TYPES))
    if unknown:
        raise ModelError(
            f"{type(text).__name__} has {unknown} layers: marlaas's rollout engine and "
            "trainer support full and sliding-window attention only; use a model whose "
            f"config.json `layer_types` holds only {list(ATTENTION_LAYER_TYPES)}"
        )
