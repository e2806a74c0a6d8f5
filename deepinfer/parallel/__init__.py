"""Parallel plans on torch.distributed (launched with torchrun): the process groups of a plan
(:mod:`.groups`), the expert-parallel sharding of the routed experts (:mod:`.expert`) with EPLB's
policy (:mod:`.eplb`), and the attention data-parallel spread of the requests (:mod:`.data`)."""
