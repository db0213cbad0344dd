"""Mixture-of-experts: token dispatch over the expert-parallel group, the MoE layer, and AutoEP."""

from rayzero.moe.layer import MoE, MoEExperts, SharedExperts, drop_over_capacity, moe_aux_loss

__all__ = ["MoE", "MoEExperts", "SharedExperts", "drop_over_capacity", "moe_aux_loss"]
