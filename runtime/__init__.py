"""The pipeline runtime: stage processes exchanging activations and gradients over ZeroMQ.

Floors, bottom up; a module imports its own floor and those below, never one above
(tests/unit/test_import_rules.py):

- ``base``: what every process of a run shares: the run directory, the process environment and limits,
  prompt templates (and ``pretrained.py``: where a model's files are);
- ``wire``: frames, the authenticated transport, what each process accepts, the hand-off codec;
- ``stage``: one device's shard, LoRA, the executor of its program, the stage process, its state as data;
- ``run``: a run: the coordinator, launchers, data, checkpoints, reading a finished run;
- ``tools``: beside a run: the profiler, the evaluator, generate, export;
- ``torch_engine``: the same plan on torch.distributed.pipelining;
- ``cli.py``: `hetero run`, `hetero worker`, `hetero generate`: the entry points that pick an engine.

Nothing here imports the planner's solver, Hydra or the compiler.
"""
