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


def batches(data: Mapping[str, np.ndarray], batch_size: int, seed: int = 0):
    """Endless shuffled mini-batches (each a dict like ``data``); every array shares axis 0.
    The last incomplete batch of an epoch is dropped, so every batch has ``batch_size`` rows."""
    lengths = {name: len(a) for name, a in data.items()}
    if len(set(lengths.values())) != 1:
        raise InvalidArgumentError(f"the data arrays differ in length along axis 0: {lengths}")
    n = next(iter(lengths.values()))
    if not 0 < batch_size <= n:
        raise InvalidArgumentError(f"batch size {batch_size} must be between 1 and the number of samples ({n})")
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(n)
        for start in range(0, n - batch_size + 1, batch_size):
            idx = order[start: start + batch_size]
            yield {name: a[idx] for name, a in data.items()}


def fit(session, data: Mapping[str, np.ndarray], steps: int, batch_size: int, seed: int = 0,
        loss_name: str | None = None, progress: bool = True, stream=None) -> list[float]:
    """Train ``session`` (a TrainingSession) for ``steps`` steps of ``session.run`` on shuffled
    mini-batches of ``data``; returns the loss of every step. A registered scheduler is
    stepped after every update."""
    loss_name = loss_name or session.loss_name
    bar = Progress(steps, stream=stream) if progress else None
    losses = []
    feed_names = [a.name for a in session.get_inputs()]
    missing = [n for n in feed_names if n not in data]
    if missing:
        raise InvalidArgumentError(f"the data has no arrays for the model input(s) {missing}; it has {sorted(data)}")
    stream_of_batches = batches({n: data[n] for n in feed_names}, batch_size, seed)
    for i in range(steps):
        (loss,) = session.run([loss_name], next(stream_of_batches))
        losses.append(float(loss))
        if session.scheduler is not None:
            session.scheduler_step()
        if bar:
            bar.update(i + 1, losses[-1])
    if bar:
        bar.close()
    return losses


def accuracy(scores: np.ndarray, target: np.ndarray) -> float:
    """Fraction of rows whose highest score is at the target class."""
    return float(np.mean(np.argmax(scores, axis=-1) == target))
