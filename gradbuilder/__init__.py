"""gradbuilder: gradient graphs for ONNX models in standard ONNX operators."""

from .builder import GradientGraphBuilder
from .errors import (
    GradBuilderError,
    GradientRuleError,
    InvalidArgumentError,
    InvalidModelError,
    ModelLoadError,
    OutputError,
    UnsupportedOpError,
)

__version__ = "0.1.0"

__all__ = [
    "GradientGraphBuilder",
    "GradBuilderError",
    "GradientRuleError",
    "InvalidArgumentError",
    "InvalidModelError",
    "ModelLoadError",
    "OutputError",
    "UnsupportedOpError",
]
