"""Data parallel and ZeRO stages 1 and 2 between a TrainingSession's gradient graph and its
optimizer graph: the gradients, written by the graph into flat buckets, are averaged (or
reduced to their owner) with torch.distributed on DLPack views of the OrtValues, on the
device they live on; the graphs hold no collective op."""

from __future__ import annotations

import functools
from typing import Mapping

import numpy as np

from ...errors import DistributedError, InvalidArgumentError
from ..executor import Executor, LocalExecutor
from ..graphs import Kind
from .collectives import BUCKET_BYTES, subgroups
from .launch import Topology


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


def agree_on_inputs(comm, error: str | None, shapes: dict, what: str, digest: int | None = None) -> None:
    """Every rank of ``comm`` raises the same InvalidArgumentError, naming the rank, when any
    rank's inputs were refused (``error``), their types or shapes (``shapes_of``) differ, or,
    with ``digest``, their contents differ (a pipeline's stages are fed one batch)."""
    seen = comm.agree((error, shapes, digest), f"checking the step's inputs across the {what}")
    for r, (theirs, _, _) in zip(comm.ranks, seen):
        if theirs is not None:
            raise InvalidArgumentError(f"rank {r}: {theirs}")
    if any(other != seen[0][1] for _, other, _ in seen):
        listed = "; ".join(f"rank {r}: {other}" for r, (_, other, _) in zip(comm.ranks, seen))
        raise InvalidArgumentError(f"the ranks' inputs differ in type or shape ({listed}); every rank feeds a batch "
                                   "of the same shape (the gradients are averaged with equal weights)")
    if any(d != seen[0][2] for _, _, d in seen):
        raise InvalidArgumentError(f"the {what} (ranks {comm.ranks}) were fed different batches; feed every stage of "
                                   "a pipeline the same batch")


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


class DataParallel(Executor):
    """Data parallel and ZeRO, an executor (``executor.Executor``) over this process's
    ``local`` one: each replica runs the gradient graph on its shard of the batch; the
    gradients are averaged across
    the replicas (every micro-step, or once per accumulation with
    ``allreduce_post_accumulation``); the optimizer graph then updates every weight on every
    replica (plain data parallel: the weights stay bit-identical) or, with ZeRO, each replica
    only the weights it owns (their optimizer state lives there alone; stage 2 keeps only
    their gradients too), and the owners broadcast the updated weights."""

    def __init__(self, local: LocalExecutor, topo: Topology, params, weights: list[str] | None = None):
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
        self.local, self.topo = local, topo
        self.parts = local.parts
        facts, state = self.parts.facts, self.parts.state
        # the stage's replicas (they average gradients), the replica's stages (they sum the
        # gradients' norm), every rank (checkpoints)
        self.comm, self.norm_comm, self.world_comm = subgroups(topo)
        self.comm.announce()
        self.zero = params.deepspeed_zero_stage
        self.steps = params.gradient_accumulation_steps
        # ZeRO 2 keeps only the gradients a replica owns: they are reduced every micro-step
        self.post = params.allreduce_post_accumulation and self.zero < 2
        weights = self.weights = list(facts.weights if weights is None else weights)
        sizes = {w: facts.specs[w].nbytes for w in weights}
        self.owner = ({w: self.comm.ranks[k] for w, k in partition(sizes, self.comm.size).items()} if self.zero
                      else {w: None for w in weights})
        self.owned = [w for w in weights if self.owner[w] in (None, topo.rank)]
        self.elsewhere: set[str] = set()  # the state other ranks hold (ZeRO; other pipeline stages)
        self._flat = None  # the gradients' flat buckets, made on the first step
        # the optimizer updates some of the model's weights: the global norm is summed across ranks
        self.partial = bool(self.zero) or topo.stages > 1
        if self.zero:
            self.norm_comm = self.comm
        self._check_same(params)
        from ...interface import grad_accum, state_of

        held, builder = set(weights), self.parts.builder
        for w in facts.weights:  # other pipeline stages' weights and states live there alone
            if w not in held:
                self.elsewhere.update([w] + [state_of(w, s) for s in builder.state_names_of(w)])
        for w in weights:  # the optimizer state of the weights other replicas own (ZeRO), and
            if w not in self.owned:  # their accumulated gradients where those are reduced to the owner
                self.elsewhere.update(state_of(w, s) for s in builder.state_names_of(w))
                if not self.post and grad_accum(w) in state:
                    self.elsewhere.add(grad_accum(w))
        state.drop(self.elsewhere)
        self.comm.broadcast(self.comm.ranks[0], [self._view(n) for n in weights + facts.buffers],
                            "broadcasting the initial weights from rank 0")
        if self.partial:
            self.parts.graphs.partition(self.owned)

    def _view(self, name: str):
        from ..dlpack import to_torch

        return to_torch(self.parts.state[name])

    def _check_same(self, params) -> None:
        mine = (self.parts.facts.identity.model, self.zero, self.steps, self.post, params.pipeline_parallel_size)
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
        from ...interface import grad_accum, updated

        facts, s = self.parts.facts, self.parts.state
        state = s.take(facts.buffers)
        given = {**state, **s.take(facts.weights)}
        error = None
        try:
            self.local.check_feeds(Kind.GRADIENTS, feeds, given)
        except InvalidArgumentError as exc:
            error = str(exc)
        agree_on_inputs(self.comm, error, shapes_of(feeds) if isinstance(feeds, Mapping) else None, "replicas")
        if facts.buffers:  # running statistics follow rank 0's, as DistributedDataParallel's broadcast_buffers
            self.comm.broadcast(self.comm.ranks[0], [self._view(b) for b in facts.buffers],
                                "broadcasting the running statistics")
        into = {updated(grad_accum(w)): v for w, v in self._buckets()[1].items()}
        results = self.local.run_graph(Kind.GRADIENTS, feeds, state, s.take(facts.weights), into=into)
        s.commit({updated(b): results[updated(b)] for b in facts.buffers})
        grads = {w: results[updated(grad_accum(w))] for w in facts.weights}
        if self.steps == 1 or not self.post:
            grads = self.reduce(grads)
        return results, grads

    def _buckets(self) -> tuple[list, dict]:
        """Flat buffers the gradient graph writes the gradients into (as DDP's gradient-as-
        bucket views: reduced with no copy), each holding weights of one owner and dtype, up
        to BUCKET_BYTES: ([(owner, flat torch tensor, [weights])], {weight: its OrtValue view})."""
        if self._flat is None:
            import torch

            from ..dlpack import to_ort, to_torch

            specs = self.parts.facts.specs
            groups: list[tuple] = []
            for w in self.weights:
                key = (self.owner[w] if self.zero else None, specs[w].dtype)
                if not groups or groups[-1][0] != key or groups[-1][2] + specs[w].nbytes > BUCKET_BYTES:
                    groups.append((key, [], 0))
                groups[-1] = (key, groups[-1][1] + [w], groups[-1][2] + specs[w].nbytes)
            buckets, views = [], {}
            for (owner, dtype), names, _ in groups:
                like = to_torch(self.parts.state.ortvalue(np.zeros(0, dtype)))
                flat = torch.empty(sum(specs[w].size for w in names), dtype=like.dtype, device=like.device)
                offset = 0
                for w in names:
                    views[w] = to_ort(flat[offset: offset + specs[w].size].view(specs[w].shape))
                    offset += specs[w].size
                buckets.append((owner, flat, names))
            self._flat = buckets, views
        return self._flat

    def reduce(self, grads: dict) -> dict:
        """The gradients averaged across the replicas: all of them, or with ZeRO the ones this
        replica owns, each reduced to its owner alone (as a reduce-scatter: the owner's update
        needs no other; the others are dropped). Gradients in the flat buckets are reduced
        there; others (accumulation buffers) in buckets of their own."""
        from ..dlpack import to_torch

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
        from ..dlpack import to_ort, to_torch

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
        from ...interface import ALL_FINITE, GRADIENT, GRADIENT_SQUARES, LEARNING_RATE, STEP
        from ..dlpack import to_torch

        s, local = self.parts.state, self.local
        per_run = {LEARNING_RATE: rate}
        if self.partial:
            squares = sum(float(to_torch(grads[w]).double().square().sum()) for w in self.owned)
            squares = self.norm_comm.sum(squares, "summing the gradients' squared norm")
            if not np.isfinite(squares):
                local.check_finite({ALL_FINITE: s.ortvalue(np.array(False))})
                return
            if self.parts.builder.max_grad_norm is not None:
                per_run[GRADIENT_SQUARES] = s.ortvalue(np.array(squares, np.float32))
        if self.owned:
            state = {n: v for n, v in s.values.items() if n in self.parts.graphs[Kind.OPTIMIZER].inputs}
            per_run.update({w + GRADIENT: grads[w] for w in self.owned})
            results = local.run_graph(Kind.OPTIMIZER, {}, state, per_run)
            local.check_finite(results)
            s.commit(results)
        else:  # a replica that owns no weight only counts the step
            s.set({STEP: np.array(local.step + 1, np.int64)}, owned=True)
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

    def run(self, feeds, rate, outputs=(), run_options=None) -> dict:
        """``TrainingSession.run``: one micro-step; the update on the last of an accumulation."""
        results = self._step(feeds, rate)
        missing = [n for n in outputs if n not in results]
        if missing:
            raise InvalidArgumentError(f"output_names: a pipeline-parallel step returns the loss "
                                       f"'{self.parts.facts.loss}' only, not {missing}")
        return results

    @_announced
    def _step(self, feeds, rate) -> dict:
        from ...interface import ACCUMULATION_STEP, grad_accum
        from ..dlpack import to_torch

        s = self.parts.state
        results, grads = self.gradients(feeds)
        if self.steps == 1:
            self.update(grads, rate)
            return results
        buffers = {w: s[grad_accum(w)] for w in self.weights if grad_accum(w) in s}
        self.add(buffers, grads)
        done = int(s[ACCUMULATION_STEP].numpy()) + 1
        if done < self.steps:
            s.set({ACCUMULATION_STEP: np.array(done, np.int64)}, owned=True)
            return results
        summed = self.reduce(dict(buffers)) if self.post else {w: buffers[w] for w in self.owned}
        self.update(summed, rate)
        for buffer in buffers.values():  # zeroed in place, on their device
            to_torch(buffer).zero_()
        s.set({ACCUMULATION_STEP: np.array(0, np.int64)}, owned=True)
        return results

    @_announced
    def train_step(self, feeds, reset: bool) -> dict:
        """``TrainingSession.train_step``: the gradients replace or add to the session's buffers."""
        s = self.parts.state
        results, grads = self.gradients(feeds)
        if reset:
            s.grads = {}
        self.add(s.grads, grads)
        return results

    @_announced
    def optimizer_step(self, rate) -> None:
        grads = self.parts.state.grads
        self.update(self.reduce(dict(grads)) if self.post else grads, rate)

    def eval(self, feeds) -> dict:
        return self.local.eval(feeds)

    def place(self, providers, provider_options=None) -> None:
        self.local.place(providers, provider_options)

    # ------------------------------------------------------------------ state
    @property
    def shard(self) -> tuple[int, int]:
        return self.topo.replica, self.topo.replicas

    def partition_info(self) -> dict:
        return {w: {"owner": r} for w, r in self.owner.items()} if self.zero else {}

    def owned_grads(self, grads: dict) -> dict:
        return {w: v for w, v in grads.items() if w in self.owned}

    @property
    def holds_whole_state(self) -> bool:
        """Without ZeRO, a pipeline or per-replica accumulated gradients, every process holds
        the same whole state after each update."""
        return not self.partial and not self.post

    def checkpoint_tensors(self, tensors: dict, what: str) -> dict | None:
        """One checkpoint, written by the first rank from copies (gathered averages in place)."""
        return self.gathered({n: np.array(v.numpy(), copy=True) for n, v in tensors.items()}, what)

    def gathered(self, tensors: dict[str, np.ndarray], what: str) -> dict[str, np.ndarray] | None:
        """Every rank's ``tensors`` joined on rank 0 (None on the others): the state of the
        weights other ranks own or train, for one ordinary checkpoint."""
        import torch

        if self.post:  # each replica's accumulated gradients are its share: the checkpoint holds their mean
            from ...interface import GRAD_ACCUM

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
