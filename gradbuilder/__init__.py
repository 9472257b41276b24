"""gradbuilder: gradient graphs for ONNX models in standard ONNX operators."""

from pathlib import Path as _Path

# The per-op rules live in the top-level folder rules/, which the wheel installs as
# gradbuilder.rules. In a source checkout (tests run against it) that folder sits beside
# this package, so it is added to the package's search path for gradbuilder.rules to resolve.
_here = _Path(__file__).resolve().parent
if not (_here / "rules").is_dir() and (_here.parent / "rules" / "__init__.py").is_file():
    __path__.append(str(_here.parent))

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
