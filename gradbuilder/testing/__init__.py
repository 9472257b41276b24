"""Numerical gradient checking: built gradients against float64 finite differences.

``gradcheck`` converts the model to float64, builds its gradient graph, evaluates it with
onnx's reference evaluator and compares every weight's gradient with central finite
differences of the loss (on sampled elements and random directions).

``check_op`` wraps one operator in a model whose loss is a fixed random projection of
every float output, and gradchecks it; it also runs the float32 gradient graph on
onnxruntime, so a rule is known to emit graphs the stock runtime loads.

Helpers shared by the test suite: ``check_model`` (check_op's two checks on a prepared model),
``ort_run``, ``ort_grad_session`` and ``ort_grads`` (onnxruntime runs), ``reference_evaluator``,
``reference_fixes``/``reference_fix`` (the reference evaluator's op replacements) and
``patch_reference_evaluator`` (more replacements for one pytest test).

One module per concept, every public name importable from here:

- ``float64``: ``to_float64``, a model made float64;
- ``reference``: the reference evaluator and its op replacements (``reference_evaluator``,
  ``make_evaluator``, ``reference_fixes``, ``reference_fix``, ``max_pool_reference``,
  ``reference_evaluator_with``, ``patch_reference_evaluator``);
- ``finite_differences``: ``gradcheck`` and its report, ``forward_model``, ``numeric_gradient``;
- ``ort_runs``: onnxruntime runs (``ort_session``, ``run_onnxruntime``, ``ort_run``,
  ``ort_grad_session``, ``ort_grads``) and ``racing_nodes``;
- ``op_checks``: ``make_op_model``, ``check_op``, ``check_model``;
- ``grids``: ``pairwise``;
- ``large_models``: ``embedding_model_on_disk``;
- ``memory``: ``resident_bytes``, ``reset_peak``.

``gradbuilder.testing.make_evaluator`` builds every evaluator the checks use and is looked up at
each call, so a test may replace it here (``monkeypatch.setattr(testing, "make_evaluator", ...)``).
"""

from __future__ import annotations

from .finite_differences import GradcheckReport, WeightCheck, forward_model, gradcheck, numeric_gradient
from .float64 import to_float64
from .grids import pairwise
from .large_models import embedding_model_on_disk
from .memory import reset_peak, resident_bytes
from .op_checks import check_model, check_op, make_op_model
from .ort_runs import ort_grad_session, ort_grads, ort_run, ort_session, racing_nodes, run_onnxruntime
from .reference import (
    make_evaluator,
    max_pool_reference,
    patch_reference_evaluator,
    reference_evaluator,
    reference_evaluator_with,
    reference_fix,
    reference_fixes,
)

__all__ = [
    "GradcheckReport",
    "WeightCheck",
    "check_model",
    "check_op",
    "embedding_model_on_disk",
    "forward_model",
    "gradcheck",
    "make_evaluator",
    "make_op_model",
    "max_pool_reference",
    "numeric_gradient",
    "ort_grad_session",
    "ort_grads",
    "ort_run",
    "ort_session",
    "pairwise",
    "patch_reference_evaluator",
    "racing_nodes",
    "reference_evaluator",
    "reference_evaluator_with",
    "reference_fix",
    "reference_fixes",
    "reset_peak",
    "resident_bytes",
    "run_onnxruntime",
    "to_float64",
]
