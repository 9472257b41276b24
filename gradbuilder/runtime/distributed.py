"""Distributed training on torch.distributed (gloo on CPU, NCCL on CUDA): data parallel and
ZeRO stages 1 and 2 (``DataParallel``); the pipeline's stages (``runtime.pipeline``) share the
process group, the topology and the collectives defined here.

Processes are started by ``torchrun`` or ``mpirun``; a session initializes the default process
group from their environment when the program has not (``init_process_group``). The graphs
hold no collective op: between the gradient graph and the optimizer graph the gradients are
averaged with all-reduce on DLPack views of the OrtValues, in flat buckets, on the device
they live on.

Every collective runs under a timeout (``GRADBUILDER_DISTRIBUTED_TIMEOUT`` seconds, default
300). A process that dies or raises makes the others raise ``DistributedError`` naming it:
each process leaves its pid and host in the group's store at start and its error there when
it raises, and a failed collective reads them back.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from ..errors import DistributedError, InvalidArgumentError

TIMEOUT_ENV = "GRADBUILDER_DISTRIBUTED_TIMEOUT"
BUCKET_BYTES = 25 * 1024 * 1024  # gradients reduced per flat bucket (DDP's default size)
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
    try:
        dist.init_process_group(backend, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=timeout_seconds()))
    except Exception as exc:  # noqa: BLE001 - torch raises several kinds
        raise DistributedError(f"rank {rank}: torch.distributed.init_process_group({backend!r}) failed at "
                               f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}: {exc}") from exc
    atexit.register(_destroy)  # a group left to the interpreter's exit can abort it (gloo's threads)


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
    from .providers import CUDA

    out = [dict(o) for o in options]
    for name, o in zip(providers, out):
        if name == CUDA and "device_id" not in o:
            import torch

            count = torch.cuda.device_count() if torch.cuda.is_available() else 1
            o["device_id"] = str(local_rank() % max(count, 1))
    return out


class Collectives:
    """torch.distributed calls over one group, each failure turned into a DistributedError
    that names the process that died or raised."""

    def __init__(self, topo: Topology, ranks: Sequence[int] | None = None, group=None):
        """Over ``ranks`` (default: every rank), whose process group is ``group`` (made by
        :func:`subgroups`; None: the default group)."""
        import torch.distributed as dist

        self.dist = dist
        self.topo = topo
        self.ranks = list(ranks) if ranks is not None else list(range(topo.world))
        self.size = len(self.ranks)
        self.group = group
        self._store = _store()
        self.seconds = 0.0  # spent in this group's collectives (waiting for the others included)

    # -- who failed
    def announce(self) -> None:
        """Leave this process's host and pid in the store, and from now on its uncaught
        exception, for the others' failure messages."""
        self._set(f"gradbuilder/pid/{self.topo.rank}", f"{socket.gethostname()}:{os.getpid()}")
        previous = sys.excepthook

        def hook(kind, exc, tb):
            if not isinstance(exc, DistributedError):  # (that one names another rank's failure)
                self.raised(exc)
            previous(kind, exc, tb)

        sys.excepthook = hook

    def raised(self, exc: BaseException) -> None:
        """Leave this process's error in the store before it propagates."""
        self._set(f"gradbuilder/error/{self.topo.rank}", f"{type(exc).__name__}: {exc}"[:500])

    def _set(self, key: str, value: str) -> None:
        if self._store is not None:
            try:
                self._store.set(key, value)
            except Exception:  # noqa: BLE001 - the store is gone with rank 0: nothing to leave
                pass

    def failure(self, what: str, exc: BaseException) -> DistributedError:
        me = self.topo.rank
        others = [r for r in range(self.topo.world) if r != me]
        said: list[str] = []
        for _ in range(20):  # a failing rank may still be on its way out: look again for 2 s
            said = self._who(others)
            if said:
                break
            time.sleep(0.1)
        cause = "; ".join(said) if said else "a rank died, raised or did not answer in time"
        return DistributedError(f"rank {me}: {what} failed: {cause} ({type(exc).__name__}: {str(exc)[:300]}); "
                                f"timeout {timeout_seconds():g} s ({TIMEOUT_ENV})")

    def _who(self, others: list[int]) -> list[str]:
        """What the store says of the other ranks: who raised what, who has died."""
        if self._store is None:
            return ["the group's store is unreachable"]
        said, dead = [], []
        for r in others:
            try:
                if self._store.check([f"gradbuilder/error/{r}"]):
                    said.append(f"rank {r} raised {self._store.get(f'gradbuilder/error/{r}').decode()}")
                elif self._store.check([f"gradbuilder/pid/{r}"]) and _gone(self._store.get(f"gradbuilder/pid/{r}").decode()):
                    dead.append(r)
            except Exception:  # noqa: BLE001 - rank 0 holds the store: it is gone
                return ["rank 0 (which holds the group's store) is gone"]
        if dead:
            said.append(f"rank {', '.join(map(str, dead))} died")
        return said

    def _call(self, what: str, fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - gloo and NCCL raise several kinds
            raise self.failure(what, exc) from exc
        finally:
            self.seconds += time.perf_counter() - start

    # -- the collectives
    def all_gather_objects(self, value, what: str) -> list:
        out = [None] * self.size
        self._call(what, self.dist.all_gather_object, out, value, group=self.group)
        return out

    def agree(self, mine, what: str) -> list:
        """Every rank's ``mine`` (small, picklable), in rank order: one all-gather of a 64-bit
        digest when all ranks hold the same (every step's case), the values themselves only
        when they differ."""
        import hashlib
        import pickle

        import torch

        digest = int.from_bytes(hashlib.blake2b(pickle.dumps(mine), digest_size=8).digest(), "little", signed=True)
        mine_t = torch.tensor([digest], dtype=torch.int64)
        every = [torch.empty_like(mine_t) for _ in range(self.size)]
        self._call(what, self.dist.all_gather, every, mine_t, group=self.group)
        if all(int(t[0]) == digest for t in every):
            return [mine] * self.size
        return self.all_gather_objects(mine, what)

    def average(self, tensors: Sequence, what: str = "averaging the gradients") -> None:
        """Replace each tensor (torch views of OrtValues) by its mean across the group, in
        flat buckets."""
        for bucket in _buckets(tensors):
            flat = _flat(bucket)
            self._call(what, self.dist.all_reduce, flat, group=self.group)
            flat.div_(self.size)
            _unflat(flat, bucket)

    def reduce_to(self, owner: int, tensors: Sequence, what: str = "reducing the gradients") -> None:
        """The mean across the group of each tensor, into ``owner``'s tensors (ZeRO 2); the
        others' are left undefined."""
        for bucket in _buckets(tensors):
            flat = _flat(bucket)
            self._call(what, self.dist.reduce, flat, dst=owner, group=self.group)
            if self.topo.rank == owner:
                flat.div_(self.size)
                _unflat(flat, bucket)

    def broadcast(self, src: int, tensors: Sequence, what: str) -> None:
        """``src``'s values into every rank's ``tensors``."""
        for bucket in _buckets(tensors):
            flat = _flat(bucket)
            self._call(what, self.dist.broadcast, flat, src=src, group=self.group)
            if self.topo.rank != src:
                _unflat(flat, bucket)

    def sum(self, value: float, what: str) -> float:
        import torch

        t = torch.tensor([value], dtype=torch.float64)
        self._call(what, self.dist.all_reduce, t, group=self.group)
        return float(t[0])

    def send(self, tensor, dst: int, what: str) -> None:
        self._call(what, self.dist.send, tensor.contiguous(), dst)

    def recv(self, tensor, src: int, what: str) -> None:
        self._call(what, self.dist.recv, tensor, src)


def subgroups(topo: Topology) -> tuple[Collectives, Collectives, Collectives]:
    """Collectives over this rank's stage replicas (data parallel), over its replica's
    stages (pipeline) and over every rank. Every rank makes every group, in one order, as
    torch.distributed requires."""
    import torch.distributed as dist

    world = Collectives(topo)
    if topo.stages == 1:
        return world, world, world
    stage_groups = [dist.new_group(topo.stage_ranks(k)) for k in range(topo.stages)]
    pipe_groups = [dist.new_group(topo.pipeline_ranks(r)) for r in range(topo.replicas)]
    return (Collectives(topo, topo.stage_ranks(topo.stage), stage_groups[topo.stage]),
            Collectives(topo, topo.pipeline_ranks(topo.replica), pipe_groups[topo.replica]), world)


def _store():
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - a group without a store (an MPI group): no names in failures
        return None


def _gone(host_pid: str) -> bool:
    """Whether the process ``host:pid`` has ended (only known for this host)."""
    host, _, pid = host_pid.rpartition(":")
    if host != socket.gethostname():
        return False
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            return f.read().split(")")[-1].split()[0] in ("Z", "X")
    except (OSError, ValueError):
        return True


def _buckets(tensors: Sequence) -> list[list]:
    """Consecutive tensors of one dtype and device, up to BUCKET_BYTES each."""
    out, size = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not out or size + nbytes > BUCKET_BYTES or (t.dtype, t.device) != (out[-1][0].dtype, out[-1][0].device):
            out.append([])
            size = 0
        out[-1].append(t)
        size += nbytes
    return out


def _flat(bucket: list):
    import torch

    return bucket[0].view(-1) if len(bucket) == 1 else torch.cat([t.reshape(-1) for t in bucket])


def _unflat(flat, bucket: list) -> None:
    if len(bucket) == 1:
        if flat.data_ptr() != bucket[0].data_ptr():
            bucket[0].copy_(flat.view_as(bucket[0]))
        return
    offset = 0
    for t in bucket:
        t.copy_(flat[offset: offset + t.numel()].view_as(t))
        offset += t.numel()


def partition(sizes: Mapping[str, int], ranks: int) -> dict[str, int]:
    """ZeRO's owners: each weight to one of ``ranks``, balanced by bytes (the largest first,
    each to the least loaded; ties to the lower rank)."""
    load = [0] * ranks
    owner = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = min(range(ranks), key=lambda k: (load[k], k))
        owner[name] = r
        load[r] += sizes[name]
    return owner


def shapes_of(feeds: Mapping[str, object]) -> dict[str, tuple]:
    """{input: (dtype, shape)}: what must agree across the replicas of a step."""
    out = {}
    for name, value in feeds.items():
        if hasattr(value, "data_type") and hasattr(value, "shape") and callable(value.shape):
            out[name] = (value.data_type(), tuple(value.shape()))
        else:
            a = np.asarray(value)
            out[name] = (a.dtype.str, a.shape)
    return out


class DataParallel:
    """Data parallel and ZeRO for a TrainingSession (``session``): each replica runs the
    session's gradient graph on its shard of the batch; the gradients are averaged across
    the replicas (every micro-step, or once per accumulation with
    ``allreduce_post_accumulation``); the optimizer graph then updates every weight on every
    replica (plain data parallel: the weights stay bit-identical) or, with ZeRO, each replica
    only the weights it owns (their optimizer state lives there alone; stage 2 keeps only
    their gradients too), and the owners broadcast the updated weights."""

    def __init__(self, session, topo: Topology, params, weights: list[str] | None = None):
        """``weights``: the ones this process trains (a pipeline stage's; default all)."""
        if params.deepspeed_zero_stage == 3:
            raise InvalidArgumentError("TrainingParameters.deepspeed_zero_stage=3 (partitioned weights) is not "
                                       "supported; use 1 (partitioned optimizer state) or 2 (and gradients)")
        if params.enable_adasum:
            raise InvalidArgumentError(
                "TrainingParameters.enable_adasum: Adasum is not supported (torch.distributed has no Adasum reduction, "
                "and it pays off only at scales far beyond a mean all-reduce's); leave it False: gradients are averaged")
        if params.use_mixed_precision:
            raise InvalidArgumentError("TrainingParameters.use_mixed_precision is not supported with distributed "
                                       "training yet: train in float32, or in one process")
        self.s, self.topo = session, topo
        # the stage's replicas (they average gradients), the replica's stages (they sum the
        # gradients' norm), every rank (checkpoints)
        self.comm, self.norm_comm, self.world_comm = subgroups(topo)
        self.comm.announce()
        self.zero = params.deepspeed_zero_stage
        self.steps = params.gradient_accumulation_steps
        # ZeRO 2 keeps only the gradients a replica owns: they are reduced every micro-step
        self.post = params.allreduce_post_accumulation and self.zero < 2
        weights = self.weights = list(session.weights if weights is None else weights)
        sizes = {w: int(np.prod(session._graphs.weight_specs[w].shape)) * session._graphs.weight_specs[w].dtype.itemsize
                 for w in weights}
        self.owner = ({w: self.comm.ranks[k] for w, k in partition(sizes, self.comm.size).items()} if self.zero
                      else {w: None for w in weights})
        self.owned = [w for w in weights if self.owner[w] in (None, topo.rank)]
        self.elsewhere: set[str] = set()  # the state other ranks hold (ZeRO; other pipeline stages)
        self._flat = None  # the gradients' flat buckets, made on the first step
        # the optimizer updates some of the model's weights: the global norm is summed across ranks
        self.partial = bool(self.zero) or topo.stages > 1
        if self.zero:
            self.norm_comm = self.comm
        self._check_same(session, params)
        from ..interface import grad_accum, state_of

        held = set(weights)
        for w in session.weights:  # other pipeline stages' weights and states live there alone
            if w not in held:
                self.elsewhere.update([w] + [state_of(w, s) for s in session._builder.state_names_of(w)])
        for w in weights:  # the optimizer state of the weights other replicas own (ZeRO), and
            if w not in self.owned:  # their accumulated gradients where those are reduced to the owner
                self.elsewhere.update(state_of(w, s) for s in session._builder.state_names_of(w))
                if not self.post and grad_accum(w) in session._state:
                    self.elsewhere.add(grad_accum(w))
        for name in self.elsewhere:
            del session._state.values[name]
        self.comm.broadcast(self.comm.ranks[0], [self._view(n) for n in weights + session.buffers],
                            "broadcasting the initial weights from rank 0")
        if self.partial:
            session._graphs.owned = self.owned

    def _view(self, name: str):
        from .dlpack import to_torch

        return to_torch(self.s._state[name])

    def _check_same(self, session, params) -> None:
        mine = (session._fingerprint, self.zero, self.steps, self.post, params.pipeline_parallel_size)
        seen = self.comm.agree(mine, "checking that every rank trains the same model")
        differ = [r for r, theirs in zip(self.comm.ranks, seen) if theirs != seen[0]]
        if differ:
            raise InvalidArgumentError(
                f"rank {differ[0]} was given another model, optimizer or options than rank {self.comm.ranks[0]}; every "
                "rank must construct its TrainingSession from the same model and TrainingParameters")

    # ------------------------------------------------------------------ one micro-step
    def gradients(self, feeds: Mapping[str, object]) -> tuple[dict, dict]:
        """The session's gradient graph on this replica's shard: (every output, {weight: its
        gradient}); the gradients averaged across the replicas unless they wait for the end
        of the accumulation."""
        from ..interface import grad_accum, updated

        s = self.s
        graph = s._graphs["gradients"]
        state = s._state.take(s.buffers)
        given = {**state, **s._state.take(s.weights)}
        error = None
        try:
            graph.check_feeds(feeds, given, s._check_labels if s._labels else None)
        except InvalidArgumentError as exc:
            error = str(exc)
        seen = self.comm.agree((error, shapes_of(feeds) if isinstance(feeds, Mapping) else None),
                               "checking the step's inputs across ranks")
        for r, (theirs, _) in zip(self.comm.ranks, seen):
            if theirs is not None:
                raise InvalidArgumentError(f"rank {r}: {theirs}")
        if any(shapes != seen[0][1] for _, shapes in seen):
            listed = "; ".join(f"rank {r}: {shapes}" for r, (_, shapes) in zip(self.comm.ranks, seen))
            raise InvalidArgumentError(f"the ranks' inputs differ in type or shape ({listed}); every rank feeds a "
                                       "shard of the same shape (the gradients are averaged with equal weights)")
        if s.buffers:  # running statistics follow rank 0's, as DistributedDataParallel's broadcast_buffers
            self.comm.broadcast(self.comm.ranks[0], [self._view(b) for b in s.buffers], "broadcasting the running statistics")
        into = {updated(grad_accum(w)): v for w, v in self._buckets()[1].items()}
        results = s._run("gradients", feeds, state, s._state.take(s.weights), into=into)
        s._state.commit({updated(b): results[updated(b)] for b in s.buffers})
        grads = {w: results[updated(grad_accum(w))] for w in s.weights}
        if self.steps == 1 or not self.post:
            grads = self.reduce(grads)
        return results, grads

    def _buckets(self) -> tuple[list, dict]:
        """Flat buffers the gradient graph writes the gradients into (as DDP's gradient-as-
        bucket views: reduced with no copy), each holding weights of one owner and dtype, up
        to BUCKET_BYTES: ([(owner, flat torch tensor, [weights])], {weight: its OrtValue view})."""
        if self._flat is None:
            import torch

            from .dlpack import to_ort, to_torch

            specs = self.s._graphs.weight_specs
            groups: list[tuple] = []
            for w in self.weights:
                spec = specs[w]
                key = (self.owner[w] if self.zero else None, spec.dtype)
                size = int(np.prod(spec.shape, dtype=np.int64)) * spec.dtype.itemsize
                if not groups or groups[-1][0] != key or groups[-1][2] + size > BUCKET_BYTES:
                    groups.append((key, [], 0))
                groups[-1] = (key, groups[-1][1] + [w], groups[-1][2] + size)
            buckets, views = [], {}
            for (owner, dtype), names, _ in groups:
                like = to_torch(self.s._state.ortvalue(np.zeros(0, dtype)))
                flat = torch.empty(sum(int(np.prod(specs[w].shape, dtype=np.int64)) for w in names), dtype=like.dtype,
                                   device=like.device)
                offset = 0
                for w in names:
                    n = int(np.prod(specs[w].shape, dtype=np.int64))
                    views[w] = to_ort(flat[offset: offset + n].view(specs[w].shape))
                    offset += n
                buckets.append((owner, flat, names))
            self._flat = buckets, views
        return self._flat

    def reduce(self, grads: dict) -> dict:
        """The gradients averaged across the replicas: all of them, or with ZeRO the ones this
        replica owns, each reduced to its owner alone (as a reduce-scatter: the owner's update
        needs no other; the others are dropped). Gradients in the flat buckets are reduced
        there; others (accumulation buffers) in buckets of their own."""
        from .dlpack import to_torch

        buckets, views = self._flat or ([], {})
        if views and all(grads.get(w) is views[w] for w in self.weights):
            for owner, flat, _ in buckets:
                if owner is None:
                    self.comm.average([flat])
                else:
                    self.comm.reduce_to(owner, [flat])
        elif not self.zero:
            self.comm.average([to_torch(grads[w]) for w in self.weights])
        else:
            for owner in self.comm.ranks:
                self.comm.reduce_to(owner, [to_torch(grads[w]) for w in self.weights if self.owner[w] == owner])
        return {w: grads[w] for w in self.owned}

    def add(self, into: dict, grads: dict) -> None:
        """``into[w] += grads[w]`` in place (``into`` takes a copy where it has none: the next
        micro-step writes its gradients into the same buckets)."""
        from .dlpack import to_ort, to_torch

        for w, g in grads.items():
            if w in into:
                to_torch(into[w]).add_(to_torch(g))
            else:
                into[w] = to_ort(to_torch(g).clone())

    # ------------------------------------------------------------------ the update
    def update(self, grads: dict, rate) -> None:
        """The optimizer step with the (reduced) gradients of the owned weights; with ZeRO the
        owners then broadcast the new weights. Every replica takes the same decision on a
        step whose gradients are not finite."""
        from ..interface import ALL_FINITE, GRADIENT, GRADIENT_SQUARES, LEARNING_RATE, STEP
        from .dlpack import to_torch

        s = self.s
        per_run = {LEARNING_RATE: rate}
        if self.partial:
            squares = sum(float(to_torch(grads[w]).double().square().sum()) for w in self.owned)
            squares = self.norm_comm.sum(squares, "summing the gradients' squared norm")
            if not np.isfinite(squares):
                s._check_finite({ALL_FINITE: s._state.ortvalue(np.array(False))})
                return
            if s._builder.max_grad_norm is not None:
                per_run[GRADIENT_SQUARES] = s._state.ortvalue(np.array(squares, np.float32))
        if self.owned:
            state = {n: v for n, v in s._state.values.items() if n in s._graphs["optimizer"].inputs}
            per_run.update({w + GRADIENT: grads[w] for w in self.owned})
            results = s._run("optimizer", {}, state, per_run)
            s._check_finite(results)
            s._state.commit(results)
        else:  # a replica that owns no weight only counts the step
            s._state.values[STEP] = s._state.ortvalue(np.array(s.step + 1, np.int64))
        if self.zero:
            for owner in self.comm.ranks:
                self.comm.broadcast(owner, [self._view(w) for w in self.weights if self.owner[w] == owner],
                                    "broadcasting the updated weights from their owners")

    # ------------------------------------------------------------------ the session's calls
    def _announced(method):
        """Leave an error this process raises in the store, for the other ranks' messages."""

        @functools.wraps(method)
        def call(self, *args, **kwargs):
            try:
                return method(self, *args, **kwargs)
            except DistributedError:
                raise
            except BaseException as exc:
                self.comm.raised(exc)
                raise
        return call

    @_announced
    def run(self, feeds, rate) -> dict:
        """``TrainingSession.run``: one micro-step; the update on the last of an accumulation."""
        from ..interface import ACCUMULATION_STEP, grad_accum

        s = self.s
        results, grads = self.gradients(feeds)
        if self.steps == 1:
            self.update(grads, rate)
            return results
        buffers = {w: s._state[grad_accum(w)] for w in self.weights if grad_accum(w) in s._state}
        self.add(buffers, grads)
        done = int(s._state[ACCUMULATION_STEP].numpy()) + 1
        if done < self.steps:
            s._state.values[ACCUMULATION_STEP] = s._state.ortvalue(np.array(done, np.int64))
            return results
        summed = self.reduce(dict(buffers)) if self.post else {w: buffers[w] for w in self.owned}
        self.update(summed, rate)
        for w in buffers:
            s._state.values[grad_accum(w)] = s._state.ortvalue(np.zeros_like(buffers[w].numpy()))
        s._state.values[ACCUMULATION_STEP] = s._state.ortvalue(np.array(0, np.int64))
        return results

    @_announced
    def train_step(self, feeds, reset: bool) -> dict:
        """``TrainingSession.train_step``: the gradients replace or add to the session's buffers."""
        s = self.s
        results, grads = self.gradients(feeds)
        if reset:
            s._state.grads = {}
        self.add(s._state.grads, grads)
        return results

    @_announced
    def optimizer_step(self, rate) -> None:
        grads = self.s._state.grads
        self.update(self.reduce(dict(grads)) if self.post else grads, rate)

    # ------------------------------------------------------------------ state
    def gathered(self, tensors: dict[str, np.ndarray], what: str) -> dict[str, np.ndarray] | None:
        """Every rank's ``tensors`` joined on rank 0 (None on the others): the state of the
        weights other ranks own or train, for one ordinary checkpoint."""
        import torch

        if self.post:  # each replica's accumulated gradients are its share: the checkpoint holds their mean
            from ..interface import GRAD_ACCUM

            partial = [n for n in tensors if n.endswith((GRAD_ACCUM, ".grad"))]
            self.comm.average([torch.from_numpy(tensors[n]) for n in partial],
                              "averaging the accumulated gradients for the checkpoint")
        comm = self.world_comm
        first = comm.ranks[0]
        listing = comm.agree({n: (v.dtype.str, v.shape) for n, v in tensors.items()}, what)
        out = dict(tensors) if self.topo.rank == first else None
        have = set(listing[0])
        for r, names in zip(comm.ranks[1:], listing[1:]):
            for name, (dtype, shape) in names.items():
                if name in have:
                    continue
                have.add(name)
                if self.topo.rank == r:
                    comm.send(torch.from_numpy(np.ascontiguousarray(tensors[name])), first, what)
                elif self.topo.rank == first:
                    buf = torch.from_numpy(np.empty(shape, np.dtype(dtype)))
                    comm.recv(buf, r, what)
                    out[name] = buf.numpy()
        return out
