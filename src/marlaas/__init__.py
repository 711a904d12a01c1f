"""marlaas: multi-tenant asynchronous reinforcement learning as a service.

Many tenants fine-tune one shared, frozen base language model with RL from verifiable
rewards; each tenant owns a small LoRA adapter. See DESIGN.md for the architecture.
"""

__version__ = "0.1.0"
