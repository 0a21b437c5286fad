"""Triton kernels of the real engine: paged attention, fused RMSNorm and rotary embedding."""
