"""Launching distributed training: the processes torchrun or mpirun started (or a group the
program initialized), the topology the TrainingParameters ask of them, the default process
group (gloo on CPU, NCCL on CUDA) and each process's GPU."""

from __future__ import annotations

import atexit
import datetime
import os
import sys
from dataclasses import dataclass

from ...errors import DistributedError, InvalidArgumentError

TIMEOUT_ENV = "GRADBUILDER_DISTRIBUTED_TIMEOUT"
_LAUNCHERS = (("RANK", "WORLD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"))
_LOCAL_RANK = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")


def timeout_seconds() -> float:
    raw = os.environ.get(TIMEOUT_ENV, "300")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise InvalidArgumentError(f"{TIMEOUT_ENV}={raw!r}: give the collectives' timeout in seconds (> 0)")
    return value


def launched() -> tuple[int, int] | None:
    """(rank, world size) of the processes this one was launched with: the initialized
    torch.distributed group, or the environment torchrun (RANK, WORLD_SIZE) or mpirun
    (OMPI_COMM_WORLD_*, PMI_*) set; None for a process started alone."""
    dist = sys.modules.get("torch.distributed")  # a group the program initialized imported it
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    for rank, size in _LAUNCHERS:
        if rank in os.environ and size in os.environ:
            try:
                return int(os.environ[rank]), int(os.environ[size])
            except ValueError:
                raise InvalidArgumentError(f"{rank}={os.environ[rank]!r}, {size}={os.environ[size]!r}: the launcher's "
                                           "rank and world size must be integers") from None
    return None


@dataclass(frozen=True)
class Topology:
    """Where this process sits: ``world`` = ``stages`` x ``replicas`` processes; rank
    ``stage * replicas + replica``. The replicas of one stage average their gradients (data
    parallel); the stages of one replica pass activations along the pipeline."""

    rank: int
    world: int
    stages: int = 1
    replicas: int = 1

    @property
    def stage(self) -> int:
        return self.rank // self.replicas

    @property
    def replica(self) -> int:
        return self.rank % self.replicas

    def stage_ranks(self, stage: int) -> list[int]:
        """The data-parallel group of ``stage``."""
        return [stage * self.replicas + r for r in range(self.replicas)]

    def pipeline_ranks(self, replica: int) -> list[int]:
        """The stages of ``replica``, first to last."""
        return [s * self.replicas + replica for s in range(self.stages)]


def topology(params) -> Topology | None:
    """The topology ``params`` ask for in the launched group, checked; None when training runs
    in one process. world_size and world_rank default to the launched group's, data_parallel_size
    to what the pipeline leaves."""
    group = launched()
    world = params.world_size
    if group is None:
        if world > 1:
            raise InvalidArgumentError(
                f"TrainingParameters.world_size={world}, but this process was not launched as one of {world}: start "
                f"it with `torchrun --nproc-per-node {world} SCRIPT` (or mpirun -n {world}), or leave world_size at 1")
        if params.data_parallel_size > 1 or params.pipeline_parallel_size > 1:
            raise InvalidArgumentError(
                "TrainingParameters asks for distributed training (data_parallel_size or pipeline_parallel_size > 1), "
                "but this process was started alone: launch it with `torchrun --nproc-per-node N SCRIPT`")
        return None  # deepspeed_zero_stage in one process: nothing to partition
    rank, size = group
    if world not in (1, size):
        raise InvalidArgumentError(f"TrainingParameters.world_size={world} but the launched group has {size} "
                                   "processes; leave world_size at its default or launch that many")
    if params.world_rank not in (0, rank):
        raise InvalidArgumentError(f"TrainingParameters.world_rank={params.world_rank} but this process is rank "
                                   f"{rank} of the launched group; leave world_rank at its default")
    if size == 1:
        return None
    stages = params.pipeline_parallel_size
    replicas = params.data_parallel_size if params.data_parallel_size > 1 else size // stages
    if stages * replicas != size or params.horizontal_parallel_size != 1:
        raise InvalidArgumentError(
            f"TrainingParameters: pipeline_parallel_size={stages} x data_parallel_size={replicas} must equal the "
            f"{size} launched processes")
    return Topology(rank, size, stages, replicas)


def init_process_group(device: tuple[str, int]) -> None:
    """Initialize torch.distributed's default group from the launcher's environment, unless
    the program did: gloo for CPU, NCCL for CUDA."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    rank, size = launched()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    backend = "nccl" if device[0] == "cuda" and dist.is_nccl_available() else "gloo"
    if device[0] == "cuda":
        import torch

        torch.cuda.set_device(device[1])
    timeout = datetime.timedelta(seconds=timeout_seconds())
    try:
        dist.init_process_group(backend, rank=rank, world_size=size, timeout=timeout, store=_store(rank, size, timeout))
    except Exception as exc:  # noqa: BLE001 - torch raises several kinds
        raise DistributedError(f"rank {rank}: torch.distributed.init_process_group({backend!r}) failed at "
                               f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}: {exc}") from exc
    atexit.register(_destroy)  # a group left to the interpreter's exit can abort it (gloo's threads)


def _store(rank: int, size: int, timeout):
    """Under torch's launcher (torchrun), the rendezvous store of this attempt: torchrun keeps one
    store across the restarts of a group (``--max-restarts``), and gloo's connections read the
    ranks' addresses from it, those of the processes of the attempt before included (a restarted
    group then tries to connect to a dead process); each attempt's keys get a prefix of their
    own. None elsewhere: ``init_process_group`` makes its store from the environment."""
    import torch.distributed as dist

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return None
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # the launcher's agent hosts it
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size,
                          is_master=not agent and rank == 0, timeout=timeout)
    return dist.PrefixStore(f"gradbuilder/attempt_{attempt}", store)


def _destroy() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass


def local_rank() -> int:
    """This process's index on its machine (torchrun's LOCAL_RANK, mpirun's local rank), 0 if unknown."""
    for key in _LOCAL_RANK:
        if key in os.environ:
            return int(os.environ[key])
    return 0


def one_device_per_process(providers: list[str], options: list[dict]) -> list[dict]:
    """The provider options with CUDA on this process's own GPU (its local rank, modulo the
    GPUs there are) where the caller did not choose a ``device_id``: NCCL needs one GPU per
    process, and CUDA's default is the first for all."""
    from ..providers import CUDA

    out = [dict(o) for o in options]
    for name, o in zip(providers, out):
        if name == CUDA and "device_id" not in o:
            import torch

            count = torch.cuda.device_count() if torch.cuda.is_available() else 1
            o["device_id"] = str(local_rank() % max(count, 1))
    return out


