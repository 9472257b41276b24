"""gradbuilder: gradient graphs for ONNX models in standard ONNX operators."""

from importlib import import_module as _import_module
from typing import TYPE_CHECKING

# The public names, imported on first use (PEP 562): `import gradbuilder` and the command
# line's --help and --version do not load onnx, onnxruntime or numpy. ``__version__`` too is
# read on first use (importlib.metadata costs more than the rest of `gradbuilder --help`).
_PUBLIC = {
    "GradientGraphBuilder": ".compiler.builder",
    "TrainingParameters": ".training.params",
    "TrainingGraphBuilder": ".training.graph",
    "state_interface": ".training.graph",
    "generate_artifacts": ".training.artifacts",
    "export_model_for_inferencing": ".training.artifacts",
    "add_lora": ".training.lora",
    "lora_parameters": ".training.lora",
    "merge_lora": ".training.lora",
    "write_adapter": ".training.lora",
    "TrainingSession": ".runtime.session",
    "TrainingIOBinding": ".runtime.session",
    "clear_training_ep_instances": ".runtime.providers",
    "get_available_providers": ".runtime.providers",
    "get_build_info": ".runtime.providers",
    "get_version_string": ".runtime.providers",
    "has_collective_ops": ".runtime.providers",
    "register_provider_lib": ".runtime.providers",
    "Emitter": ".compiler.emitter",
    "register_stop_gradient_edges": ".compiler.registry",
    "register_gradient": (".compiler.registry", "register"),
    "CheckpointError": ".errors",
    "DistributedError": ".errors",
    "ExportError": ".errors",
    "GradBuilderError": ".errors",
    "GradientRuleError": ".errors",
    "InvalidArgumentError": ".errors",
    "InvalidModelError": ".errors",
    "MissingDependencyError": ".errors",
    "ModelLoadError": ".errors",
    "NonFiniteError": ".errors",
    "OutputError": ".errors",
    "ProviderError": ".errors",
    "UnsupportedOpError": ".errors",
}

if TYPE_CHECKING:
    from .compiler.builder import GradientGraphBuilder
    from .errors import (
        CheckpointError,
        DistributedError,
        ExportError,
        GradBuilderError,
        GradientRuleError,
        InvalidArgumentError,
        InvalidModelError,
        MissingDependencyError,
        ModelLoadError,
        NonFiniteError,
        OutputError,
        ProviderError,
        UnsupportedOpError,
    )
    from .training.lora import add_lora, lora_parameters, merge_lora, write_adapter
    from .training.params import TrainingParameters
    from .runtime.providers import (
        clear_training_ep_instances,
        get_available_providers,
        get_build_info,
        get_version_string,
        has_collective_ops,
        register_provider_lib,
    )
    from .compiler.emitter import Emitter
    from .compiler.registry import register as register_gradient
    from .runtime.session import TrainingIOBinding, TrainingSession
    from .training.artifacts import export_model_for_inferencing, generate_artifacts
    from .training.graph import TrainingGraphBuilder, state_interface


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("gradbuilder")  # pyproject.toml's version, the one place it is written
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


def __getattr__(name: str):
    if name == "__version__":
        globals()[name] = value = _version()
        return value
    where = _PUBLIC.get(name)
    if where is None:
        raise AttributeError(f"module 'gradbuilder' has no attribute '{name}'")
    module, attr = (where, name) if isinstance(where, str) else where
    value = getattr(_import_module(module, __name__), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC) | {"__version__"})


def register_gradient_definition(domain: str, op_type: str, rule, since: int = 1) -> None:
    """Register ``rule(node, dys, needs, e)`` as the gradient of ``op_type`` in ``domain``
    (function form of the ``register_gradient`` decorator; a later registration replaces
    an earlier one for the same opset)."""
    from .compiler.registry import register

    register(op_type, domain=domain, since=since)(rule)


def register_custom_stop_gradient_edges(edges, op_type: str, domain: str = "") -> None:
    """No gradient flows through inputs ``edges`` (indices) of any ``op_type`` node."""
    from .compiler.registry import register_stop_gradient_edges

    register_stop_gradient_edges(edges, op_type, domain)


__all__ = [
    "GradientGraphBuilder",
    "TrainingGraphBuilder",
    "state_interface",
    "generate_artifacts",
    "export_model_for_inferencing",
    "add_lora",
    "lora_parameters",
    "merge_lora",
    "write_adapter",
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
    "DistributedError",
    "ExportError",
    "MissingDependencyError",
]
