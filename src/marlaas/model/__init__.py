"""The model stage: the frozen shared base, multi-LoRA layers, the adapter bank and
PEFT-format adapter I/O. The embedded default base lives in `marlaas/model/embedded`.
"""

from marlaas.model.bank import AdapterBank, AdapterHandle, BankStats
from marlaas.model.base import default_base_path, load_base
from marlaas.model.lane_layers import LaneBatch, MultiLoRALinear
from marlaas.model.lora import AdapterTensors, LoRAModel
from marlaas.model.peft_io import load_peft, save_peft

__all__ = [
    "AdapterBank",
    "AdapterHandle",
    "AdapterTensors",
    "BankStats",
    "LaneBatch",
    "LoRAModel",
    "MultiLoRALinear",
    "default_base_path",
    "load_base",
    "load_peft",
    "save_peft",
]
