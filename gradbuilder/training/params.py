"""``TrainingParameters``: onnxruntime-training's training options, checked as they are set.

The property names, types and defaults are those of ``onnxruntime.capi._pybind_state.
TrainingParameters`` in onnxruntime-training 1.19 (checked against the 1.19.2 wheel); note that
there ``training_optimizer_name`` defaults to ``""`` (no optimizer) and
``propagate_cast_ops_level`` to ``1``. Two members that 1.19's binding no longer exposes but
older ones did are kept with their old meaning: ``immutable_weights`` (op type -> list of
``(input_index, value)``: an initializer holding ``value`` at that input of a node of that op
type is not trained) and ``set_optimizer_initial_state`` (read back as
``optimizer_initial_state``). Because ``immutable_weights`` picks initializers by op type, input
and value rather than by name, its overlap with ``weights_to_train`` can only be found against a
model and is not checked here.

Nine options are gradbuilder's own (``EXTENSIONS``): ``mixed_precision_dtype`` ("float16",
the default, or "bfloat16") picks the half type of ``use_mixed_precision``; ``memory_budget_mb``
and ``memory_budget_fraction`` (of the activations the backward would hold) ask the recompute
planner to fit the activations in a budget (0: none); ``on_nonfinite_step`` says what a
TrainingSession does with a step whose loss or gradients hold an inf or NaN (the graph always
leaves the state as it was): "skip" (default) warns and counts it, "raise" raises
``NonFiniteError``; ``deterministic_compute`` makes every run of a step give the same bits for
the same inputs and thread count on CUDA too (see ``compiler/passes/race_free_scatter.py``; on
the CPU the graphs are deterministic already) and sets onnxruntime's
``use_deterministic_compute``; ``allow_tf32`` lets onnxruntime's CUDA provider compute float32
matrix products in TF32 (off by default: float32 is float32, as in PyTorch);
``optimizer_state_layout`` says how a session's step holds the weights and their optimizer
state (``training.stages.flat``): "flat" (one buffer per dtype and options, the update a few
nodes over each: what a GPU wants, whose step is bound by its kernel launches), "per_tensor"
(a tensor per weight: what a CPU wants, whose caches hold one weight's update but not the
whole model's), or "auto" (the default: flat on a GPU, per tensor on the CPU, as PyTorch's
optimizers pick their multi-tensor ``foreach`` kernels on CUDA only); ``enable_cuda_graph``
(named after the CUDA provider's option it sets) runs a session's full step as one captured
CUDA graph (``runtime.capture``): a GPU only, one process, one set of input shapes;
``allow_inference_export`` trains a PyTorch export optimized for inference (BatchNorm folded
into the convolution, parameters folded into constants) as it is, where the session refuses it
by default: training it trains another model.

Unlike ORT, every assignment is checked: types (a bool is not an int and an int is not a bool),
ranges, contradictions, and options whose pass gradbuilder does not have yet (see
``NOT_SUPPORTED_YET``). Failures raise :class:`InvalidArgumentError` naming the option. As in
ORT, containers read from the object are copies: assign a new value to change one.

Serialization: ``to_dict()`` returns plain JSON data (sets as sorted lists, ``(index, value)``
pairs as lists) and ``to_json()`` is that dict as JSON; ``from_dict``/``from_json`` accept any
subset of the options. The optimizer initial state (numpy arrays) is carried by ``to_dict()``
under ``"optimizer_initial_state"`` when set, but ``to_json()`` refuses it: save the arrays
yourself (``numpy.savez``) and clear them with ``set_optimizer_initial_state({})`` first.

``optimizer_name()`` maps ``training_optimizer_name`` to gradbuilder's plain names:

    ""              -> None (ORT adds no optimizer)
    SGDOptimizer    -> sgd
    LambOptimizer   -> lamb
    AdamOptimizer   -> adamw if any weight's ``lambda`` attribute is non-zero, else adam.
                       ORT's AdamOptimizer applies ``lambda`` as decoupled weight decay in both
                       ``weight_decay_mode`` values (0: torch.optim.AdamW, 1: Hugging Face
                       AdamW), so weight decay makes it AdamW whatever the mode.
    sgd, adam, adamw, lamb, adagrad -> themselves
"""

from __future__ import annotations

import difflib
import json
import math
import numbers
from collections.abc import Iterable, Mapping

import numpy as np

from ..errors import InvalidArgumentError
from ..interface import LEARNING_RATE
from .stages.optimizer import OPTIMIZERS

_HORIZONTAL = ("horizontal (tensor) parallel training is not supported; gradbuilder trains data parallel "
               "(data_parallel_size), with ZeRO 1 or 2 (deepspeed_zero_stage) and pipeline parallel "
               "(pipeline_parallel_size) on torch.distributed: launch with `torchrun --nproc-per-node N SCRIPT`")

# Options gradbuilder has no pass for: any value but the default is refused with this reason.
# Enabling a pass = deleting its lines here.
NOT_SUPPORTED_YET = {
    "horizontal_parallel_size": _HORIZONTAL,
    "sliced_axes": _HORIZONTAL,
    "sliced_schema": _HORIZONTAL,
    "sliced_tensor_names": _HORIZONTAL,
}
# Values that leave a not-yet-supported pass off besides its default.
_ALSO_OFF: dict[str, tuple] = {}

# gradbuilder's own options beyond onnxruntime-training's: the half-precision type of mixed
# precision, and the activation-memory budget of the recompute planner (0: no budget).
EXTENSIONS = ("mixed_precision_dtype", "memory_budget_mb", "memory_budget_fraction", "on_nonfinite_step",
              "deterministic_compute", "allow_tf32", "optimizer_state_layout", "enable_cuda_graph",
              "allow_inference_export")

# option -> (kind, ORT 1.19 default). Kinds are checked by _check below.
OPTIONS = {
    "allow_inference_export": ("bool", False),
    "allreduce_post_accumulation": ("bool", False),
    "allow_tf32": ("bool", False),
    "attn_dropout_recompute": ("bool", False),
    "data_parallel_size": ("count", 1),
    "deepspeed_zero_stage": ("int", 0),
    "deterministic_compute": ("bool", False),
    "enable_adasum": ("bool", False),
    "enable_cuda_graph": ("bool", False),
    "enable_grad_norm_clip": ("bool", True),
    "gelu_recompute": ("bool", False),
    "gradient_accumulation_steps": ("count", 1),
    "horizontal_parallel_size": ("count", 1),
    "immutable_weights": ("immutable", {}),
    "loss_output_name": ("str", ""),
    "loss_scale": ("float", 0.0),
    "memory_budget_fraction": ("float", 0.0),
    "memory_budget_mb": ("float", 0.0),
    "mixed_precision_dtype": ("str", "float16"),
    "lr_params_feed_name": ("str", LEARNING_RATE),
    "model_after_graph_transforms_path": ("str", ""),
    "model_with_gradient_graph_path": ("str", ""),
    "model_with_training_graph_path": ("str", ""),
    "num_pipeline_micro_batches": ("count", 1),
    "number_recompute_layers": ("int", 0),
    "on_nonfinite_step": ("str", "skip"),
    "optimizer_attributes_map": ("float_maps", {}),
    "optimizer_int_attributes_map": ("int_maps", {}),
    "optimizer_state_layout": ("str", "auto"),
    "pipeline_cut_info_string": ("str", ""),
    "pipeline_parallel_size": ("count", 1),
    "propagate_cast_ops_allow": ("str_list", []),
    "propagate_cast_ops_level": ("int", 1),
    "set_gradients_as_graph_outputs": ("bool", False),
    "sliced_axes": ("int_map", {}),
    "sliced_schema": ("int_list_map", {}),
    "sliced_tensor_names": ("str_list", []),
    "training_optimizer_name": ("optimizer", ""),
    "transformer_layer_recompute": ("bool", False),
    "use_fp16_moments": ("bool", False),
    "use_memory_efficient_gradient": ("bool", False),
    "use_mixed_precision": ("bool", False),
    "weights_not_to_train": ("str_set", set()),
    "weights_to_train": ("str_set", set()),
    "world_rank": ("int", 0),
    "world_size": ("count", 1),
}

_ORT_OPTIMIZERS = {"sgdoptimizer": "SGDOptimizer", "adamoptimizer": "AdamOptimizer", "lamboptimizer": "LambOptimizer"}
_PLAIN_OPTIMIZERS = tuple(OPTIMIZERS)  # gradbuilder's own names (training.stages.optimizer)
_STATE = "optimizer_initial_state"


def _fail(name: str, problem: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"TrainingParameters.{name}: {problem}")


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


def _int(name, v, what="an int"):
    if not _is_int(v):
        raise _fail(name, f"expected {what}, got {type(v).__name__} {v!r}")
    return int(v)


def _float(name, v):
    if not _is_real(v):
        raise _fail(name, f"expected a number, got {type(v).__name__} {v!r}")
    return float(v)


def _str(name, v):
    if not isinstance(v, str):
        raise _fail(name, f"expected a str, got {type(v).__name__} {v!r}")
    return v


def _strs(name, v) -> list[str]:
    if isinstance(v, (str, bytes)) or not isinstance(v, Iterable):
        raise _fail(name, f"expected a list or set of names, got {type(v).__name__} {v!r}; wrap a single name in a list")
    items = list(v)
    for s in items:
        _str(name, s)
    return items


def _mapping(name, v) -> Mapping:
    if not isinstance(v, Mapping):
        raise _fail(name, f"expected a dict, got {type(v).__name__} {v!r}")
    for k in v:
        _str(name, k)
    return v


def _check(name: str, kind: str, v):
    """``v`` converted to the stored form of ``kind``, or an error naming ``name``."""
    if kind == "bool":
        if not isinstance(v, (bool, np.bool_)):
            raise _fail(name, f"expected True or False, got {type(v).__name__} {v!r}")
        return bool(v)
    if kind == "int":
        return _int(name, v)
    if kind == "count":
        v = _int(name, v, "a positive int")
        if v < 1:
            raise _fail(name, f"must be at least 1, got {v}")
        return v
    if kind == "float":
        return _float(name, v)
    if kind == "str":
        return _str(name, v)
    if kind == "optimizer":
        return _optimizer(name, v)
    if kind == "str_set":
        return set(_strs(name, v))
    if kind == "str_list":
        return _strs(name, v)
    if kind == "int_map":
        return {k: _int(f"{name}[{k!r}]", x) for k, x in _mapping(name, v).items()}
    if kind == "int_list_map":
        out = {}
        for k, xs in _mapping(name, v).items():
            if isinstance(xs, (str, bytes)) or not isinstance(xs, Iterable):
                raise _fail(f"{name}[{k!r}]", f"expected a list of ints, got {xs!r}")
            out[k] = [_int(f"{name}[{k!r}]", x) for x in xs]
        return out
    if kind in ("float_maps", "int_maps"):
        convert = _float if kind == "float_maps" else _int
        return {w: {a: convert(f"{name}[{w!r}][{a!r}]", x) for a, x in _mapping(f"{name}[{w!r}]", attrs).items()}
                for w, attrs in _mapping(name, v).items()}
    if kind == "immutable":
        out = {}
        for op_type, pairs in _mapping(name, v).items():
            where = f"{name}[{op_type!r}]"
            if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Iterable):
                raise _fail(where, f"expected a list of (input_index, value) pairs, got {pairs!r}")
            out[op_type] = []
            for pair in pairs:
                if isinstance(pair, (str, bytes)) or not isinstance(pair, Iterable) or len(pair := list(pair)) != 2:
                    raise _fail(where, f"expected (input_index, value) pairs, got {pair!r}")
                index = _int(where, pair[0], "an int input index")
                if index < 0:
                    raise _fail(where, f"input index must be >= 0, got {index}")
                out[op_type].append((index, _float(where, pair[1])))
        return out
    raise AssertionError(kind)


def _optimizer(name, v) -> str:
    v = _str(name, v)
    key = v.lower()
    if v == "" or key in _PLAIN_OPTIMIZERS:
        return key
    if key in _ORT_OPTIMIZERS:
        return _ORT_OPTIMIZERS[key]
    choices = sorted(_ORT_OPTIMIZERS.values()) + list(_PLAIN_OPTIMIZERS)
    raise _fail(name, f"unknown optimizer {v!r}; choose one of {choices} (case-insensitive), or '' for none")


def _same(a, b) -> bool:
    return a == b and type(a) is type(b)


class TrainingParameters:
    """onnxruntime-training's ``TrainingParameters``, validated on assignment (see the module doc)."""

    def __init__(self, **options):
        values = {name: _check(name, kind, default) for name, (kind, default) in OPTIONS.items()}
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_state", {})
        state = options.pop(_STATE, None)
        if "world_size" in options:  # world_rank is checked against it, whatever the order given
            options = {"world_size": options.pop("world_size"), **options}
        for name, value in options.items():
            setattr(self, name, value)
        if state is not None:
            self.set_optimizer_initial_state(state)

    # --- attribute access -------------------------------------------------------------------

    def __getattr__(self, name):
        values = self.__dict__.get("_values", {})
        if name in values:
            return _check(name, OPTIONS[name][0], values[name])  # a fresh copy, as ORT returns
        raise AttributeError(f"'TrainingParameters' object has no attribute {name!r}")

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(OPTIONS))

    def __setattr__(self, name, value):
        if name == _STATE:
            raise _fail(name, "is read-only; call set_optimizer_initial_state(state) instead")
        if name not in OPTIONS:
            close = difflib.get_close_matches(name, OPTIONS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else "; see gradbuilder.training.params.OPTIONS"
            raise InvalidArgumentError(f"TrainingParameters has no option {name!r}{hint}")
        kind, default = OPTIONS[name]
        value = _check(name, kind, value)
        self._check_range(name, value)
        self._check_supported(name, value, default)
        self._check_consistent(name, value)
        self._values[name] = value

    def __delattr__(self, name):
        raise _fail(name, "cannot be deleted; assign its default instead")

    def _check_range(self, name, v):
        if name == "deepspeed_zero_stage" and v not in (0, 1, 2, 3):
            raise _fail(name, f"must be 0, 1, 2 or 3, got {v}")
        if name == "propagate_cast_ops_level" and v not in (-1, 0, 1, 2):
            raise _fail(name, f"must be -1 (off), 0, 1 or 2, got {v}")
        if name == "number_recompute_layers" and v < 0:
            raise _fail(name, f"must be >= 0, got {v}")
        if name == "loss_scale" and not (math.isfinite(v) and v >= 0):
            raise _fail(name, f"must be a finite number >= 0 (0 means dynamic loss scaling), got {v}")
        if name == "mixed_precision_dtype" and v not in ("float16", "bfloat16"):
            raise _fail(name, f"must be 'float16' or 'bfloat16', got {v!r}")
        if name == "optimizer_state_layout" and v not in ("auto", "flat", "per_tensor"):
            raise _fail(name, f"must be 'auto' (flat on a GPU, a tensor per weight on the CPU), 'flat' or "
                              f"'per_tensor', got {v!r}")
        if name == "on_nonfinite_step" and v not in ("skip", "raise"):
            raise _fail(name, f"must be 'skip' (skip the update with a warning and count it) or 'raise', got {v!r}")
        if name == "memory_budget_mb" and not (math.isfinite(v) and v >= 0):
            raise _fail(name, f"must be a finite number of MiB >= 0 (0: no budget), got {v}")
        if name == "memory_budget_fraction" and not 0 <= v < 1:
            raise _fail(name, f"must be in [0, 1): the share of the activation memory to keep (0: no budget), got {v}")
        if name == "world_rank" and not 0 <= v < self._values["world_size"]:
            raise _fail(name, f"must be in [0, world_size={self._values['world_size']}), got {v}; "
                              "set world_size first")
        if name == "world_size" and self._values["world_rank"] >= v:
            raise _fail(name, f"must be greater than world_rank={self._values['world_rank']}, got {v}")

    @staticmethod
    def _check_supported(name, v, default):
        if name in NOT_SUPPORTED_YET and not _same(v, default) and v not in _ALSO_OFF.get(name, ()):
            raise _fail(name, f"{v!r} is not supported yet: {NOT_SUPPORTED_YET[name]}; "
                              f"leave it at its default {default!r}")

    def _check_consistent(self, name, v):
        other = {"weights_to_train": "weights_not_to_train", "weights_not_to_train": "weights_to_train"}.get(name)
        if other and (both := v & self._values[other]):
            raise _fail(name, f"{sorted(both)} also in {other}; a weight is either trained or not, "
                              f"so remove it from one of the two")

    # --- optimizer ----------------------------------------------------------------------------

    def set_optimizer_initial_state(self, state):
        """Set the optimizer state to start from: weight name -> {state name -> array}.

        ``{}`` clears it. Arrays are copied (``numpy.array``)."""
        out = {}
        for weight, tensors in _mapping(_STATE, state).items():
            out[weight] = {}
            for s, array in _mapping(f"{_STATE}[{weight!r}]", tensors).items():
                try:
                    out[weight][s] = np.array(array)
                except Exception as e:  # noqa: BLE001 - numpy raises many kinds
                    raise _fail(f"{_STATE}[{weight!r}][{s!r}]", f"not convertible to a numpy array: {e}") from e
                if out[weight][s].dtype == object:
                    raise _fail(f"{_STATE}[{weight!r}][{s!r}]", "expected a numeric array, got objects")
        object.__setattr__(self, "_state", out)

    @property
    def optimizer_initial_state(self) -> dict[str, dict[str, np.ndarray]]:
        """The state given to ``set_optimizer_initial_state`` (a copy); ``{}`` when none."""
        return {w: {s: a.copy() for s, a in t.items()} for w, t in self._state.items()}

    def optimizer_name(self) -> str | None:
        """``training_optimizer_name`` as a plain name (sgd/adam/adamw/lamb/adagrad); see the module doc."""
        name = self._values["training_optimizer_name"]
        if name == "":
            return None
        if name == "AdamOptimizer":
            decays = (attrs.get("lambda", 0.0) for attrs in self._values["optimizer_attributes_map"].values())
            return "adamw" if any(d != 0.0 for d in decays) else "adam"
        return {"SGDOptimizer": "sgd", "LambOptimizer": "lamb"}.get(name, name)

    # --- comparison, repr, serialization ----------------------------------------------------

    def __eq__(self, other):
        if not isinstance(other, TrainingParameters):
            return NotImplemented
        mine, theirs = self._state, other._state
        return self._values == other._values and mine.keys() == theirs.keys() and all(
            mine[w].keys() == theirs[w].keys() and all(np.array_equal(mine[w][s], theirs[w][s]) for s in mine[w])
            for w in mine)

    __hash__ = None

    def __repr__(self):
        parts = [f"{name}={_plain(value)!r}" for name, value in self._values.items()
                 if not _same(value, OPTIONS[name][1])]
        if self._state:
            parts.append(f"{_STATE}=<state for {sorted(self._state)}>")
        return f"TrainingParameters({', '.join(parts)})"

    def to_dict(self) -> dict:
        """Every option as plain JSON data; ``optimizer_initial_state`` (arrays) too when set."""
        d = {name: _plain(value) for name, value in self._values.items()}
        if self._state:
            d[_STATE] = self.optimizer_initial_state
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> TrainingParameters:
        """Parameters from ``to_dict()`` output, or any subset of it; unknown keys are an error."""
        if not isinstance(d, Mapping):
            raise InvalidArgumentError(f"TrainingParameters.from_dict: expected a dict, got {type(d).__name__}")
        unknown = [k for k in d if k not in OPTIONS and k != _STATE]
        if unknown:
            hints = [f"{k!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(str(k), OPTIONS, n=1))
                     else repr(k) for k in unknown]
            raise InvalidArgumentError(f"TrainingParameters.from_dict: unknown option(s) {', '.join(hints)}; "
                                       f"the options are those of gradbuilder.training.params.OPTIONS")
        return cls(**d)

    def to_json(self, **dumps_kwargs) -> str:
        """``to_dict()`` as JSON (``indent=2, sort_keys=True`` unless given). Refuses a set optimizer state."""
        if self._state:
            raise _fail(_STATE, "holds numpy arrays, which to_json does not carry; save them separately "
                                "(numpy.savez) and call set_optimizer_initial_state({}) before to_json")
        dumps_kwargs.setdefault("indent", 2)
        dumps_kwargs.setdefault("sort_keys", True)
        return json.dumps(self.to_dict(), **dumps_kwargs)

    @classmethod
    def from_json(cls, s: str) -> TrainingParameters:
        try:
            d = json.loads(s)
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(f"TrainingParameters.from_json: not valid JSON: {e}") from e
        return cls.from_dict(d)


def _plain(value):
    """``value`` as JSON data: sets become sorted lists, tuples lists."""
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
