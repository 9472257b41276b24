"""Writing files atomically, and checking paths before any long work.

:func:`atomic_write` is the one way gradbuilder writes a file: each target is written to a
temporary file beside it (``.<name>.<random>.tmp``, same directory, so the rename stays on
one file system), flushed to disk, then renamed over the target; on any exception
(KeyboardInterrupt and SystemExit included) the temporary files are removed and the targets
are left as they were. SIGTERM with its default action is turned into a clean-up followed by
the same termination. The renames themselves run with the Python handlers of SIGINT, SIGTERM
and SIGHUP held back until they are done, so a signal never leaves a set of files half
replaced.

:func:`check_output_path`, :func:`check_output_directory` and :func:`check_input_file` turn
a bad path into one line naming it and saying what to do, before the caller starts work.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import threading
from pathlib import Path

from .errors import OutputError

__all__ = ["atomic_write", "check_output_path", "check_output_directory", "check_input_file",
           "output_directory", "TEMP_SUFFIX"]

TEMP_SUFFIX = ".tmp"
_DEFERRED = tuple(s for s in (getattr(signal, n, None) for n in ("SIGINT", "SIGTERM", "SIGHUP")) if s is not None)


def _as_path(path, error, what) -> Path:
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise error(f"{what} must be a path (str or os.PathLike), not {type(path).__name__}")
    path = os.fspath(path)
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if not path:
        raise error(f"{what}: the path is empty; give a file name")
    return Path(path)


def _nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists (os.path.lexists: False on any error)."""
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def _missing_directory(directory: Path, error, what, target: Path):
    """The error for a ``directory`` that is not one: it, or an ancestor, is a file or missing."""
    existing = _nearest_existing(directory)
    if os.path.lexists(existing) and not os.path.isdir(existing):
        return error(f"'{existing}' is a file, not a directory, so {what} '{target}' cannot be written there; "
                     "choose a path in a directory")
    if os.path.isdir(existing) and not os.access(existing, os.X_OK):
        return error(f"directory '{existing}' cannot be searched (permission denied), so {what} '{target}' "
                     "cannot be written; choose a directory you can write in")
    return error(f"directory '{directory}' does not exist; create it first (for {what} '{target}')")


def _temp_name(target: Path) -> Path:
    return target.with_name(f".{target.name[:200]}.{secrets.token_hex(4)}{TEMP_SUFFIX}")


def _create_temp(target: Path, error, what, shown: Path | None = None) -> Path:
    """A new empty file beside ``target`` (mode 0o666 less the umask, as a plain open gives).
    ``shown``: the path the error message names (default ``target``)."""
    for _ in range(100):
        tmp = _temp_name(target)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        except FileExistsError:
            continue
        except OSError as exc:
            raise error(f"cannot create files in directory '{target.parent}' ({exc.strerror or exc}), so {what} "
                        f"'{shown or target}' cannot be written; choose a directory you can write in") from None
        os.close(fd)
        return tmp
    raise error(f"cannot create a temporary file beside {what} '{shown or target}'")  # pragma: no cover


def _probe(directory: Path, error, what, shown: Path) -> None:
    """Create and remove a temporary file in ``directory``: the one test of writability that
    holds for root too (/proc and /sys refuse new files whatever the permission bits say)."""
    tmp = _create_temp(directory / (shown.name or "out"), error, what, shown)
    try:
        os.remove(tmp)
    except OSError:
        pass


def check_output_path(path, error=OutputError, what: str = "output file", probe: bool = True) -> Path:
    """``path`` as a Path, after checking a file can be written there: its directory exists
    (and is one) and accepts new files (``probe``), and the path itself is not a directory.
    Raises ``error`` with one line naming the path otherwise."""
    target = _as_path(path, error, what)
    if os.path.isdir(target):
        raise error(f"{what} '{target}' is a directory; give the path of a file (in it, or elsewhere)")
    directory = target.parent
    if not os.path.isdir(directory):
        raise _missing_directory(directory, error, what, target)
    if probe:
        _probe(directory, error, what, target)
    return target


def check_not_the_input(path, source, error=OutputError, what: str = "output file") -> None:
    """Refuse to write ``path`` over ``source``, the model the caller gave (when it is a path):
    what the caller gives is never modified."""
    if isinstance(source, (str, os.PathLike)) and os.path.exists(path) and os.path.exists(source) \
            and os.path.samefile(path, source):
        raise error(f"{what} '{path}' is the input model '{source}'; write it to another path (the input model is "
                    "never overwritten)")


def check_output_directory(path, error=OutputError, what: str = "output directory") -> Path:
    """``path`` as a Path, after checking it is a directory that accepts new files, or can be
    created: its closest existing ancestor is a directory that accepts new files."""
    directory = _as_path(path, error, what)
    existing = _nearest_existing(directory)
    if os.path.lexists(existing) and not os.path.isdir(existing):
        if existing == directory:
            raise error(f"{what} '{directory}' is a file, not a directory; give a directory (it is created "
                        "if missing)")
        raise error(f"'{existing}' is a file, not a directory, so {what} '{directory}' cannot be created")
    if not os.path.isdir(existing):  # pragma: no cover (the root always exists)
        raise error(f"{what} '{directory}' cannot be created")
    if not os.access(existing, os.X_OK):
        raise error(f"directory '{existing}' cannot be searched (permission denied); choose a directory "
                    f"you can write in for {what} '{directory}'")
    _probe(existing, error, what, directory)
    return directory


def check_input_file(path, error, what: str = "file") -> Path:
    """``path`` as a Path, after checking it names an existing file (not a directory)."""
    source = _as_path(path, error, what)
    if os.path.isdir(source):
        raise error(f"{what} '{source}' is a directory, not a file; give the path of the file")
    if not os.path.exists(source):
        existing = _nearest_existing(source.parent)
        if os.path.lexists(existing) and not os.path.isdir(existing):
            raise error(f"{what} '{source}' not found: '{existing}' is a file, not a directory")
        raise error(f"{what} '{source}' not found")
    return source


@contextlib.contextmanager
def output_directory(path, error=OutputError, what: str = "output directory"):
    """Create ``path`` (and missing parents) for the block; if the block raises, remove the
    directories it created again (those still empty)."""
    directory = check_output_directory(path, error, what)
    created = []
    missing = directory
    while not os.path.lexists(missing) and missing != missing.parent:
        created.append(missing)
        missing = missing.parent
    try:
        for d in reversed(created):
            os.mkdir(d)
    except OSError as exc:
        _remove_dirs(created)
        raise error(f"could not create {what} '{directory}': {exc}") from None
    try:
        yield directory
    except BaseException:
        _remove_dirs(created)
        raise


def _remove_dirs(created) -> None:
    for d in created:  # deepest first
        try:
            os.rmdir(d)
        except OSError:
            pass


class _Terminated(BaseException):
    """SIGTERM arrived while a file was being written (the default action is taken after
    the clean-up)."""


def _on_sigterm(signum, frame):
    raise _Terminated()


@contextlib.contextmanager
def _sigterm_cleans_up():
    """While the block runs in the main thread and SIGTERM has its default action, SIGTERM
    raises _Terminated; after the block's clean-up the process terminates as it would have."""
    sigterm = getattr(signal, "SIGTERM", None)
    if sigterm is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    try:
        if signal.getsignal(sigterm) is not signal.SIG_DFL:
            yield
            return
        signal.signal(sigterm, _on_sigterm)
    except (ValueError, OSError):  # pragma: no cover (no signals here)
        yield
        return
    try:
        yield
    except _Terminated:
        signal.signal(sigterm, signal.SIG_DFL)
        os.kill(os.getpid(), sigterm)
        raise
    finally:
        if signal.getsignal(sigterm) is _on_sigterm:
            signal.signal(sigterm, signal.SIG_DFL)


@contextlib.contextmanager
def _signals_deferred():
    """Run the block with the Python handlers of SIGINT, SIGTERM and SIGHUP (KeyboardInterrupt,
    the clean-up of :func:`_sigterm_cleans_up`, a program's own) held back: a signal that
    arrives meanwhile is handled, by its handler, when the block is over. Python runs signal
    handlers in the main thread only, so elsewhere nothing can interrupt the block anyway."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending, saved = [], {}
    for signum in _DEFERRED:
        handler = signal.getsignal(signum)
        if callable(handler):
            saved[signum] = handler
            signal.signal(signum, lambda signum, frame: pending.append((signum, frame)))
    try:
        yield
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
        for signum, frame in pending:
            saved[signum](signum, frame)


def _fsync(path, flags=os.O_RDONLY) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_directory(directory) -> None:
    """Make the renames durable where the platform allows fsync on a directory."""
    try:
        _fsync(directory)
    except OSError:
        pass


@contextlib.contextmanager
def atomic_write(*targets, error=OutputError, what: str = "file"):
    """Yield one temporary path per target (empty files beside each) for the block to write;
    when the block returns, each is flushed to disk and renamed over its target, in order.

    Nothing appears at a target unless the whole block succeeds: on any exception the
    temporary files are removed, and OSError becomes ``error`` naming the target. The
    targets' directories are checked first (:func:`check_output_path`).
    """
    paths = [check_output_path(t, error, what, probe=False) for t in targets]
    temps: list[Path] = []
    with _sigterm_cleans_up():
        try:
            for target in paths:
                temps.append(_create_temp(target, error, what))
            yield list(temps)
            for tmp in temps:
                _fsync(tmp)
            with _signals_deferred():
                while temps:
                    os.replace(temps[0], paths[len(paths) - len(temps)])
                    temps.pop(0)
            for directory in dict.fromkeys(p.parent for p in paths):
                _fsync_directory(directory)
        except OSError as exc:
            where = f"'{paths[0]}'" if len(paths) == 1 else f"in '{paths[0].parent}'"
            raise error(f"could not write {what} {where}: {exc}") from exc
        finally:
            for tmp in temps:
                try:
                    os.remove(tmp)
                except OSError:
                    pass
