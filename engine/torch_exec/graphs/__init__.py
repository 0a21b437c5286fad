"""CUDA graphs of the real engine: whole decode steps and piecewise mixed steps."""
