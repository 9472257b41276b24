"""DebugOptions and LogLevel, as in onnxruntime-training's ORTModule."""

from __future__ import annotations

import dataclasses
import enum
import logging
import os

from ..errors import InvalidArgumentError

logger = logging.getLogger("gradbuilder.ortmodule")


# Where save_onnx writes when save_path is not given (else the working directory), as in
# onnxruntime-training.
SAVE_PATH_VARIABLE = "ORTMODULE_SAVE_ONNX_PATH"


class LogLevel(enum.IntEnum):
    """How much ORTModule and onnxruntime log; the values are onnxruntime's severities."""

    VERBOSE = 0
    INFO = 1
    WARNING = 2
    ERROR = 3
    FATAL = 4

    @property
    def python_level(self) -> int:
        return {0: logging.DEBUG, 1: logging.INFO, 2: logging.WARNING, 3: logging.ERROR, 4: logging.CRITICAL}[self]


@dataclasses.dataclass
class DebugOptions:
    """``save_onnx`` writes, for every compiled input signature, the files onnxruntime-training's
    ORTModule writes, in ``save_path`` (default: the directory in the environment variable
    ``ORTMODULE_SAVE_ONNX_PATH``, else the working directory), under its names
    ``<onnx_prefix>_<name>_<mode>.onnx``: ``torch_exported`` (torch's exporter's model),
    ``optimized_pre_grad`` (the model the gradient graph is built from), ``optimized`` (the
    gradient graph, forward and backward in one) and ``execution_model`` (the forward graph
    that runs; ``execution_model_backward`` the backward graph). ``mode`` is ``training`` for a
    call in training mode with grad enabled, else ``inference``; a later signature of the same mode adds
    ``_<k>`` (k = 2, 3, ...) to the names. ``log_level`` sets the level of the
    ``gradbuilder.ortmodule`` logger; onnxruntime's sessions log at WARNING (or ERROR, FATAL
    when asked for), below it only with ``LogLevel.VERBOSE``: onnxruntime's INFO lines are
    its graph transformers' trace."""

    save_onnx: bool = False
    log_level: LogLevel = LogLevel.WARNING
    onnx_prefix: str = ""
    save_path: str = ""

    def __post_init__(self):
        if not isinstance(self.log_level, LogLevel):
            try:
                self.log_level = LogLevel(self.log_level)
            except ValueError:
                raise InvalidArgumentError(
                    f"DebugOptions: Expected log_level of type LogLevel, got {type(self.log_level)}. "
                    f"({self.log_level!r}; e.g. log_level=LogLevel.INFO)") from None
        if not isinstance(self.onnx_prefix, str):
            raise InvalidArgumentError(
                f"DebugOptions: Expected name prefix of type str, got {type(self.onnx_prefix)}. "
                f"({self.onnx_prefix!r}; e.g. DebugOptions(save_onnx=True, onnx_prefix='my_model'))")
        if self.save_onnx and not self.onnx_prefix:
            raise InvalidArgumentError("DebugOptions: onnx_prefix must be provided when save_onnx is set. It names "
                                       "the files, e.g. DebugOptions(save_onnx=True, onnx_prefix='my_model')")
        if not isinstance(self.save_path, (str, os.PathLike)):
            raise InvalidArgumentError(f"DebugOptions: save_path must be a directory path, got "
                                       f"{type(self.save_path).__name__} {self.save_path!r}")
        if not self.save_path and os.environ.get(SAVE_PATH_VARIABLE):
            self.save_path = os.environ[SAVE_PATH_VARIABLE]
        directory = self.save_path or os.getcwd()
        if self.save_onnx and not (os.path.isdir(directory) and os.access(directory, os.W_OK)):
            where = f" (from {SAVE_PATH_VARIABLE})" if os.environ.get(SAVE_PATH_VARIABLE) == self.save_path else ""
            raise InvalidArgumentError(f"DebugOptions: Directory {directory} is not writable.{where} Give "
                                       "save_path a directory that exists and can be written")
        elif self.save_path and not os.path.isdir(self.save_path):
            raise InvalidArgumentError(f"DebugOptions: save_path '{self.save_path}' is not a directory")

    def path(self, name: str, mode: str, count: int = 1) -> str:
        suffix = f"_{count}" if count > 1 else ""
        return os.path.join(self.save_path or os.getcwd(), f"{self.onnx_prefix}_{name}_{mode}{suffix}.onnx")

    def apply_logging(self) -> None:
        logger.setLevel(self.log_level.python_level)
