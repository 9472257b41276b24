"""torch.distributed's collectives over one process group, each failure turned into a
``DistributedError`` that names the rank that died or raised.

Every collective runs under the group's timeout (``GRADBUILDER_DISTRIBUTED_TIMEOUT`` seconds,
default 300). Each process leaves its pid and host in the group's store at start, and its
error when it raises (through the session, or uncaught: ``sys.excepthook``); a failed
collective reads them back.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Sequence

from ...errors import DistributedError
from .launch import TIMEOUT_ENV, Topology, timeout_seconds

BUCKET_BYTES = 25 * 1024 * 1024  # tensors reduced per flat bucket (DDP's default size)


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

    def call(self, what: str, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` (a collective, or a point-to-point send or receive); its
        failure as a ``DistributedError`` that says ``what`` was being done and which rank died
        or raised."""
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
        self.call(what, self.dist.all_gather_object, out, value, group=self.group)
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
        self.call(what, self.dist.all_gather, every, mine_t, group=self.group)
        if all(int(t[0]) == digest for t in every):
            return [mine] * self.size
        return self.all_gather_objects(mine, what)

    def average(self, tensors: Sequence, what: str = "averaging the gradients") -> None:
        """Replace each tensor (torch views of OrtValues) by its mean across the group, in
        flat buckets."""
        for bucket in _buckets(tensors):
            flat = _flat(bucket)
            self.call(what, self.dist.all_reduce, flat, group=self.group)
            flat.div_(self.size)
            _unflat(flat, bucket)

    def reduce_to(self, owner: int, tensors: Sequence, what: str = "reducing the gradients") -> None:
        """The mean across the group of each tensor, into ``owner``'s tensors (ZeRO 2); the
        others' are left undefined."""
        for bucket in _buckets(tensors):
            flat = _flat(bucket)
            self.call(what, self.dist.reduce, flat, dst=owner, group=self.group)
            if self.topo.rank == owner:
                flat.div_(self.size)
                _unflat(flat, bucket)

    def broadcast(self, src: int, tensors: Sequence, what: str) -> None:
        """``src``'s values into every rank's ``tensors``."""
        for bucket in _buckets(tensors):
            flat = _flat(bucket)
            self.call(what, self.dist.broadcast, flat, src=src, group=self.group)
            if self.topo.rank != src:
                _unflat(flat, bucket)

    def sum(self, value: float, what: str) -> float:
        import torch

        t = torch.tensor([value], dtype=torch.float64)
        self.call(what, self.dist.all_reduce, t, group=self.group)
        return float(t[0])

    def send(self, tensor, dst: int, what: str) -> None:
        self.call(what, self.dist.send, tensor.contiguous(), dst)

    def recv(self, tensor, src: int, what: str) -> None:
        self.call(what, self.dist.recv, tensor, src)


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


