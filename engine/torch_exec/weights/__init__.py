"""The model's weights, read in the driver and in every stage process: checkpoints (found, built or read) and the random-weight tokenizer; imports neither side."""
