"""A micro-batch as the real engine's arrays and tensors: what the model, its kernels and graphs read."""
