"""CUDA graphs, captured and replayed in each stage process: whole decode steps and piecewise mixed steps."""
