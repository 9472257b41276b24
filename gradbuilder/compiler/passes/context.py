"""The pass interface: what every pass receives (:class:`Context`) and how a function
``fn(model, ctx)`` runs as an ``onnx_ir`` in-place pass (:class:`Pass`).

A pass module imports this module (and the IR helpers), never the pipeline that lists it or
the builder that runs the pipeline: the pipeline and the builder sit above the passes.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Iterable, NamedTuple

import onnx_ir as ir

from ..emitter import Emitter

if TYPE_CHECKING:
    from .recompute import RecomputeOptions


class CastPropagation(NamedTuple):
    """How far ``autocast`` (``passes.mixed_precision``) moves ops into low precision: up to
    ``level`` (-1: none, 1 and 2: ``mixed_precision.LEVEL_OPS``), plus the op types of
    ``allow``. onnxruntime-training's ``propagate_cast_ops_level`` / ``_allow``."""

    level: int = 1
    allow: tuple[str, ...] = ()

    @classmethod
    def of(cls, value: tuple[int, Iterable[str]]) -> "CastPropagation":
        """``(level, allow)`` (any iterable of op types) as a CastPropagation."""
        level, allow = value
        return cls(int(level), tuple(allow))


def opset_of(model: ir.Model) -> int:
    """The model's ai.onnx opset."""
    return model.opset_imports.get("", None) or model.opset_imports.get("ai.onnx")


@dataclasses.dataclass
class Context:
    """What the passes share and read: names, the values differentiated, options; and what
    they leave for the builder (running statistics, reports)."""

    emitter: Emitter  # the model's names and opset; every new name is taken through it
    wrt: list[ir.Value] = dataclasses.field(default_factory=list)  # the values differentiated with respect to
    running_statistics: bool = False  # expose BatchNormalization's running statistics as buffers
    unbiased_variance: bool = False  # the running variance with the batch's unbiased variance (PyTorch)
    mixed_precision: str | None = None  # "float16" / "bfloat16": autocast
    cast_propagation: CastPropagation = CastPropagation()  # (level, allow); a plain pair is converted
    recompute: RecomputeOptions | None = None  # what apply_recompute keeps and recomputes; None: nothing
    deterministic: bool = False  # the same bits every run on every device (passes.race_free_scatter)
    forward: list[ir.Node] = dataclasses.field(default_factory=list)  # the forward nodes (set before the walk)
    buffers: list[tuple[ir.Value, ir.Value]] = dataclasses.field(default_factory=list)  # (statistic, new value)
    reports: dict[str, object] = dataclasses.field(default_factory=dict)  # pass name -> what it reports

    def __post_init__(self) -> None:
        if not isinstance(self.cast_propagation, CastPropagation):
            self.cast_propagation = CastPropagation.of(self.cast_propagation)

    @classmethod
    def of(cls, model: ir.Model, **options) -> "Context":
        """A context for ``model`` (an emitter over its main graph at its ai.onnx opset)."""
        return cls(Emitter(model.graph, opset_of(model)), **options)

    @property
    def opset(self) -> int:
        return self.emitter.opset

    def unique(self, hint: str) -> str:
        return self.emitter.unique(hint)


PassFunction = Callable[[ir.Model, Context], object]


class Pass(ir.passes.InPlacePass):
    """One step of the pipeline: ``fn(model, ctx)`` as an onnx_ir in-place pass."""

    def __init__(self, fn: PassFunction, ctx: Context):
        super().__init__()
        self.fn, self.ctx = fn, ctx

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.fn(model, self.ctx)
        return ir.passes.PassResult(model, modified=True)
