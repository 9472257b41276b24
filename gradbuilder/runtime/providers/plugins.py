"""Registering plugin execution-provider libraries (``onnxruntime.register_execution_provider_library``):
registered under a name, their execution providers then count as known names, are probed like the
built-in ones and get the default options given at registration (``discovery`` keeps the list)."""

from __future__ import annotations

import os
from collections.abc import Mapping

import onnxruntime as ort

from ...errors import InvalidArgumentError, ProviderError
from . import discovery, sessions
from .base import lock


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
    with lock:
        registered = discovery.plugin_libs()
        if name in registered:
            raise ProviderError(
                f"a plugin library is already registered as {name!r} "
                f"({registered[name]['path']}); unregister it first"
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
        discovery.add_plugin_lib(name, path, ep_names, {str(k): str(v) for k, v in (default_options or {}).items()})
        discovery.forget([name, *ep_names])  # found out before the library came


def unregister_provider_lib(name: str) -> None:
    """Unregister a plugin library registered with :func:`register_provider_lib`.

    Cached sessions using its providers are dropped first; sessions held elsewhere must
    be released before calling this (onnxruntime requires it).
    """
    with lock:
        registered = discovery.plugin_libs()
        lib = registered.get(name)
        if lib is None:
            raise ProviderError(
                f"no plugin library is registered as {name!r} (registered: {', '.join(registered) or 'none'})"
            )
        names = {name, *lib["ep_names"]}
        sessions.drop_sessions_of(names)
        try:
            ort.unregister_execution_provider_library(name)
        except Exception as exc:
            raise ProviderError(
                f"onnxruntime could not unregister execution provider library {name!r}: {exc}"
            ) from exc
        discovery.remove_plugin_lib(name)
        discovery.forget(names)  # found out while the library was there
