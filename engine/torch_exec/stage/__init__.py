"""A pipeline stage's side, run in each stage process (and its CPU samplers): the worker loop, the model slice, links, sampling; never imports the driver's side."""
