"""`hetero run plan.json --engine torch`: the same plan on PyTorch's own torch.distributed.pipelining.

hetero's ZeroMQ runtime exists for what no standard engine does (mixed vendors, drivers and torch versions
over a home LAN). A fleet of identical cards with one torch outgrows it: this engine runs the plan's stages
as ``PipelineStage``s under ``Schedule1F1B`` / ``ScheduleGPipe``, launched by torch's elastic launcher
(as torchrun does, one per host), with gloo on CPU and NCCL on CUDA, and the plan's replicas as the
data-parallel dimension of a 2-D DeviceMesh. The layers, LoRA, quantization and recomputation are hetero's own (stage/model.py), and
so are the data, loss, clipping, AdamW, LR schedule, metrics.jsonl, checkpoints and adapter: a run trains to
the same numbers on either engine, and a checkpoint of one resumes on the other.

  support.py  what this engine cannot run, refused in one line before anything starts (torch-free)
  launch.py   the launcher side: one torch launcher per host (ssh or a printed command), the network, failures
  rank.py     one process: its stage as a PipelineStage, the schedule, the optimizer step, the records
  transfer.py what ranks exchange besides activations: batches, settings, stage state as safetensors bytes
"""
