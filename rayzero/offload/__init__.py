"""Offload of optimizer state out of accelerator memory: the NVMe swap store lives in ``swap_store``."""
