"""Checkpoints written while training, and the newest complete one to resume from.

A run with ``checkpoint="ck.safetensors"`` and ``save_every=N`` writes, after every N-th
optimizer update, ``ck.update00000400.safetensors`` (the update count in the name), each
atomically (a crash while writing leaves the earlier ones as they were), and keeps the newest
``keep_last`` of them; ``ck.safetensors`` itself is what the end of training, a signal, or a
surviving rank writes. ``resume`` takes, among all of them, the most recently written one that
reads whole (its digest checked): a damaged newest one is named, and the one before it is
taken.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from pathlib import Path

from .. import files
from ..errors import CheckpointError, InvalidArgumentError
from ..user_warnings import warn
from . import checkpoint

log = logging.getLogger(__name__)


class CheckpointSeries:
    """The checkpoints of one run: ``path`` and its numbered siblings. With ``background``,
    ``save`` copies the state and writes it from a thread while training goes on (the hashing
    and the disk's time overlap the steps; the copy costs the state's size in memory until the
    write is done); ``wait`` (which ``fit`` calls) finishes the write in progress."""

    def __init__(self, path: str | os.PathLike, keep_last: int = 2, background: bool = False):
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise InvalidArgumentError(f"keep_last must be an int >= 1, got {keep_last!r}")
        self.path = Path(path)
        self.keep_last = keep_last
        self.background = background
        self._writer: threading.Thread | None = None
        self._failed: BaseException | None = None
        self._stem, self._suffix = self.path.stem, self.path.suffix
        self._numbered = re.compile(re.escape(self._stem) + r"\.update(\d{8,})" + re.escape(self._suffix) + "$")

    def at(self, update: int) -> Path:
        """The periodic checkpoint written after ``update`` optimizer updates."""
        return self.path.with_name(f"{self._stem}.update{update:08d}{self._suffix}")

    def numbered(self) -> list[Path]:
        """The periodic checkpoints that exist, oldest first."""
        folder = self.path.parent
        found = [(int(m.group(1)), folder / name) for name in os.listdir(folder or ".")
                 if (m := self._numbered.match(name))] if folder.is_dir() else []
        return [p for _, p in sorted(found)]

    def save(self, session) -> Path:
        """``session``'s state after its latest update, as the periodic checkpoint of that
        update; then only the newest ``keep_last`` are kept. Every process of a distributed
        session calls it (the checkpoint is gathered; the first rank writes)."""
        path = self.at(session.step)
        if not self.background:
            session.save_checkpoint(path)
            self._prune()
            return path
        self.wait()  # one write at a time; its failure is raised here
        files.check_output_path(path, CheckpointError, "checkpoint")
        contents = session.checkpoint_contents(path, copy=True)
        if contents is not None:
            self._writer = threading.Thread(target=self._write, args=(path, contents), daemon=False,
                                            name=f"checkpoint {path.name}")
            self._writer.start()
        return path

    def _write(self, path: Path, contents) -> None:
        try:
            checkpoint.save(path, *contents)
            self._prune()
        except BaseException as exc:  # noqa: BLE001 - raised by the next save or wait
            self._failed = exc

    def wait(self, quiet: bool = False) -> None:
        """Finish the checkpoint being written in the background, if any; its error, if it
        failed (``quiet``: logged instead, where another error is being raised)."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._failed is not None:
            failed, self._failed = self._failed, None
            if not quiet:
                raise failed
            log.warning("the periodic checkpoint written in the background failed too: %s", failed)

    def _prune(self) -> None:
        for old in self.numbered()[: -self.keep_last]:
            old.unlink(missing_ok=True)  # another rank may have removed it first

    def _remove_stale_temporaries(self) -> None:
        """The temporary files of checkpoint writes a killed process never finished."""
        folder = self.path.parent
        if not folder.is_dir():
            return
        for name in os.listdir(folder or "."):
            if name.startswith(f".{self._stem}.") and name.endswith(files.TEMP_SUFFIX):
                (folder / name).unlink(missing_ok=True)
                log.info("removed %s, left by a checkpoint write that did not finish", folder / name)

    def candidates(self) -> list[Path]:
        """Every checkpoint of the run, the most recently written first (each is written whole
        before it appears; a damaged one is reported when it is reached)."""
        paths = self.numbered() + ([self.path] if self.path.is_file() else [])  # ties: the later update first
        order = {p: (p.stat().st_mtime_ns, i) for i, p in enumerate(paths)}
        return sorted(paths, key=order.__getitem__, reverse=True)

    def resume(self, session) -> Path | None:
        """Load the newest complete checkpoint of the run into ``session`` (see
        ``TrainingSession.load_checkpoint``: it changes nothing unless the whole file fits) and
        return its path; one that is damaged is named in a warning and the one before it is
        tried. None when the run has no checkpoint."""
        self._remove_stale_temporaries()
        damaged = []
        for path in self.candidates():
            try:
                session.load_checkpoint(path)
            except CheckpointError as exc:
                warn(f"checkpoint {path} cannot be resumed ({exc}); trying the one before it")
                damaged.append(path)
                continue
            if damaged:
                warn(f"resumed from {path}, the newest complete checkpoint (passed over: "
                     f"{', '.join(map(str, damaged))})")
            return path
        if damaged:
            raise CheckpointError(f"no checkpoint of {self.path} can be resumed: {', '.join(map(str, damaged))} "
                                  "are damaged")
        return None
