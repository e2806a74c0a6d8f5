"""Parallel plans on torch.distributed (launched with torchrun): the process groups of a plan
(:mod:`.groups`) and the expert-parallel sharding of the routed experts (:mod:`.expert`)."""
