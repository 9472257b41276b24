"""Execution providers: which ones work here, what a session should use, and session reuse.

onnxruntime-gpu lists ``CUDAExecutionProvider`` and ``TensorrtExecutionProvider`` even on a
machine without their shared libraries, and then silently runs on the CPU. This module
finds out, once per process and without printing anything, which providers really work,
turns a caller's provider request into a list that will run, and keeps one
``InferenceSession`` per model and configuration so training steps do not rebuild it.

Plugin execution-provider libraries (``onnxruntime.register_execution_provider_library``)
are supported through :func:`register_provider_lib`; their execution providers then count
as known names, are probed like the built-in ones, and get the default options given at
registration.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import threading
import warnings
from collections.abc import Mapping, Sequence

import onnxruntime as ort
from onnx import TensorProto, helper

from ..errors import InvalidArgumentError, ProviderError

__all__ = [
    "cached_session",
    "clear_training_ep_instances",
    "device_of",
    "get_available_providers",
    "get_build_info",
    "get_version_string",
    "has_collective_ops",
    "register_provider_lib",
    "resolve_providers",
    "unregister_provider_lib",
]

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"

# Providers that cannot be checked with a plain session. The Azure provider only runs
# nodes of its own remote-inference operators and needs no local libraries, so a plain
# model never lands on it: it is taken as usable exactly when onnxruntime lists it.
_UNPROBED = frozenset({"AzureExecutionProvider"})

# onnxruntime's default logger severity (2: warning). It has no getter, so this is what
# the probe restores.
_DEFAULT_LOGGER_SEVERITY = 2

# SessionOptions attributes that change what a session computes or how it runs.
_OPTION_ATTRIBUTES = (
    "graph_optimization_level",
    "intra_op_num_threads",
    "inter_op_num_threads",
    "execution_mode",
    "execution_order",
    "enable_cpu_mem_arena",
    "enable_mem_pattern",
    "enable_mem_reuse",
    "enable_profiling",
    "profile_file_prefix",
    "log_severity_level",
    "log_verbosity_level",
    "logid",
    "optimized_model_filepath",
    "use_deterministic_compute",
    "use_per_session_threads",
)

# Session configuration keys read into the cache key. SessionOptions cannot list its
# entries, only look one up, so these are the keys onnxruntime 1.31 knows of.
_CONFIG_KEYS = (
    "ep.context_embed_mode",
    "ep.context_enable",
    "ep.context_file_path",
    "ep.context_model_external_initializers_file_name",
    "ep.enable_weightless",
    "mlas.disable_kle",
    "mlas.qnbit.force_fp32",
    "mlas.use_lut_gemm",
    "optimization.constant_folding_max_output_size_in_bytes",
    "optimization.disable_specified_optimizers",
    "optimization.enable_cast_chain_elimination",
    "optimization.enable_gelu_approximation",
    "optimization.minimal_build_optimizations",
    "session.disable_aot_function_inlining",
    "session.disable_cpu_ep_fallback",
    "session.disable_double_qdq_remover",
    "session.disable_model_compile",
    "session.disable_prepacking",
    "session.disable_qdq_constant_folding",
    "session.disable_quant_qdq",
    "session.dynamic_block_base",
    "session.enable_quant_qdq_cleanup",
    "session.force_spinning_stop",
    "session.graph_optimizations_loop_level",
    "session.inter_op.allow_spinning",
    "session.intra_op.allow_spinning",
    "session.intra_op_thread_affinities",
    "session.load_model_format",
    "session.node_partition_config_file",
    "session.optimized_model_external_initializers_file_name",
    "session.optimized_model_external_initializers_min_size_in_bytes",
    "session.qdqisint8allowed",
    "session.set_denormal_as_zero",
    "session.strict_shape_type_inference",
    "session.use_device_allocator_for_initializers",
    "session.use_env_allocators",
    "session.x64quantprecision",
)

_lock = threading.RLock()
_probe_results: dict[str, bool] = {}  # provider name -> works here
_warned: set[str] = set()  # providers already reported as unusable
_sessions: dict[tuple, ort.InferenceSession] = {}
_plugin_libs: dict[str, dict] = {}  # registration name -> {"path", "ep_names", "defaults"}


# ---------------------------------------------------------------- discovery


@contextlib.contextmanager
def _quiet():
    """Silence onnxruntime while probing: its logger, Python warnings, and the C-level
    stdout/stderr (library-load errors are sometimes written there directly).

    The descriptors are process-wide, so other threads' output is lost for the moment
    a probe takes; probes run at most once per provider per process.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    saved = []
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            try:
                saved.append((fd, os.dup(fd)))
            except OSError:  # that descriptor is closed: nothing to silence
                continue
            os.dup2(devnull, fd)
        ort.set_default_logger_severity(4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        ort.set_default_logger_severity(_DEFAULT_LOGGER_SEVERITY)
        for fd, copy in saved:
            os.dup2(copy, fd)
            os.close(copy)
        os.close(devnull)


def _probe_model() -> bytes:
    """A one-node Identity model that any execution provider can take."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    return model.SerializeToString()


def _probe(name: str) -> bool:
    """Whether a session asked for ``name`` really gets it (onnxruntime falls back to the
    CPU without saying so when a provider's libraries are missing)."""
    options = ort.SessionOptions()
    options.log_severity_level = 4
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 1
    with _quiet():
        try:
            session = ort.InferenceSession(
                _probe_model(),
                sess_options=options,
                providers=[name, CPU],
                provider_options=[_default_options(name), {}],
                enable_fallback=0,
            )
            return name in session.get_providers()
        except Exception:
            return False


def _plugin_ep_names() -> list[str]:
    """Execution providers of the registered plugin libraries, in registration order."""
    names = []
    for registration, lib in _plugin_libs.items():
        names.extend(n for n in lib["ep_names"] or [registration] if n not in names)
    return names


def _candidates() -> list[str]:
    """Non-CPU providers worth probing, in onnxruntime's priority order, plugins after."""
    names = [n for n in ort.get_available_providers() if n != CPU]
    names.extend(n for n in _plugin_ep_names() if n not in names and n != CPU)
    return names


def _works(name: str) -> bool:
    """Whether ``name`` works here; probed once per process. Providers this onnxruntime
    build does not list (and no plugin library provides) do not work and are not probed."""
    if name == CPU:
        return True
    with _lock:
        if name not in _probe_results:
            if name not in _candidates():
                return False
            if name in _UNPROBED:
                _probe_results[name] = name in ort.get_available_providers()
            else:
                _probe_results[name] = _probe(name)
        return _probe_results[name]


def get_available_providers() -> list[str]:
    """The execution providers that actually work here, in onnxruntime's priority order,
    always ending with ``"CPUExecutionProvider"``.

    Each non-CPU provider listed by onnxruntime (and each provider of a registered plugin
    library) is checked once per process by creating a tiny session with it; the check
    prints nothing. ``"AzureExecutionProvider"`` cannot be checked that way and counts as
    available exactly when onnxruntime lists it.
    """
    with _lock:
        return [n for n in _candidates() if _works(n)] + [CPU]


def _known_providers() -> list[str]:
    """Every name onnxruntime could know: its built-in list plus registered plugins."""
    names = list(ort.get_all_providers())
    for registration, lib in _plugin_libs.items():
        names.extend(n for n in [registration, *lib["ep_names"]] if n not in names)
    return names


# ---------------------------------------------------------------- resolution


def tf32_option(allow_tf32: bool) -> dict:
    """The CUDA provider option that keeps float32 products in float32 (or allows TF32)."""
    return {"use_tf32": "1" if allow_tf32 else "0"}


def _default_options(name: str, allow_tf32: bool = False) -> dict:
    """Default options of a provider: CUDA's TF32 setting, a plugin provider's options given
    to :func:`register_provider_lib`."""
    if name == CUDA:
        return tf32_option(allow_tf32)
    for registration, lib in _plugin_libs.items():
        if name == registration or name in lib["ep_names"]:
            return dict(lib["defaults"])
    return {}


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


def _expand_registration_names(pairs: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """A plugin's registration name stands for its execution providers when they differ."""
    out = []
    for name, options in pairs:
        lib = _plugin_libs.get(name)
        if lib and lib["ep_names"] and name not in lib["ep_names"]:
            out.extend((ep, options) for ep in lib["ep_names"] if ep not in dict(out))
        else:
            out.append((name, options))
    return out


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
        names = [CUDA, CPU] if _works(CUDA) else [CPU]
        return names, [_default_options(n, allow_tf32) for n in names]

    with _lock:
        pairs = _normalize(providers, provider_options)
        known = _known_providers()
        for name, _ in pairs:
            if name not in known:
                raise ProviderError(
                    f"unknown execution provider {name!r}; onnxruntime does not know it and no "
                    f"plugin library registered it. Available here: "
                    f"{', '.join(get_available_providers())}"
                )
        pairs = _expand_registration_names(pairs)

        usable, dropped = [], []
        for name, options in pairs:
            (usable if _works(name) else dropped).append((name, options))
        if not any(name == CPU for name, _ in usable):
            usable.append((CPU, {}))
        runs_on = usable[0][0]
        for name, _ in dropped:
            if name not in _warned:
                _warned.add(name)
                if name in _candidates():
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
    options = [{**_default_options(name, allow_tf32), **opts} for name, opts in usable]
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


# ---------------------------------------------------------------- session cache


def _options_fingerprint(sess_options) -> tuple:
    """The readable SessionOptions settings, as a hashable tuple.

    Settings onnxruntime does not let us read back (custom-op libraries, initializers
    added with ``add_initializer``, free-dimension overrides, configuration keys outside
    ``_CONFIG_KEYS``) are not part of it.
    """
    if sess_options is None:
        sess_options = ort.SessionOptions()
    items = [(attr, str(getattr(sess_options, attr))) for attr in _OPTION_ATTRIBUTES]
    items.extend(_config_entries(sess_options))
    items.append(("has_providers", str(sess_options.has_providers())))
    return tuple(items)


def _config_entries(sess_options):
    """(key, value) of the configuration keys of ``_CONFIG_KEYS`` set on ``sess_options``."""
    for key in _CONFIG_KEYS:
        try:
            yield key, sess_options.get_session_config_entry(key)
        except Exception:  # not set
            pass


def options_with(sess_options, **settings) -> ort.SessionOptions:
    """A new ``SessionOptions`` with the readable settings of ``sess_options`` (attributes and
    the configuration keys of ``_CONFIG_KEYS``) and then ``settings``; ``sess_options`` is
    left as it was."""
    out = ort.SessionOptions()
    if sess_options is not None:
        for attr in _OPTION_ATTRIBUTES:
            setattr(out, attr, getattr(sess_options, attr))
        for key, value in _config_entries(sess_options):
            out.add_session_config_entry(key, value)
    for attr, value in settings.items():
        setattr(out, attr, value)
    return out


def cached_session(model_bytes: bytes, sess_options, providers, provider_options,
                   disabled_optimizers: Sequence[str] = ()) -> ort.InferenceSession:
    """One ``InferenceSession`` per model and configuration, reused across calls.

    The key is the sha256 of ``model_bytes``, the providers, their options, the
    SessionOptions settings that can be read back (see ``_options_fingerprint``) and the
    onnxruntime graph optimizers to leave out (``disabled_optimizers``). Pass
    providers already resolved by :func:`resolve_providers`. Sessions with profiling
    enabled are created fresh every time and never cached, so each run has its own
    profile. Thread-safe.
    """
    if not isinstance(model_bytes, (bytes, bytearray)):
        raise InvalidArgumentError(f"model_bytes must be bytes, got {type(model_bytes).__name__}")
    providers = list(providers)
    if not all(isinstance(p, str) for p in providers):
        raise InvalidArgumentError(
            f"cached_session takes provider names (see resolve_providers), got {providers!r}"
        )
    provider_options = [dict(o or {}) for o in (provider_options or [{} for _ in providers])]
    if len(provider_options) != len(providers):
        raise InvalidArgumentError(
            f"provider_options has {len(provider_options)} entries but providers has "
            f"{len(providers)}; give one dict per provider"
        )

    def create():
        kwargs = {} if sess_options is None else {"sess_options": sess_options}
        if disabled_optimizers:
            kwargs["disabled_optimizers"] = list(disabled_optimizers)
        return ort.InferenceSession(
            bytes(model_bytes), providers=providers, provider_options=provider_options, **kwargs
        )

    if sess_options is not None and sess_options.enable_profiling:
        return create()
    key = (
        hashlib.sha256(model_bytes).hexdigest(),
        tuple(providers),
        tuple(tuple(sorted((str(k), str(v)) for k, v in o.items())) for o in provider_options),
        _options_fingerprint(sess_options),
        tuple(sorted(disabled_optimizers)),
    )
    with _lock:
        session = _sessions.get(key)
        if session is None:
            session = _sessions[key] = create()
        return session


def clear_training_ep_instances() -> None:
    """Forget every cached session (they are freed once nothing else holds them)."""
    with _lock:
        _sessions.clear()


# ---------------------------------------------------------------- plugin libraries


def register_provider_lib(name: str, shared_lib_path: str, default_options: dict | None = None) -> None:
    """Register a plugin execution-provider library with onnxruntime under ``name``.

    Its execution providers (and ``name`` itself) then count as known provider names, are
    probed like the built-in ones, and get ``default_options`` under any options a caller
    gives. A missing file or a library onnxruntime cannot load raises
    :class:`ProviderError`.
    """
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"a plugin library needs a non-empty name, got {name!r}")
    if default_options is not None and not isinstance(default_options, Mapping):
        raise InvalidArgumentError(f"default_options must be a dict, got {default_options!r}")
    # onnxruntime resolves relative paths against its own folder, so make it absolute.
    path = os.path.abspath(os.fspath(shared_lib_path))
    if not os.path.isfile(path):
        raise ProviderError(f"execution provider library {path} does not exist")
    with _lock:
        if name in _plugin_libs:
            raise ProviderError(
                f"a plugin library is already registered as {name!r} "
                f"({_plugin_libs[name]['path']}); unregister it first"
            )
        before = {d.ep_name for d in ort.get_ep_devices()}
        try:
            ort.register_execution_provider_library(name, path)
        except Exception as exc:
            raise ProviderError(
                f"onnxruntime could not register execution provider library {path} as "
                f"{name!r}: {exc}"
            ) from exc
        ep_names = []
        for device in ort.get_ep_devices():
            if device.ep_name not in before and device.ep_name not in ep_names:
                ep_names.append(device.ep_name)
        _plugin_libs[name] = {
            "path": path,
            "ep_names": ep_names,
            "defaults": {str(k): str(v) for k, v in (default_options or {}).items()},
        }
        for ep in [name, *ep_names]:
            _probe_results.pop(ep, None)
            _warned.discard(ep)


def unregister_provider_lib(name: str) -> None:
    """Unregister a plugin library registered with :func:`register_provider_lib`.

    Cached sessions using its providers are dropped first; sessions held elsewhere must
    be released before calling this (onnxruntime requires it).
    """
    with _lock:
        lib = _plugin_libs.get(name)
        if lib is None:
            registered = ", ".join(_plugin_libs) or "none"
            raise ProviderError(
                f"no plugin library is registered as {name!r} (registered: {registered})"
            )
        names = {name, *lib["ep_names"]}
        for key in [k for k in _sessions if names.intersection(k[1])]:
            del _sessions[key]
        try:
            ort.unregister_execution_provider_library(name)
        except Exception as exc:
            raise ProviderError(
                f"onnxruntime could not unregister execution provider library {name!r}: {exc}"
            ) from exc
        del _plugin_libs[name]
        for ep in names:
            _probe_results.pop(ep, None)
            _warned.discard(ep)


# ---------------------------------------------------------------- build facts


def collective_backends() -> list[str]:
    """The torch.distributed backends usable here ("gloo", "nccl"): distributed training
    runs on them (``gradbuilder.runtime.distributed``). Empty without torch."""
    try:
        import torch.distributed as dist
    except ImportError:
        return []
    if not dist.is_available():
        return []
    return [name for name, usable in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available()))
            if usable]


def has_collective_ops() -> bool:
    """Whether distributed training can run: torch.distributed with a usable backend is
    importable (the graphs themselves hold no collective op: the gradients are reduced
    between the graph runs)."""
    return bool(collective_backends())


def _gradbuilder_version() -> str:
    from .. import __version__  # imported late: the package imports this module

    return __version__


def _ort_version() -> str:
    fn = getattr(ort, "get_version_string", None)
    return fn() if fn is not None else ort.__version__


def get_version_string() -> str:
    """gradbuilder's version, bare, as ``onnxruntime.get_version_string()`` gives its own:
    ``"0.1.0"``."""
    return _gradbuilder_version()


def get_build_info() -> str:
    """gradbuilder's version, the onnxruntime it runs on and onnxruntime's own build
    information (``onnxruntime.get_build_info()``: git commit, build type), e.g.
    ``"gradbuilder 0.1.0 on onnxruntime 1.31.1; collectives: torch.distributed (gloo); ORT
    Build Info: git-branch=..."``."""
    fn = getattr(ort, "get_build_info", None)
    info = fn() if fn is not None else "build info not available"
    backends = collective_backends()
    collectives = f"torch.distributed ({', '.join(backends)})" if backends else "none (install torch)"
    return f"gradbuilder {get_version_string()} on onnxruntime {_ort_version()}; collectives: {collectives}; {info}"
