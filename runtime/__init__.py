"""The pipeline runtime: stage processes exchanging activations and gradients over ZeroMQ.

`stage` builds one device's shard (weights, NF4, LoRA), `executor` runs its schedule program,
`worker` is the stage process, `coordinator` drives a run (`hetero run`), `checkpoint` saves and
restores stage state, `generate` samples with a trained adapter. Nothing here imports the planner's
solver, Hydra or the compiler.
"""
