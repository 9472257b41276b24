"""Views into an OrtValue's memory: a tensor of another shape starting at an element of a 1-D
buffer, on the buffer's device (CPU or CUDA alike), sharing its memory and keeping it alive.

onnxruntime has no view in its Python API; DLPack carries one. The buffer is exported with
onnxruntime's own ``to_dlpack`` (whose deleter holds a reference to the buffer), the exported
tensor's data pointer and shape are moved to the view's, and ``from_dlpack`` takes it back as
a new OrtValue. onnxruntime copies the shape when it takes the tensor, and ignores DLPack's
``byte_offset``: the offset goes into the data pointer.
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import onnxruntime as ort
import onnxruntime.capi._pybind_state as _C


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):  # DLPack's DLTensor, the first member of DLManagedTensor
    _fields_ = [("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int), ("dtype", _DataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_pointer.restype = ctypes.c_void_p
_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def view(buffer: ort.OrtValue, offset: int, shape: Sequence[int]) -> ort.OrtValue:
    """Elements ``offset`` .. ``offset + prod(shape)`` of the contiguous ``buffer`` as a tensor of
    ``shape``: the same memory (writes to either show in the other), which it keeps alive."""
    capsule = buffer._ortvalue.to_dlpack()
    tensor = _Tensor.from_address(_pointer(capsule, b"dltensor"))
    dims = (ctypes.c_int64 * max(1, len(shape)))(*shape)
    tensor.data = (tensor.data or 0) + tensor.byte_offset + offset * (tensor.dtype.bits // 8)
    tensor.byte_offset = 0
    tensor.ndim = len(shape)
    tensor.shape = ctypes.cast(dims, ctypes.POINTER(ctypes.c_int64))
    tensor.strides = None
    return from_capsule(capsule)


def from_capsule(capsule, is_bool: bool = False) -> ort.OrtValue:
    """An OrtValue over the memory of a DLPack ``capsule``. onnxruntime's GPU build takes a flag
    saying that bytes are booleans; its CPU build takes the capsule alone (and reads booleans
    from the DLPack type): ``is_bool`` applies to the first."""
    try:
        return ort.OrtValue(_C.OrtValue.from_dlpack(capsule, is_bool))
    except TypeError:  # the other signature: nothing was consumed yet
        return ort.OrtValue(_C.OrtValue.from_dlpack(capsule))
