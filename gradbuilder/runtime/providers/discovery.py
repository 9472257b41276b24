"""Which execution providers work here, found out once per process without printing anything.

onnxruntime-gpu lists ``CUDAExecutionProvider`` and ``TensorrtExecutionProvider`` even on a
machine without their shared libraries, and then silently runs on the CPU: each provider
onnxruntime lists (and each of a registered plugin library, kept here) is probed with a one-node
session, with its default options (CUDA's TF32 setting, a plugin's registered options).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import os
import sys
import warnings

import onnxruntime as ort
from onnx import TensorProto, helper

from .base import CPU, CUDA, lock

# Providers that cannot be checked with a plain session. The Azure provider only runs
# nodes of its own remote-inference operators and needs no local libraries, so a plain
# model never lands on it: it is taken as usable exactly when onnxruntime lists it.
_UNPROBED = frozenset({"AzureExecutionProvider"})

# onnxruntime's default logger severity (2: warning). It has no getter, so this is what
# the probe restores.
_DEFAULT_LOGGER_SEVERITY = 2

_probe_results: dict[str, bool] = {}  # provider name -> works here
_reported: set[str] = set()  # providers already reported unusable (resolve_providers warns once per provider)
# The plugin libraries registered (``plugins.register_provider_lib``):
# registration name -> {"path", "ep_names", "defaults"}
_plugin_libs: dict[str, dict] = {}


def plugin_libs() -> dict[str, dict]:
    """The registered plugin libraries (a copy): registration name -> {"path": the library's
    file, "ep_names": its execution providers, "defaults": their default options}."""
    with lock:
        return {name: {"path": lib["path"], "ep_names": list(lib["ep_names"]), "defaults": dict(lib["defaults"])}
                for name, lib in _plugin_libs.items()}


def add_plugin_lib(name: str, path: str, ep_names: list[str], defaults: dict[str, str]) -> None:
    """Keep the plugin library registered with onnxruntime as ``name`` (``plugins.register_provider_lib``
    registers it): ``path`` its file, ``ep_names`` the execution providers it brought, ``defaults``
    their default options. Its providers are known names from now on."""
    with lock:
        _plugin_libs[name] = {"path": path, "ep_names": list(ep_names), "defaults": dict(defaults)}


def remove_plugin_lib(name: str) -> None:
    """Forget the plugin library kept as ``name`` (``plugins.unregister_provider_lib``
    unregisters it from onnxruntime first); nothing when there is none."""
    with lock:
        _plugin_libs.pop(name, None)


def forget(names=None) -> None:
    """Forget what was found out about the providers ``names`` (every provider when None):
    whether they work here (probed again when next asked) and that they were reported
    unusable (reported again). For a provider whose library came or went."""
    with lock:
        if names is None:
            _probe_results.clear()
            _reported.clear()
        for name in names or ():
            _probe_results.pop(name, None)
            _reported.discard(name)


def first_report(name: str) -> bool:
    """Whether provider ``name`` is reported unusable for the first time in this process (it
    is not again until ``forget``)."""
    with lock:
        if name in _reported:
            return False
        _reported.add(name)
        return True


def plugin_ep_names() -> list[str]:
    """Execution providers of the registered plugin libraries, in registration order."""
    names = []
    for registration, lib in _plugin_libs.items():
        names.extend(n for n in lib["ep_names"] or [registration] if n not in names)
    return names


def registered_names() -> list[str]:
    """The registration names and the execution providers of the registered libraries."""
    names: list[str] = []
    for registration, lib in _plugin_libs.items():
        names.extend(n for n in [registration, *lib["ep_names"]] if n not in names)
    return names


def plugin_defaults(name: str) -> dict | None:
    """The default options registered for provider ``name`` (a registration name or one of its
    execution providers); None when no library provides it."""
    for registration, lib in _plugin_libs.items():
        if name == registration or name in lib["ep_names"]:
            return dict(lib["defaults"])
    return None


def expand_registration_names(pairs: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    """A plugin's registration name stands for its execution providers when they differ."""
    out = []
    for name, options in pairs:
        lib = _plugin_libs.get(name)
        if lib and lib["ep_names"] and name not in lib["ep_names"]:
            out.extend((ep, options) for ep in lib["ep_names"] if ep not in dict(out))
        else:
            out.append((name, options))
    return out


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


def probe(name: str) -> bool:
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
                provider_options=[default_options(name), {}],
                enable_fallback=0,
            )
            return name in session.get_providers()
        except Exception:
            return False


# onnxruntime's builds on PyPI: each installs the same ``onnxruntime`` module
BUILDS = ("onnxruntime", "onnxruntime-gpu", "onnxruntime-directml", "onnxruntime-openvino", "onnxruntime-qnn")


@functools.cache
def check_one_build() -> None:
    """Warn (once) where two onnxruntime builds are installed: they write the same module's
    files over each other, so which providers load is down to the install order."""
    found = []
    for build in BUILDS:
        try:
            found.append(f"{build} {importlib.metadata.version(build)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    if len(found) > 1:
        names = " ".join(f.split()[0] for f in found)
        warnings.warn(f"{' and '.join(found)} are installed; they hold the same module and overwrite each other's "
                      f"files, so keep one: pip uninstall -y {names} && pip install <the one you want>", stacklevel=3)


def candidates() -> list[str]:
    """Non-CPU providers worth probing, in onnxruntime's priority order, plugins after."""
    check_one_build()
    names = [n for n in ort.get_available_providers() if n != CPU]
    names.extend(n for n in plugin_ep_names() if n not in names and n != CPU)
    return names


def works(name: str) -> bool:
    """Whether ``name`` works here; probed once per process. Providers this onnxruntime
    build does not list (and no plugin library provides) do not work and are not probed."""
    if name == CPU:
        return True
    with lock:
        if name not in _probe_results:
            if name not in candidates():
                return False
            if name in _UNPROBED:
                _probe_results[name] = name in ort.get_available_providers()
            else:
                _probe_results[name] = probe(name)
        return _probe_results[name]


def get_available_providers() -> list[str]:
    """The execution providers that actually work here, in onnxruntime's priority order,
    always ending with ``"CPUExecutionProvider"``.

    Each non-CPU provider listed by onnxruntime (and each provider of a registered plugin
    library) is checked once per process by creating a tiny session with it; the check
    prints nothing. ``"AzureExecutionProvider"`` cannot be checked that way and counts as
    available exactly when onnxruntime lists it.
    """
    with lock:
        return [n for n in candidates() if works(n)] + [CPU]


def known_providers() -> list[str]:
    """Every name onnxruntime could know: its built-in list plus registered plugins."""
    names = list(ort.get_all_providers())
    names.extend(n for n in registered_names() if n not in names)
    return names


def tf32_option(allow_tf32: bool) -> dict:
    """The CUDA provider option that keeps float32 products in float32 (or allows TF32)."""
    return {"use_tf32": "1" if allow_tf32 else "0"}


def default_options(name: str, allow_tf32: bool = False) -> dict:
    """Default options of a provider: CUDA's TF32 setting, a plugin provider's options given
    to :func:`register_provider_lib`."""
    if name == CUDA:
        return tf32_option(allow_tf32)
    defaults = plugin_defaults(name)
    return {} if defaults is None else defaults
