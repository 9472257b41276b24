"""gradbuilder: gradient graphs for ONNX models in standard ONNX operators."""

from pathlib import Path as _Path

# The per-op rules live in the top-level folder rules/, which the wheel installs as
# gradbuilder.rules. In a source checkout (tests run against it) that folder sits beside
# this package, so it is added to the package's search path for gradbuilder.rules to resolve.
_here = _Path(__file__).resolve().parent
if not (_here / "rules").is_dir() and (_here.parent / "rules" / "__init__.py").is_file():
    __path__.append(str(_here.parent))

from .builder import GradientGraphBuilder
from .params import TrainingParameters
from .training import TrainingGraphBuilder
from .session import TrainingSession, TrainingIOBinding
from .providers import (
    clear_training_ep_instances,
    get_available_providers,
    get_build_info,
    get_version_string,
    has_collective_ops,
    register_provider_lib,
)
from .registry import Emitter, register_stop_gradient_edges
from .registry import register as register_gradient
from .errors import (
    CheckpointError,
    GradBuilderError,
    GradientRuleError,
    InvalidArgumentError,
    InvalidModelError,
    ModelLoadError,
    NonFiniteError,
    OutputError,
    ProviderError,
    UnsupportedOpError,
)

__version__ = "0.1.0"



def register_gradient_definition(domain: str, op_type: str, rule, since: int = 1) -> None:
    """Register ``rule(node, dys, needs, e)`` as the gradient of ``op_type`` in ``domain``
    (function form of the ``register_gradient`` decorator; a later registration replaces
    an earlier one for the same opset)."""
    register_gradient(op_type, domain=domain, since=since)(rule)


def register_custom_stop_gradient_edges(edges, op_type: str, domain: str = "") -> None:
    """No gradient flows through inputs ``edges`` (indices) of any ``op_type`` node."""
    register_stop_gradient_edges(edges, op_type, domain)


__all__ = [
    "GradientGraphBuilder",
    "TrainingGraphBuilder",
    "TrainingParameters",
    "TrainingSession",
    "TrainingIOBinding",
    "get_available_providers",
    "clear_training_ep_instances",
    "register_provider_lib",
    "has_collective_ops",
    "get_version_string",
    "get_build_info",
    "Emitter",
    "register_gradient",
    "register_gradient_definition",
    "register_custom_stop_gradient_edges",
    "GradBuilderError",
    "GradientRuleError",
    "InvalidArgumentError",
    "InvalidModelError",
    "ModelLoadError",
    "NonFiniteError",
    "OutputError",
    "ProviderError",
    "CheckpointError",
    "UnsupportedOpError",
]
