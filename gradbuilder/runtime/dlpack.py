"""Tensors crossing between torch and onnxruntime as DLPack views of the same memory, on CPU
and CUDA alike (ORTModule's inputs and outputs, the gradients distributed training reduces).
Imports torch: only the modules that need it import this one."""

from __future__ import annotations

import onnxruntime as ort
import onnxruntime.capi._pybind_state as _C
import torch

from .views import from_capsule


def to_ort(t: torch.Tensor) -> ort.OrtValue:
    t = t.detach().contiguous()
    if t.dtype == torch.bool:  # onnxruntime's GPU build reads DLPack booleans as bytes flagged boolean
        try:
            return ort.OrtValue(_C.OrtValue.from_dlpack(t.view(torch.uint8).__dlpack__(), True))
        except TypeError:  # its CPU build: the capsule alone, the boolean type in it
            return from_capsule(t.__dlpack__())
    return from_capsule(t.__dlpack__())


def to_torch(v: ort.OrtValue) -> torch.Tensor:
    out = torch.utils.dlpack.from_dlpack(v._ortvalue.to_dlpack())
    if v.data_type() == "tensor(bool)" and out.dtype != torch.bool:
        out = out.view(torch.bool)
    return out
