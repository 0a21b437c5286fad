"""Triton kernels of the real engine, run in each stage process: paged attention, fused RMSNorm and rotary embedding."""
