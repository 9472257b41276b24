"""DebugOptions and LogLevel, as in onnxruntime-training's ORTModule."""

from __future__ import annotations

import dataclasses
import enum
import logging
import os

from ..errors import InvalidArgumentError

logger = logging.getLogger("gradbuilder.ortmodule")


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
    ORTModule writes, in ``save_path`` (default: the working directory), under its names
    ``<onnx_prefix>_<name>_<mode>.onnx``: ``torch_exported`` (torch's exporter's model),
    ``optimized_pre_grad`` (the model the gradient graph is built from), ``optimized`` (the
    gradient graph, forward and backward in one) and ``execution_model`` (the forward graph
    that runs; ``execution_model_backward`` the backward graph). ``mode`` is ``training`` where
    a backward graph is built, else ``inference``; a later signature of the same mode adds
    ``_<k>`` (k = 2, 3, ...) to the names. ``log_level`` sets the level of the
    ``gradbuilder.ortmodule`` logger; onnxruntime's sessions log at WARNING (or ERROR, FATAL
    when asked for), below it only with ``LogLevel.VERBOSE``: onnxruntime's INFO lines are
    its graph transformers' trace."""

    save_onnx: bool = False
    log_level: LogLevel = LogLevel.WARNING
    onnx_prefix: str = ""
    save_path: str = ""

    def __post_init__(self):
        try:
            self.log_level = LogLevel(self.log_level)
        except ValueError:
            raise InvalidArgumentError(f"DebugOptions: log_level must be a LogLevel, got {self.log_level!r}") from None
        if not isinstance(self.onnx_prefix, str):
            raise InvalidArgumentError(
                f"DebugOptions: onnx_prefix must be a str, got {type(self.onnx_prefix).__name__} "
                f"{self.onnx_prefix!r}, e.g. DebugOptions(save_onnx=True, onnx_prefix='my_model')")
        if self.save_onnx and not self.onnx_prefix:
            raise InvalidArgumentError("DebugOptions: save_onnx=True needs an onnx_prefix to name the files, "
                                       "e.g. DebugOptions(save_onnx=True, onnx_prefix='my_model')")
        if not isinstance(self.save_path, (str, os.PathLike)):
            raise InvalidArgumentError(f"DebugOptions: save_path must be a directory path, got "
                                       f"{type(self.save_path).__name__} {self.save_path!r}")
        if self.save_path and not os.path.isdir(self.save_path):
            raise InvalidArgumentError(f"DebugOptions: save_path '{self.save_path}' is not a directory")

    def path(self, name: str, mode: str, count: int = 1) -> str:
        suffix = f"_{count}" if count > 1 else ""
        return os.path.join(self.save_path or os.getcwd(), f"{self.onnx_prefix}_{name}_{mode}{suffix}.onnx")

    def apply_logging(self) -> None:
        logger.setLevel(self.log_level.python_level)
