"""Execution providers: which ones work here, what a session should use, and session reuse.

onnxruntime-gpu lists ``CUDAExecutionProvider`` and ``TensorrtExecutionProvider`` even on a
machine without their shared libraries, and then silently runs on the CPU. This package
finds out, once per process and without printing anything, which providers really work
(``discovery``), turns a caller's provider request into a list that will run (here:
:func:`resolve_providers`, :func:`device_of`), and keeps one ``InferenceSession`` per model and
configuration so training steps do not rebuild it (``sessions``).

Plugin execution-provider libraries (``onnxruntime.register_execution_provider_library``)
are supported through :func:`register_provider_lib` (``plugins``); their execution providers then
count as known names, are probed like the built-in ones, and get the default options given at
registration. ``build`` holds the build facts (versions, collectives).

Every public name is importable from ``gradbuilder.runtime.providers``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

import onnxruntime as ort

from ...errors import InvalidArgumentError, ProviderError
# The names every caller imports from here, wherever they are defined (CPU, CUDA, options_with,
# tf32_option and collective_backends too, outside __all__ as before).
from .base import CPU, CUDA, lock
from .build import collective_backends, get_build_info, get_version_string, has_collective_ops
from .cuda_kernels import kernel_table_source, nodes_without_cuda_kernel
from .discovery import (
    candidates,
    default_options,
    expand_registration_names,
    first_report,
    forget,
    get_available_providers,
    known_providers,
    tf32_option,
    works,
)
from .plugins import register_provider_lib, unregister_provider_lib
from .sessions import cached_session, clear_training_ep_instances, options_with

__all__ = [
    "cached_session",
    "clear_training_ep_instances",
    "device_of",
    "get_available_providers",
    "get_build_info",
    "kernel_table_source",
    "nodes_without_cuda_kernel",
    "get_version_string",
    "has_collective_ops",
    "register_provider_lib",
    "resolve_providers",
    "unregister_provider_lib",
]

# resolve_providers reads ``works`` through this module's name, so a test may replace it here.


def _normalize(providers, provider_options) -> list[tuple[str, dict]]:
    """onnxruntime's accepted forms as (name, options) pairs; bad shapes are refused."""
    if isinstance(providers, (str, bytes)) or not isinstance(providers, Sequence):
        raise InvalidArgumentError(
            f"providers must be a list of provider names or (name, options) pairs, got {providers!r}"
        )
    if provider_options is not None:
        if isinstance(provider_options, Mapping) or not isinstance(provider_options, Sequence):
            raise InvalidArgumentError(
                "provider_options must be a list of dicts, one per provider, "
                f"got {provider_options!r}"
            )
        if len(provider_options) != len(providers):
            raise InvalidArgumentError(
                f"provider_options has {len(provider_options)} entries but providers has "
                f"{len(providers)}; give one dict per provider"
            )
        if not all(isinstance(p, str) for p in providers):
            raise InvalidArgumentError(
                "when provider_options is given, providers must be plain names; "
                "pass options either as (name, options) pairs or in provider_options, not both"
            )
        pairs = list(zip(providers, provider_options))
    else:
        pairs = []
        for item in providers:
            if isinstance(item, str):
                pairs.append((item, {}))
            elif isinstance(item, Sequence) and len(item) == 2 and isinstance(item[0], str):
                pairs.append((item[0], item[1]))
            else:
                raise InvalidArgumentError(
                    f"provider entry {item!r} is neither a name nor a (name, options) pair"
                )
    result = []
    seen = set()
    for name, options in pairs:
        options = {} if options is None else options
        if not isinstance(options, Mapping):
            raise InvalidArgumentError(f"options for {name} must be a dict, got {options!r}")
        if name in seen:
            raise InvalidArgumentError(f"provider {name} is listed twice; list each provider once")
        seen.add(name)
        result.append((name, {str(k): str(v) for k, v in options.items()}))
    return result


def resolve_providers(providers=None, provider_options=None, allow_tf32: bool = False) -> tuple[list[str], list[dict]]:
    """The providers and options a session should use, as two parallel lists.

    float32 means float32: onnxruntime's CUDA provider computes float32 MatMul, Gemm and
    convolutions in TF32 unless told otherwise (``use_tf32``, on by default there), which
    PyTorch does only when the user opts in. CUDA gets ``use_tf32=0`` unless ``allow_tf32``
    (``TrainingParameters.allow_tf32``) or the caller's own ``use_tf32`` option says otherwise.

    ``providers=None`` means CUDA when it works here, then the CPU. Otherwise
    ``providers`` takes onnxruntime's forms: names, or ``(name, options)`` pairs, or names
    with a parallel ``provider_options`` list. Option keys and values become strings (as
    onnxruntime does) and are merged over a plugin library's default options.

    A name onnxruntime does not know raises :class:`ProviderError`. A known provider that
    does not work here (CUDA without its libraries, say) is dropped with one
    ``RuntimeWarning`` per provider per process. ``"CPUExecutionProvider"`` is appended
    when missing, so the result always ends in a provider that runs.
    """
    if providers is None:
        if provider_options is not None:
            raise InvalidArgumentError("provider_options was given without providers; give both")
        names = [CUDA, CPU] if works(CUDA) else [CPU]
        return names, [default_options(n, allow_tf32) for n in names]

    with lock:
        pairs = _normalize(providers, provider_options)
        known = known_providers()
        for name, _ in pairs:
            if name not in known:
                raise ProviderError(
                    f"unknown execution provider {name!r}; onnxruntime does not know it and no "
                    f"plugin library registered it. Available here: "
                    f"{', '.join(get_available_providers())}"
                )
        pairs = expand_registration_names(pairs)

        usable, dropped = [], []
        for name, options in pairs:
            (usable if works(name) else dropped).append((name, options))
        if not any(name == CPU for name, _ in usable):
            usable.append((CPU, {}))
        runs_on = usable[0][0]
        for name, _ in dropped:
            if first_report(name):
                if name in candidates():
                    reason = "its libraries could not be loaded"
                else:
                    reason = f"this onnxruntime {ort.__version__} build does not include it"
                warnings.warn(
                    f"{name} is not usable on this machine ({reason}); "
                    f"training runs on {runs_on}",
                    RuntimeWarning,
                    stacklevel=2,
                )

    names = [name for name, _ in usable]
    options = [{**default_options(name, allow_tf32), **opts} for name, opts in usable]
    return names, options


def device_of(providers, provider_options=None) -> tuple[str, int]:
    """Where inputs should be placed for a session with these providers:
    ``("cuda", device_id)`` when CUDA comes first, else ``("cpu", 0)``.

    ``providers`` is a list of names or ``(name, options)`` pairs; ``device_id`` is read
    from the CUDA options (the pair's, or ``provider_options[0]``), default 0.
    """
    if not providers:
        return "cpu", 0
    first = providers[0]
    if isinstance(first, str):
        name = first
        options = provider_options[0] if provider_options else {}
    else:
        name, options = first[0], first[1]
    if name != CUDA:
        return "cpu", 0
    raw = (options or {}).get("device_id", 0)
    try:
        return "cuda", int(raw)
    except (TypeError, ValueError):
        raise InvalidArgumentError(
            f"CUDAExecutionProvider option device_id must be an integer, got {raw!r}"
        ) from None


# The CUDA provider's graph capture (TrainingParameters.enable_cuda_graph, runtime.capture).
CUDA_GRAPH = "enable_cuda_graph"


def with_cuda_graph(providers, provider_options) -> list[dict]:
    """``provider_options`` (one dict per provider name) with the CUDA provider's graph capture on."""
    return [{**o, CUDA_GRAPH: "1"} if n == CUDA else dict(o) for n, o in zip(providers, provider_options)]
