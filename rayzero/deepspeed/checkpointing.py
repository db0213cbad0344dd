"""``deepspeed.checkpointing`` under rayzero: the activation checkpointing a model calls by hand
(``checkpoint(function, *args)``, ``configure(...)``), over :mod:`rayzero.activation_checkpointing`.  With an
``activation_checkpointing`` config section the engine also checkpoints the model's blocks itself
(docs/config.md#activation_checkpointing)."""

from rayzero.activation_checkpointing import checkpoint, configure, is_configured, non_reentrant_checkpoint, reset

__all__ = ["checkpoint", "configure", "is_configured", "non_reentrant_checkpoint", "reset"]
