"""Session reuse: one ``InferenceSession`` per model and configuration, so training steps do not
rebuild it, and SessionOptions copied with changes."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import onnxruntime as ort

from ...errors import InvalidArgumentError
from .base import lock

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

_sessions: dict[tuple, ort.InferenceSession] = {}
_held: dict[tuple, tuple] = {}  # key -> the arrays its ids name, alive as long as the entry (no id reused)


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
                   disabled_optimizers: Sequence[str] = (), externals: dict | None = None) -> ort.InferenceSession:
    """One ``InferenceSession`` per model and configuration, reused across calls.
    ``externals``: {name: array} of the tensors ``model_bytes`` refers to in memory
    (``DetachedModel.in_memory``), given as external initializers (the arrays themselves are
    part of the key: another array of the same name is another session).

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
        options = sess_options
        if externals:  # on a copy: the caller's options stay as they were
            options = options_with(sess_options)
            options.add_external_initializers(list(externals), [ort.OrtValue.ortvalue_from_numpy(
                np.ascontiguousarray(a)) for a in externals.values()])
        kwargs = {} if options is None else {"sess_options": options}
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
        tuple((name, id(array)) for name, array in (externals or {}).items()),
    )
    with lock:
        session = _sessions.get(key)
        if session is None:
            session = _sessions[key] = create()
            _held[key] = tuple((externals or {}).values())
        return session


def clear_training_ep_instances() -> None:
    """Forget every cached session (they are freed once nothing else holds them)."""
    with lock:
        _sessions.clear()
        _held.clear()


def cached_count() -> int:
    """How many sessions the cache holds."""
    with lock:
        return len(_sessions)


def drop_sessions_of(names) -> None:
    """Forget the cached sessions that use any of the providers ``names``."""
    with lock:
        for key in [k for k in _sessions if set(names).intersection(k[1])]:
            del _sessions[key]
            _held.pop(key, None)
