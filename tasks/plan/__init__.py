"""Planning every training step for every rank: the multipack sampler (`planner`, on top of `packing`) and its
Prefect task (`stage`)."""
