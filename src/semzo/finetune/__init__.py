"""Zeroth-order (MeZO-family) fine-tuning: counter-based z, fused CPU/GPU kernels."""
