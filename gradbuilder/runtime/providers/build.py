"""Build facts: gradbuilder's version, the onnxruntime it runs on, and whether distributed
training can run here."""

from __future__ import annotations

import onnxruntime as ort


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
    from ... import __version__  # imported late: the package imports this module

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
