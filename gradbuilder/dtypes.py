"""Element types, defined once: which are floats (the types gradients exist for), and how
onnx, onnxruntime's type strings and numpy name them."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

# onnx element types that take gradients (TensorProto enum values; onnx_ir's DataType has the
# same values)
FLOAT_TENSOR_TYPES = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE})

# onnxruntime's type strings (NodeArg.type, OrtValue.data_type()) and numpy's types
NP_OF_ORT = {
    "tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
    "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int16)": np.int16, "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8, "tensor(uint16)": np.uint16, "tensor(uint32)": np.uint32,
    "tensor(uint64)": np.uint64, "tensor(bool)": np.bool_,
}
ORT_OF_NP = {v: k[len("tensor("):-1] for k, v in NP_OF_ORT.items()}
