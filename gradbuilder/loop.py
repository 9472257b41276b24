"""A plain training loop over in-memory arrays, with a progress bar: what `gradbuilder train`
and `gradbuilder demo` run.

    >>> losses = fit(session, {"x": x, "labels": y}, steps=300, batch_size=64)
"""

from __future__ import annotations

import sys
import time
from typing import Mapping

import numpy as np

from .errors import InvalidArgumentError


class Progress:
    """A one-line progress bar: ``train [#####-----] 150/300 loss 0.4321 812.4 steps/s``.
    Redrawn in place on a terminal, every ``every`` steps elsewhere (logs, pipes)."""

    def __init__(self, total: int, label: str = "train", stream=None, width: int = 30):
        self.total, self.label, self.width = total, label, width
        self.stream = stream if stream is not None else sys.stdout
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.every = max(1, total // 10)
        self.start = time.perf_counter()

    def update(self, done: int, loss: float) -> None:
        if not self.tty and done % self.every and done != self.total:
            return
        rate = done / max(time.perf_counter() - self.start, 1e-9)
        filled = int(self.width * done / max(self.total, 1))
        line = (f"{self.label} [{'#' * filled}{'-' * (self.width - filled)}] {done}/{self.total} "
                f"loss {loss:.4f} {rate:.1f} steps/s")
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


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
        loss_name: str | None = None, progress: bool = True, stream=None) -> list[float]:
    """Train ``session`` (a TrainingSession) for ``steps`` runs of ``session.run`` on shuffled
    mini-batches of ``data`` (with gradient accumulation, several runs make one update);
    returns the loss of every run. A registered scheduler is stepped after every update. The
    session's ``properties`` record the batches seen and the shuffling seed: a session that
    has trained already, or was resumed from a checkpoint, continues the same order where it
    stopped (its recorded seed wins over ``seed``)."""
    loss_name = loss_name or session.loss_name
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise InvalidArgumentError(f"steps must be an int >= 1, got {steps!r}")
    done = int(session.properties.get(BATCHES_SEEN, 0))
    seed = int(session.properties.get(DATA_SEED, seed))
    feed_names = [a.name for a in session.get_inputs()]
    missing = [n for n in feed_names if n not in data]
    if missing:
        raise InvalidArgumentError(f"the data has no arrays for the model input(s) {missing}; it has {sorted(data)}")
    stream_of_batches = batches({n: data[n] for n in feed_names}, batch_size, seed, start=done)
    bar = Progress(steps, stream=stream) if progress else None
    losses = []
    for i in range(steps):
        updates = session.step
        (loss,) = session.run([loss_name], next(stream_of_batches))
        session.properties.update({BATCHES_SEEN: done + i + 1, DATA_SEED: seed})
        losses.append(float(loss))
        if session.scheduler is not None and session.step > updates:
            session.scheduler_step()
        if bar:
            bar.update(i + 1, losses[-1])
    if bar:
        bar.close()
    return losses


def accuracy(scores: np.ndarray, target: np.ndarray) -> float:
    """Fraction of rows whose highest score is at the target class."""
    return float(np.mean(np.argmax(scores, axis=-1) == target))
