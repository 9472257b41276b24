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
    """``save_onnx`` writes, for every compiled input signature, the exported model and the
    forward and backward graphs as ``<onnx_prefix>_<n>_{exported,forward,backward}.onnx`` in
    ``save_path`` (default: the working directory); ``log_level`` sets the level of the
    ``gradbuilder.ortmodule`` logger and onnxruntime's session log severity."""

    save_onnx: bool = False
    log_level: LogLevel = LogLevel.WARNING
    onnx_prefix: str = ""
    save_path: str = ""

    def __post_init__(self):
        try:
            self.log_level = LogLevel(self.log_level)
        except ValueError:
            raise InvalidArgumentError(f"DebugOptions: log_level must be a LogLevel, got {self.log_level!r}") from None
        if self.save_onnx and not self.onnx_prefix:
            raise InvalidArgumentError("DebugOptions: save_onnx=True needs an onnx_prefix to name the files, "
                                       "e.g. DebugOptions(save_onnx=True, onnx_prefix='my_model')")
        if self.save_path and not os.path.isdir(self.save_path):
            raise InvalidArgumentError(f"DebugOptions: save_path '{self.save_path}' is not a directory")

    def path(self, name: str) -> str:
        return os.path.join(self.save_path or os.getcwd(), f"{self.onnx_prefix}_{name}.onnx")

    def apply_logging(self) -> None:
        logger.setLevel(self.log_level.python_level)
