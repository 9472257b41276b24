"""TrainingParameters: ORT's defaults, checks on assignment, repr and round trips."""

import json
import re

import numpy as np
import pytest

from gradbuilder.errors import InvalidArgumentError
from gradbuilder.training.params import EXTENSIONS, NOT_SUPPORTED_YET, OPTIONS, TrainingParameters

# Read from onnxruntime.capi._pybind_state.TrainingParameters() of the onnxruntime-training
# 1.19.2 wheel (sets shown as sorted lists). That binding has no immutable_weights.
ORT_1_19_DEFAULTS = {
    "allreduce_post_accumulation": False, "attn_dropout_recompute": False, "data_parallel_size": 1,
    "deepspeed_zero_stage": 0, "enable_adasum": False, "enable_grad_norm_clip": True,
    "gelu_recompute": False, "gradient_accumulation_steps": 1, "horizontal_parallel_size": 1,
    "loss_output_name": "", "loss_scale": 0.0, "lr_params_feed_name": "Learning_Rate",
    "model_after_graph_transforms_path": "", "model_with_gradient_graph_path": "",
    "model_with_training_graph_path": "", "num_pipeline_micro_batches": 1, "number_recompute_layers": 0,
    "optimizer_attributes_map": {}, "optimizer_int_attributes_map": {}, "pipeline_cut_info_string": "",
    "pipeline_parallel_size": 1, "propagate_cast_ops_allow": [], "propagate_cast_ops_level": 1,
    "set_gradients_as_graph_outputs": False, "sliced_axes": {}, "sliced_schema": {},
    "sliced_tensor_names": [], "training_optimizer_name": "", "transformer_layer_recompute": False,
    "use_fp16_moments": False, "use_memory_efficient_gradient": False, "use_mixed_precision": False,
    "weights_not_to_train": [], "weights_to_train": [], "world_rank": 0, "world_size": 1,
}


def bad(match, **options):
    with pytest.raises(InvalidArgumentError, match=match):
        TrainingParameters(**options)


# --- defaults ---------------------------------------------------------------------------------

OUR_DEFAULTS = {"immutable_weights": {}, "mixed_precision_dtype": "float16", "memory_budget_mb": 0.0,
                "memory_budget_fraction": 0.0, "on_nonfinite_step": "skip", "deterministic_compute": False,
                "allow_tf32": False, "optimizer_state_layout": "auto", "enable_cuda_graph": False,
                "allow_inference_export": False}


def test_defaults_equal_ort_1_19():
    d = TrainingParameters().to_dict()
    assert d == {**ORT_1_19_DEFAULTS, **OUR_DEFAULTS}
    for name, value in d.items():
        assert type(value) is type({**ORT_1_19_DEFAULTS, **OUR_DEFAULTS}[name]), name


def test_default_attributes_have_ort_types():
    p = TrainingParameters()
    assert p.weights_to_train == set() and isinstance(p.weights_to_train, set)
    assert p.sliced_tensor_names == [] and p.optimizer_attributes_map == {}
    assert p.optimizer_initial_state == {}
    assert p.optimizer_name() is None


def test_every_option_is_in_ort_or_documented():
    assert set(OPTIONS) == set(ORT_1_19_DEFAULTS) | {"immutable_weights"} | set(EXTENSIONS)
    assert set(NOT_SUPPORTED_YET) <= set(OPTIONS)


# --- setting ----------------------------------------------------------------------------------

def test_set_and_get():
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.weights_to_train = ["b", "a", "a"]
    p.gradient_accumulation_steps = np.int64(4)
    p.immutable_weights = {"Div": [[1, 8]]}
    p.optimizer_attributes_map = {"W": {"alpha": 1}}
    assert p.loss_output_name == "loss"
    assert p.weights_to_train == {"a", "b"}
    assert p.gradient_accumulation_steps == 4 and type(p.gradient_accumulation_steps) is int
    assert p.immutable_weights == {"Div": [(1, 8.0)]}
    assert p.optimizer_attributes_map == {"W": {"alpha": 1.0}}


def test_values_read_back_are_copies():
    p = TrainingParameters(weights_to_train={"a"})
    p.weights_to_train.add("b")
    assert p.weights_to_train == {"a"}


def test_defaults_not_shared_between_instances():
    a, b = TrainingParameters(), TrainingParameters()
    a.weights_to_train = {"x"}
    assert b.weights_to_train == set()


@pytest.mark.parametrize("name, value, match", [
    ("enable_grad_norm_clip", 1, r"enable_grad_norm_clip: expected True or False, got int"),
    ("set_gradients_as_graph_outputs", "yes", r"set_gradients_as_graph_outputs: expected True or False"),
    ("gradient_accumulation_steps", True, r"gradient_accumulation_steps: expected a positive int, got bool"),
    ("gradient_accumulation_steps", 2.0, r"gradient_accumulation_steps: expected a positive int, got float"),
    ("world_rank", False, r"world_rank: expected an int, got bool"),
    ("loss_scale", True, r"loss_scale: expected a number, got bool"),
    ("loss_scale", "1", r"loss_scale: expected a number, got str"),
    ("loss_output_name", None, r"loss_output_name: expected a str, got NoneType"),
    ("lr_params_feed_name", 3, r"lr_params_feed_name: expected a str"),
    ("weights_to_train", "W", r"weights_to_train: expected a list or set of names, got str.*wrap a single name"),
    ("weights_not_to_train", ["W", 3], r"weights_not_to_train: expected a str, got int"),
    ("weights_to_train", 5, r"weights_to_train: expected a list or set of names"),
    ("optimizer_attributes_map", ["W"], r"optimizer_attributes_map: expected a dict, got list"),
    ("optimizer_attributes_map", {"W": {"alpha": "x"}}, r"optimizer_attributes_map\['W'\]\['alpha'\]: expected a number"),
    ("optimizer_attributes_map", {"W": 0.9}, r"optimizer_attributes_map\['W'\]: expected a dict"),
    ("optimizer_int_attributes_map", {"W": {"do_bias_correction": 1.0}},
     r"optimizer_int_attributes_map\['W'\]\['do_bias_correction'\]: expected an int"),
    ("optimizer_int_attributes_map", {3: {}}, r"optimizer_int_attributes_map: expected a str, got int"),
    ("immutable_weights", {"Div": (1, 8.0)}, r"immutable_weights\['Div'\]: expected \(input_index, value\) pairs"),
    ("immutable_weights", {"Div": [(1, 2, 3)]}, r"immutable_weights\['Div'\]: expected \(input_index, value\) pairs"),
    ("immutable_weights", {"Div": [(-1, 8.0)]}, r"immutable_weights\['Div'\]: input index must be >= 0"),
    ("immutable_weights", {"Div": [(1.0, 8.0)]}, r"immutable_weights\['Div'\]: expected an int input index"),
    ("immutable_weights", {"Div": 8.0}, r"immutable_weights\['Div'\]: expected a list of \(input_index, value\)"),
    ("immutable_weights", ["Div"], r"immutable_weights: expected a dict"),
])
def test_type_errors(name, value, match):
    bad(match, **{name: value})
    p = TrainingParameters()
    before = p.to_dict()
    with pytest.raises(InvalidArgumentError):
        setattr(p, name, value)
    assert p.to_dict() == before  # a refused value leaves the option as it was


@pytest.mark.parametrize("name, value, match", [
    ("gradient_accumulation_steps", 0, r"gradient_accumulation_steps: must be at least 1, got 0"),
    ("data_parallel_size", 0, r"data_parallel_size: must be at least 1"),
    ("horizontal_parallel_size", -2, r"horizontal_parallel_size: must be at least 1"),
    ("pipeline_parallel_size", 0, r"pipeline_parallel_size: must be at least 1"),
    ("num_pipeline_micro_batches", 0, r"num_pipeline_micro_batches: must be at least 1"),
    ("world_size", 0, r"world_size: must be at least 1"),
    ("world_rank", 1, r"world_rank: must be in \[0, world_size=1\), got 1; set world_size first"),
    ("world_rank", -1, r"world_rank: must be in \[0, world_size=1\)"),
    ("loss_scale", -1.0, r"loss_scale: must be a finite number >= 0"),
    ("loss_scale", float("nan"), r"loss_scale: must be a finite number >= 0"),
    ("loss_scale", float("inf"), r"loss_scale: must be a finite number >= 0"),
    ("propagate_cast_ops_level", 3, r"propagate_cast_ops_level: must be -1 \(off\), 0, 1 or 2, got 3"),
    ("propagate_cast_ops_level", -2, r"propagate_cast_ops_level: must be -1 \(off\), 0, 1 or 2"),
    ("deepspeed_zero_stage", 4, r"deepspeed_zero_stage: must be 0, 1, 2 or 3, got 4"),
    ("deepspeed_zero_stage", -1, r"deepspeed_zero_stage: must be 0, 1, 2 or 3"),
    ("number_recompute_layers", -1, r"number_recompute_layers: must be >= 0"),
])
def test_range_errors(name, value, match):
    bad(match, **{name: value})


@pytest.mark.parametrize("name", ["SGDOptimizer", "AdamOptimizer", "LambOptimizer"])
def test_ort_optimizer_names(name):
    assert TrainingParameters(training_optimizer_name=name).training_optimizer_name == name
    assert TrainingParameters(training_optimizer_name=name.upper()).training_optimizer_name == name


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw", "lamb", "adagrad"])
def test_plain_optimizer_names(name):
    p = TrainingParameters(training_optimizer_name=name.upper())
    assert p.training_optimizer_name == name
    assert p.optimizer_name() == name


@pytest.mark.parametrize("name", ["rmsprop", "Adam Optimizer", "SGD "])
def test_unknown_optimizer(name):
    bad(r"training_optimizer_name: unknown optimizer .*choose one of \['AdamOptimizer', 'LambOptimizer', "
        r"'SGDOptimizer', 'sgd', 'adam', 'adamw', 'lamb', 'adagrad'\] \(case-insensitive\), or '' for none",
        training_optimizer_name=name)


def test_unknown_option_suggests_the_close_one():
    p = TrainingParameters()
    with pytest.raises(InvalidArgumentError, match=r"no option 'weights_to_trian'; did you mean 'weights_to_train'"):
        p.weights_to_trian = {"W"}
    with pytest.raises(InvalidArgumentError, match=r"no option 'zzz'; see gradbuilder.training.params.OPTIONS"):
        TrainingParameters(zzz=1)
    with pytest.raises(AttributeError):
        p.zzz  # noqa: B018


def test_state_is_not_an_attribute_and_options_cannot_be_deleted():
    p = TrainingParameters()
    with pytest.raises(InvalidArgumentError, match=r"optimizer_initial_state: is read-only; call set_optimizer_initial_state"):
        p.optimizer_initial_state = {}
    with pytest.raises(InvalidArgumentError, match=r"loss_scale: cannot be deleted"):
        del p.loss_scale


# --- contradictions ---------------------------------------------------------------------------

def test_weight_both_trained_and_not():
    p = TrainingParameters(weights_to_train={"W", "B"})
    with pytest.raises(InvalidArgumentError, match=r"weights_not_to_train: \['W'\] also in weights_to_train; "
                                                  r"a weight is either trained or not, so remove it from one"):
        p.weights_not_to_train = ["W", "X"]
    p.weights_not_to_train = ["X"]
    with pytest.raises(InvalidArgumentError, match=r"weights_to_train: \['X'\] also in weights_not_to_train"):
        p.weights_to_train = ["X"]
    assert p.weights_to_train == {"W", "B"} and p.weights_not_to_train == {"X"}


# --- not supported yet ------------------------------------------------------------------------

NON_DEFAULT = {
    "horizontal_parallel_size": 2,
    "sliced_axes": {"W": 0}, "sliced_schema": {"W": [2, 1]}, "sliced_tensor_names": ["W"],
}
DISTRIBUTED = {"data_parallel_size": 2, "world_size": 2, "world_rank": 1, "deepspeed_zero_stage": 1,
               "enable_adasum": True, "allreduce_post_accumulation": True, "pipeline_parallel_size": 2,
               "num_pipeline_micro_batches": 4, "pipeline_cut_info_string": "a-b"}


def test_not_supported_cases_cover_the_table():
    assert set(NON_DEFAULT) == set(NOT_SUPPORTED_YET)


@pytest.mark.parametrize("name", sorted(NON_DEFAULT))
def test_not_supported_yet(name):
    reason = NOT_SUPPORTED_YET[name]
    default = OPTIONS[name][1]
    bad(rf"TrainingParameters\.{name}: .* is not supported yet: {re.escape(reason)}; leave it at its default "
        + re.escape(repr(default)), **{name: NON_DEFAULT[name]})
    assert TrainingParameters(**{name: default}).to_dict()[name] == ORT_1_19_DEFAULTS[name]


def test_not_supported_reasons_say_what_is_supported_instead():
    assert "torchrun" in NOT_SUPPORTED_YET["horizontal_parallel_size"]


def test_distributed_options_are_accepted():
    """They are checked against the launched group by the TrainingSession (test_distributed)."""
    p = TrainingParameters(world_size=2)
    for k, v in DISTRIBUTED.items():
        setattr(p, k, v)
    assert {k: getattr(p, k) for k in DISTRIBUTED} == DISTRIBUTED
    assert TrainingParameters.from_dict(p.to_dict()).to_dict() == p.to_dict()


MIXED_AND_RECOMPUTE = {
    "use_mixed_precision": True, "loss_scale": 128.0, "use_fp16_moments": True, "propagate_cast_ops_level": 2,
    "propagate_cast_ops_allow": ["Gelu"], "attn_dropout_recompute": True, "gelu_recompute": True,
    "transformer_layer_recompute": True, "number_recompute_layers": 2, "use_memory_efficient_gradient": True,
    "mixed_precision_dtype": "bfloat16", "memory_budget_mb": 512.0, "memory_budget_fraction": 0.5,
}


@pytest.mark.parametrize("name", sorted(MIXED_AND_RECOMPUTE))
def test_mixed_precision_and_recompute_options_are_accepted(name):
    p = TrainingParameters(**{name: MIXED_AND_RECOMPUTE[name]})
    assert getattr(p, name) == MIXED_AND_RECOMPUTE[name]
    assert TrainingParameters.from_dict(p.to_dict()).to_dict() == p.to_dict()


@pytest.mark.parametrize("name, value, match", [
    ("mixed_precision_dtype", "float8", r"mixed_precision_dtype: must be 'float16' or 'bfloat16'"),
    ("memory_budget_mb", -1.0, r"memory_budget_mb: must be a finite number of MiB >= 0"),
    ("memory_budget_fraction", 1.0, r"memory_budget_fraction: must be in \[0, 1\)"),
    ("memory_budget_fraction", "half", r"memory_budget_fraction: expected a number"),
])
def test_mixed_precision_and_budget_ranges(name, value, match):
    bad(match, **{name: value})


def test_cast_propagation_levels_are_accepted():
    for level in (-1, 0, 1, 2):
        assert TrainingParameters(propagate_cast_ops_level=level).propagate_cast_ops_level == level


def test_loss_scale_zero_as_int_is_the_default():
    assert TrainingParameters(loss_scale=0).loss_scale == 0.0


# --- optimizer --------------------------------------------------------------------------------

@pytest.mark.parametrize("name, expected", [("SGDOptimizer", "sgd"), ("LambOptimizer", "lamb"), ("", None)])
def test_optimizer_name_mapping(name, expected):
    assert TrainingParameters(training_optimizer_name=name).optimizer_name() == expected


def test_adam_optimizer_is_adamw_when_it_decays_weights():
    p = TrainingParameters(training_optimizer_name="AdamOptimizer",
                           optimizer_attributes_map={"W": {"alpha": 0.9, "beta": 0.999, "lambda": 0.0, "epsilon": 1e-8}},
                           optimizer_int_attributes_map={"W": {"do_bias_correction": 1, "weight_decay_mode": 1}})
    assert p.optimizer_name() == "adam"  # no decay: weight_decay_mode changes nothing
    p.optimizer_attributes_map = {"W": {"lambda": 0.0}, "B": {"lambda": 0.01}}
    assert p.optimizer_name() == "adamw"
    p.optimizer_int_attributes_map = {"W": {"weight_decay_mode": 0}, "B": {"weight_decay_mode": 0}}
    assert p.optimizer_name() == "adamw"  # both of ORT's modes decay decoupled from the moments
    p.optimizer_attributes_map = {}
    assert p.optimizer_name() == "adam"


def test_optimizer_initial_state():
    p = TrainingParameters()
    m = np.ones((2, 3), np.float32)
    p.set_optimizer_initial_state({"W": {"Moment_1": m, "Moment_2": [[0.0, 1.0]]}})
    state = p.optimizer_initial_state
    assert set(state) == {"W"} and set(state["W"]) == {"Moment_1", "Moment_2"}
    np.testing.assert_array_equal(state["W"]["Moment_1"], m)
    assert state["W"]["Moment_2"].shape == (1, 2)
    m[0, 0] = 5  # the parameters keep their own copy
    state["W"]["Moment_1"][0, 0] = 7
    assert p.optimizer_initial_state["W"]["Moment_1"][0, 0] == 1
    p.set_optimizer_initial_state({})
    assert p.optimizer_initial_state == {}


@pytest.mark.parametrize("state, match", [
    ([1], r"optimizer_initial_state: expected a dict, got list"),
    ({"W": [1]}, r"optimizer_initial_state\['W'\]: expected a dict, got list"),
    ({"W": {"m": object()}}, r"optimizer_initial_state\['W'\]\['m'\]: expected a numeric array"),
    ({"W": {"m": [[1], [1, 2]]}}, r"optimizer_initial_state\['W'\]\['m'\]: not convertible to a numpy array"),
])
def test_optimizer_initial_state_errors(state, match):
    with pytest.raises(InvalidArgumentError, match=match):
        TrainingParameters().set_optimizer_initial_state(state)


# --- repr and round trips ---------------------------------------------------------------------

def full():
    return TrainingParameters(
        loss_output_name="loss", weights_to_train={"W", "B"}, weights_not_to_train=["C"],
        immutable_weights={"Div": [(1, 8.0)], "Sub": [(0, 1.0)]}, training_optimizer_name="AdamOptimizer",
        lr_params_feed_name="lr", optimizer_attributes_map={"W": {"alpha": 0.9, "lambda": 0.01}},
        optimizer_int_attributes_map={"W": {"do_bias_correction": 0}}, gradient_accumulation_steps=4,
        enable_grad_norm_clip=False, set_gradients_as_graph_outputs=True, propagate_cast_ops_level=-1,
        model_with_gradient_graph_path="g.onnx")


def test_repr_shows_only_non_defaults():
    assert repr(TrainingParameters()) == "TrainingParameters()"
    p = TrainingParameters(weights_to_train={"b", "a"}, gradient_accumulation_steps=2, loss_scale=0)
    assert repr(p) == "TrainingParameters(gradient_accumulation_steps=2, weights_to_train=['a', 'b'])"
    p.enable_grad_norm_clip = False
    p.set_optimizer_initial_state({"W": {"m": np.zeros(2)}})
    assert repr(p) == ("TrainingParameters(enable_grad_norm_clip=False, gradient_accumulation_steps=2, "
                       "weights_to_train=['a', 'b'], optimizer_initial_state=<state for ['W']>)")


def test_dict_round_trip():
    p = full()
    d = p.to_dict()
    assert d["weights_to_train"] == ["B", "W"] and d["immutable_weights"]["Div"] == [[1, 8.0]]
    json.dumps(d)  # plain JSON data
    assert TrainingParameters.from_dict(d) == p
    assert TrainingParameters.from_dict(d).to_dict() == d


def test_json_round_trip():
    p = full()
    s = p.to_json()
    assert json.loads(s)["weights_not_to_train"] == ["C"]
    q = TrainingParameters.from_json(s)
    assert q == p and q.to_json() == s
    assert q.immutable_weights == {"Div": [(1, 8.0)], "Sub": [(0, 1.0)]}
    assert TrainingParameters.from_json(TrainingParameters().to_json()) == TrainingParameters()


def test_from_dict_takes_a_subset():
    p = TrainingParameters.from_dict({"loss_output_name": "loss"})
    assert p == TrainingParameters(loss_output_name="loss")
    assert p != TrainingParameters()


def test_from_dict_and_json_errors():
    with pytest.raises(InvalidArgumentError, match=r"unknown option\(s\) 'weights_to_trian' \(did you mean "
                                                  r"'weights_to_train'\?\), 'zzz'"):
        TrainingParameters.from_dict({"weights_to_trian": [], "zzz": 1, "loss_output_name": "x"})
    with pytest.raises(InvalidArgumentError, match=r"from_dict: expected a dict, got list"):
        TrainingParameters.from_dict([])
    with pytest.raises(InvalidArgumentError, match=r"from_json: not valid JSON"):
        TrainingParameters.from_json("{not json")
    with pytest.raises(InvalidArgumentError, match=r"from_dict: expected a dict, got list"):
        TrainingParameters.from_json("[1]")
    with pytest.raises(InvalidArgumentError, match=r"sliced_tensor_names: \['W'\] is not supported yet"):
        TrainingParameters.from_json('{"sliced_tensor_names": ["W"]}')
    with pytest.raises(InvalidArgumentError, match=r"weights_not_to_train: \['W'\] also in weights_to_train"):
        TrainingParameters.from_dict({"weights_to_train": ["W"], "weights_not_to_train": ["W"]})


def test_optimizer_state_in_dict_but_not_json():
    p = full()
    p.set_optimizer_initial_state({"W": {"Moment_1": np.arange(3.0)}})
    q = TrainingParameters.from_dict(p.to_dict())
    assert q == p
    np.testing.assert_array_equal(q.optimizer_initial_state["W"]["Moment_1"], np.arange(3.0))
    assert q != full()
    with pytest.raises(InvalidArgumentError, match=r"optimizer_initial_state: holds numpy arrays, which to_json "
                                                  r"does not carry; save them separately"):
        p.to_json()
    p.set_optimizer_initial_state({})
    assert TrainingParameters.from_json(p.to_json()) == full()


def test_equality():
    assert TrainingParameters() == TrainingParameters()
    assert TrainingParameters() != TrainingParameters(loss_output_name="x")
    assert TrainingParameters() != object()
