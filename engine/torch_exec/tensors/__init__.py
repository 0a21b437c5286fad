"""A micro-batch as the arrays and tensors a stage process builds: what the model, its kernels and graphs read."""
