"""gradbuilder: gradient graphs for ONNX models in standard ONNX operators."""

from pathlib import Path as _Path

# The per-op rules live in the top-level folder rules/, which the wheel installs as
# gradbuilder.rules. In a source checkout (tests run against it) that folder sits beside
# this package, so it is added to the package's search path for gradbuilder.rules to resolve.
_here = _Path(__file__).resolve().parent
if not (_here / "rules").is_dir() and (_here.parent / "rules" / "__init__.py").is_file():
    __path__.append(str(_here.parent))

from importlib import import_module as _import_module
from importlib import metadata as _metadata
from typing import TYPE_CHECKING

try:
    __version__ = _metadata.version("gradbuilder")  # pyproject.toml's version, the one place it is written
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

# The public names, imported on first use (PEP 562): `import gradbuilder` and the command
# line's --help and --version do not load onnx, onnxruntime or numpy.
_PUBLIC = {
    "GradientGraphBuilder": ".builder",
    "TrainingParameters": ".params",
    "TrainingGraphBuilder": ".training",
    "state_interface": ".training",
    "TrainingSession": ".session",
    "TrainingIOBinding": ".session",
    "clear_training_ep_instances": ".providers",
    "get_available_providers": ".providers",
    "get_build_info": ".providers",
    "get_version_string": ".providers",
    "has_collective_ops": ".providers",
    "register_provider_lib": ".providers",
    "Emitter": ".registry",
    "register_stop_gradient_edges": ".registry",
    "register_gradient": (".registry", "register"),
    "CheckpointError": ".errors",
    "GradBuilderError": ".errors",
    "GradientRuleError": ".errors",
    "InvalidArgumentError": ".errors",
    "InvalidModelError": ".errors",
    "ModelLoadError": ".errors",
    "NonFiniteError": ".errors",
    "OutputError": ".errors",
    "ProviderError": ".errors",
    "UnsupportedOpError": ".errors",
}

if TYPE_CHECKING:
    from .builder import GradientGraphBuilder
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
    from .params import TrainingParameters
    from .providers import (
        clear_training_ep_instances,
        get_available_providers,
        get_build_info,
        get_version_string,
        has_collective_ops,
        register_provider_lib,
    )
    from .registry import Emitter
    from .registry import register as register_gradient
    from .session import TrainingIOBinding, TrainingSession
    from .training import TrainingGraphBuilder, state_interface


def __getattr__(name: str):
    where = _PUBLIC.get(name)
    if where is None:
        raise AttributeError(f"module 'gradbuilder' has no attribute '{name}'")
    module, attr = (where, name) if isinstance(where, str) else where
    value = getattr(_import_module(module, __name__), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


def register_gradient_definition(domain: str, op_type: str, rule, since: int = 1) -> None:
    """Register ``rule(node, dys, needs, e)`` as the gradient of ``op_type`` in ``domain``
    (function form of the ``register_gradient`` decorator; a later registration replaces
    an earlier one for the same opset)."""
    from .registry import register

    register(op_type, domain=domain, since=since)(rule)


def register_custom_stop_gradient_edges(edges, op_type: str, domain: str = "") -> None:
    """No gradient flows through inputs ``edges`` (indices) of any ``op_type`` node."""
    from .registry import register_stop_gradient_edges

    register_stop_gradient_edges(edges, op_type, domain)


__all__ = [
    "GradientGraphBuilder",
    "TrainingGraphBuilder",
    "state_interface",
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
