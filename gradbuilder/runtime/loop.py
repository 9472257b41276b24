"""A plain training loop over in-memory arrays, with a progress bar (tqdm): what
`gradbuilder train` and `gradbuilder demo` run.

    >>> losses = fit(session, {"x": x, "labels": y}, steps=300, batch_size=64)
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Callable, Mapping

import numpy as np

from ..errors import InvalidArgumentError

log = logging.getLogger(__name__)


def progress_bar(total: int, label: str = "train", progress: bool | None = None, stream=None, initial: int = 0,
                 leave: bool = True, postfix: str | None = None):
    """A progress bar of ``total`` steps (tqdm's)::

        train  50%|#####     | 150/300 [00:00<00:00, 812.40 steps/s, loss 0.4321]

    tqdm rather than rich: it is one small pure-Python module with no dependencies, writes a
    single line that any stream (terminal, log file, notebook) shows, and computes the rate and
    the time left itself. ``progress``: None shows it only when ``stream`` (default stderr)
    is a terminal, True always, False never. The rate is the mean since the bar started
    (``smoothing=0``) over the steps after ``initial``: start it after a step that should
    not count (the first one builds and compiles) with ``initial=1``."""
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=label, unit=" steps", file=stream, smoothing=0, leave=leave,
                postfix=postfix, disable=None if progress is None else not progress, dynamic_ncols=True,
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_noinv_fmt}{postfix}]")


def batches(data: Mapping[str, np.ndarray], batch_size: int, seed: int = 0, start: int = 0):
    """Endless shuffled mini-batches (each a dict like ``data``); every array shares axis 0.
    The last incomplete batch of an epoch is dropped, so every batch has ``batch_size`` rows.
    ``start``: skip that many batches (the order is the same as from 0: a resumed run sees the
    batches it would have seen)."""
    lengths = {name: len(a) for name, a in data.items()}
    if len(set(lengths.values())) != 1:
        raise InvalidArgumentError(f"the data arrays differ in length along axis 0: {lengths}")
    n = next(iter(lengths.values()))
    if not 0 < batch_size <= n:
        raise InvalidArgumentError(f"batch size {batch_size} must be between 1 and the number of samples ({n})")
    rng = np.random.default_rng(seed)
    per_epoch = n // batch_size
    for _ in range(start // per_epoch):
        rng.permutation(n)  # the epochs already seen: the generator's state moves as it did
    skip = start % per_epoch
    while True:
        order = rng.permutation(n)
        for b in range(skip, per_epoch):
            idx = order[b * batch_size: (b + 1) * batch_size]
            yield {name: a[idx] for name, a in data.items()}
        skip = 0


# TrainingSession.properties kept by ``fit``, so that a resumed run continues the data order
BATCHES_SEEN, DATA_SEED = "batches_seen", "data_seed"


def fit(session, data: Mapping[str, np.ndarray], steps: int, batch_size: int, seed: int = 0,
        loss_name: str | None = None, progress: bool | None = None, stream=None,
        stop: Callable[[], bool] | None = None, checkpoint=None, save_every: int | None = None,
        keep_last: int = 2, save_in_background: bool = False, tokens: str | None = None) -> list[float]:
    """Train ``session`` (a TrainingSession) for ``steps`` runs of ``session.run`` on shuffled
    mini-batches of ``data`` (with gradient accumulation, several runs make one update);
    returns the loss of every run. A registered scheduler is stepped after every update. The
    session's ``properties`` record the batches seen and the shuffling seed: a session that
    has trained already, or was resumed from a checkpoint, continues the same order where it
    stopped (its recorded seed wins over ``seed``).

    ``progress``: a progress bar on ``stream`` (default stderr); None shows it only on a
    terminal. ``stop``: asked before each step; when it returns True the loop ends there, with
    every finished step complete (weights, optimizer state, schedule, ``properties``), so the
    session can be checkpointed and resumed exactly (``gradbuilder train`` passes a flag set
    by SIGINT/SIGTERM); the returned list then holds fewer than ``steps`` losses. A
    data-parallel session (``session.data_shard``) trains on its share of each batch: every
    process draws the same batches.

    ``save_every``: after every that many optimizer updates, a checkpoint of the session beside
    ``checkpoint`` (``ck.safetensors`` -> ``ck.update00000400.safetensors``, written atomically;
    the newest ``keep_last`` kept): a crash loses at most the updates since the last one, and
    ``gradbuilder.runtime.periodic.CheckpointSeries(checkpoint).resume(session)`` continues
    from the newest complete one, exactly as if nothing had happened. ``save_in_background``:
    each is copied and written from a thread while training goes on (the state's size in
    memory for the copy; on a 2-core CPU it costs more than it saves, as the hashing and the
    writing take the cores the steps use: ``tools/bench_periodic.py``); ``fit`` returns once
    the last one is written. ``tokens``: the name of an array of the data (an attention mask)
    whose non-zero entries count as tokens: the bar shows tokens per second too."""
    from .periodic import CheckpointSeries

    loss_name = loss_name or session.loss_name
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise InvalidArgumentError(f"steps must be an int >= 1, got {steps!r}")
    if save_every is not None and (isinstance(save_every, bool) or not isinstance(save_every, int) or save_every < 1):
        raise InvalidArgumentError(f"save_every must be an int >= 1 (optimizer updates), got {save_every!r}")
    if save_every is not None and checkpoint is None:
        raise InvalidArgumentError("save_every needs checkpoint: the path the periodic checkpoints are named after")
    series = CheckpointSeries(checkpoint, keep_last, save_in_background) if save_every is not None else None
    done = int(session.properties.get(BATCHES_SEEN, 0))
    seed = int(session.properties.get(DATA_SEED, seed))
    feed_names = [a.name for a in session.get_inputs()]
    missing = [n for n in feed_names if n not in data]
    if missing:
        raise InvalidArgumentError(f"the data has no arrays for the model input(s) {missing}; it has {sorted(data)}")
    if tokens is not None and tokens not in feed_names:
        raise InvalidArgumentError(f"tokens: '{tokens}' is not an input of the model; its inputs are {feed_names}")
    stream_of_batches = batches({n: data[n] for n in feed_names}, batch_size, seed, start=done)
    shard, shards = getattr(session, "data_shard", (0, 1))  # (a stand-in session may lack it)
    # The first step builds and compiles the graphs: it gets a bar of its own, and the bar
    # that follows starts after it, so that its rate and time left count the later steps only.
    bar = progress_bar(steps, progress=progress, stream=stream, leave=False, postfix="first step: building the graphs")
    losses: list[float] = []
    counted, started = 0, None
    try:
        for i in range(steps):
            if stop is not None and stop():
                log.debug("stopped before step %d of %d", i + 1, steps)
                break
            updates = session.step
            batch = next(stream_of_batches)
            if shards > 1:  # data parallel: this process's share of the batch
                batch = {n: np.array_split(a, shards)[shard] for n, a in batch.items()}
            (loss,) = session.run([loss_name], batch)
            session.properties.update({BATCHES_SEEN: done + i + 1, DATA_SEED: seed})
            losses.append(float(loss))
            if session.scheduler is not None and session.step > updates:
                session.scheduler_step()
            if series is not None and session.step > updates and session.step % save_every == 0:
                series.save(session)
            if i == 0:
                bar.close()
                bar = progress_bar(steps, progress=progress, stream=stream, initial=1)
                started = time.perf_counter()
            else:
                bar.update(1)
                counted += int(np.count_nonzero(batch[tokens])) if tokens else 0
            if not bar.disable:
                rate = f", {counted / (time.perf_counter() - started):.0f} tokens/s" if tokens and counted else ""
                bar.set_postfix_str(f"loss {losses[-1]:.4f}{rate}", refresh=False)
    finally:
        bar.close()
        if series is not None:  # the last periodic checkpoint written; its failure raised unless one is
            series.wait(quiet=sys.exc_info()[0] is not None)
    return losses


def accuracy(scores: np.ndarray, target: np.ndarray) -> float:
    """Fraction of rows whose highest score is at the target class."""
    return float(np.mean(np.argmax(scores, axis=-1) == target))
