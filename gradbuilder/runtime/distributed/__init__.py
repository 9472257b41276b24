"""Distributed training on torch.distributed (gloo on CPU, NCCL on CUDA; the
``distributed`` extra), one module a concept:

- ``launch``: the processes torchrun or mpirun started, the topology TrainingParameters ask
  of them (world = pipeline stages x data-parallel replicas), the process group, each
  process's GPU;
- ``collectives``: torch.distributed's calls over one group, failures naming the rank;
- ``data_parallel``: data parallel and ZeRO 1/2 between a session's gradient and optimizer
  graphs;
- ``pipeline_parallel``: a pipeline stage's forward and backward graphs on a 1F1B schedule.

``DataParallel`` and ``PipelineParallel`` are executors (``runtime.executor.Executor``) over
the process's ``LocalExecutor``: ``executor.executor_for`` picks one when a session is one of
several launched processes; they reach the session's model, graphs and state only through the
shared ``executor.Parts`` record.
"""

from .launch import Topology, init_process_group, launched, local_rank, one_device_per_process, topology

__all__ = ["Topology", "init_process_group", "launched", "local_rank", "one_device_per_process", "topology"]
