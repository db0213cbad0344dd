"""Tensor parallelism: TP regions and AutoTP (sharding a model's linears by its tp_plan)."""

from rayzero.tp.auto_tp import apply_auto_tp  # noqa: F401

__all__ = ["apply_auto_tp"]
