"""Differentiate ops without a rule through their ONNX function body.

Many ONNX operators are defined as functions of simpler ones (SwiGLU, Range, Celu, ...).
A node on a float path from the weights whose op has no gradient rule but has a function
body at the model's opset is replaced by that body (attribute defaults filled in from the
schema, context-dependent bodies built for the node's input types), so new ONNX functions
get gradients without new code.
"""

from __future__ import annotations

import onnx
import onnx.inliner
from onnx import helper

from .. import registry
from ..type_inference import value_types
from ...dtypes import FLOAT_TENSOR_TYPES as _FLOATS
from ...errors import UnsupportedOpError

_DOMAIN = "gradbuilder.expanded"


def _carries(node: onnx.NodeProto, reached: set[str]) -> bool:
    """Whether a gradient can flow into ``node`` from ``reached``: through an input that is not
    a stop-gradient edge of its op (the random draws' inputs are)."""
    stops = registry.stop_gradient_edges(node.domain, node.op_type)
    return any(name in reached for i, name in enumerate(node.input) if name and i not in stops)


def _reached(proto: onnx.ModelProto, weights) -> set[str]:
    reached = set(weights)
    for node in proto.graph.node:
        if _carries(node, reached):
            reached.update(o for o in node.output if o)
    return reached


def _version(versions, opset: int) -> int | None:
    usable = [v for v in versions if v <= opset]
    return max(usable) if usable else None


def _body(schema, node: onnx.NodeProto, opset: int, types) -> onnx.FunctionProto | None:
    version = _version(schema.function_opset_versions, opset) if schema.has_function else None
    if version is not None:
        body = schema.get_function_with_opset_version(version)
        if body:
            return onnx.FunctionProto.FromString(body)
    version = (_version(schema.context_dependent_function_opset_versions, opset)
               if schema.has_context_dependent_function else None)
    if version is not None:
        input_types = []
        for name in node.input:
            tp = types.get(name) if name else None
            if name and tp is None:
                return None  # the body depends on types we do not know
            input_types.append((tp or onnx.TypeProto()).SerializeToString())
        body = schema.get_context_dependent_function_with_opset_version(
            version, node.SerializeToString(), input_types)
        if body:
            return onnx.FunctionProto.FromString(body)
    return None


def expand_functions(proto: onnx.ModelProto, weights, opset: int) -> bool:
    """Replace, in place, the rule-less function ops on the weights' float paths by their
    bodies. Returns whether anything was expanded."""
    reached = _reached(proto, weights)
    types = value_types(proto.graph)
    versions = {("" if imp.domain == "ai.onnx" else imp.domain): imp.version for imp in proto.opset_import}
    functions = []
    origins = {}
    for k, node in enumerate(proto.graph.node):
        domain = "" if node.domain == "ai.onnx" else node.domain
        if domain not in versions or not _carries(node, reached):
            continue
        if not any(types.get(o) is None or types[o].tensor_type.elem_type in _FLOATS for o in node.output if o):
            continue
        version = versions[domain] if domain else opset
        if registry.lookup(domain, node.op_type, version) is not None:
            continue
        try:  # ONNX's own domains (ai.onnx, ai.onnx.preview, ...) define function bodies
            schema = onnx.defs.get_schema(node.op_type, version, domain)
        except onnx.defs.SchemaError:
            continue
        # fill in attribute defaults so the body's attribute references resolve
        present = {a.name for a in node.attribute}
        for name, spec in schema.attributes.items():
            if name not in present and spec.default_value.type != onnx.AttributeProto.UNDEFINED:
                default = onnx.AttributeProto()
                default.CopyFrom(spec.default_value)
                default.name = name
                node.attribute.append(default)
        body = _body(schema, node, version, types)
        if body is None:
            continue
        fn = onnx.FunctionProto()
        fn.CopyFrom(body)
        fn.domain = _DOMAIN
        fn.name = f"{node.op_type}_{k}"
        if not any(o.domain in ("", "ai.onnx") for o in fn.opset_import):
            fn.opset_import.append(helper.make_opsetid("", opset))
        if domain and not any(o.domain == domain for o in fn.opset_import):
            fn.opset_import.append(helper.make_opsetid(domain, version))
        label = f"'{node.name}'" if node.name else f"<unnamed, output '{node.output[0]}'>"
        origins[fn.name] = (label, node.op_type, domain, version)
        node.domain = _DOMAIN
        node.op_type = fn.name
        functions.append(fn)
    if not functions:
        return False
    proto.functions.extend(functions)
    proto.opset_import.append(helper.make_opsetid(_DOMAIN, 1))
    inlined = onnx.inliner.inline_local_functions(proto)
    for node in inlined.graph.node:
        if node.domain == _DOMAIN:
            label, op_type, domain, version = origins[node.op_type]
            raise UnsupportedOpError(
                f"no gradient rule for node {label} (op_type={op_type}, domain='{domain or 'ai.onnx'}', "
                f"opset={version}), and its ONNX function body could not be inlined to differentiate "
                "through it. Remove it from the path to the loss, mark its inputs as stop-gradient, or "
                "register a rule")
    proto.CopyFrom(inlined)
    for i, imp in enumerate(proto.opset_import):
        if imp.domain == _DOMAIN:
            del proto.opset_import[i]
            break
    return True
