"""A stage's step: its model shard, weights, LoRA, the executor of its program, and the stage process."""
