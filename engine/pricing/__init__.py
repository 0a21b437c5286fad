"""What a micro-batch costs: the roofline cost model, its fitted terms, GPU and model tables, profile tables."""
