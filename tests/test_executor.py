"""The runtime's seams: one execution interface (the session never asks whether it is
distributed, the distributed code never reaches into the session), the model's facts derived
once, the table of graph kinds with what each needs, the one thread-spinning policy, and the
checkpoint-compatibility policy in ``checkpoint``."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from gradbuilder import TrainingParameters
from gradbuilder.errors import CheckpointError
from gradbuilder.runtime import checkpoint
from gradbuilder.runtime.executor import Executor, LocalExecutor
from gradbuilder.runtime.graphs import Kind
from gradbuilder.runtime.runner import SPINNING, STOP_SPINNING, taking_turns
from gradbuilder.runtime.session import TrainingSession

from .test_layers import regression_model

CPU = ["CPUExecutionProvider"]
RUNTIME = Path(inspect.getfile(TrainingSession)).parent


def _session(sess_options=None, **kw) -> TrainingSession:
    params = TrainingParameters(loss_output_name="loss", training_optimizer_name="adamw", **kw)
    return TrainingSession(regression_model(), params, sess_options, providers=CPU)


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((4, 3)).astype(np.float32), "t": rng.standard_normal((4, 2)).astype(np.float32)}


def _attributes(path: Path) -> set[str]:
    return {n.attr for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute)}


# ---------------------------------------------------------------------------- one interface
def test_the_session_never_asks_whether_it_is_distributed():
    used = _attributes(RUNTIME / "session.py")
    assert "_dist" not in used and "topo" not in used


def test_the_distributed_executors_never_reach_into_the_session():
    for path in (RUNTIME / "distributed").glob("*.py"):
        tree = ast.parse(path.read_text())
        reached = _attributes(path) & {"_graphs", "_builder", "_state", "_model", "_fingerprint", "_run", "_dist",
                                       "_check_finite", "_check_labels", "_labels", "weight_specs"}
        assert not reached, (path.name, reached)
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {a.arg for n in ast.walk(tree)
                                                                             if isinstance(n, ast.arg) for a in [n]}
        assert "session" not in names, path.name


def test_every_executor_has_the_local_executors_surface():
    from gradbuilder.runtime.distributed.data_parallel import DataParallel
    from gradbuilder.runtime.distributed.pipeline_parallel import PipelineParallel

    surface = {n for n, v in vars(Executor).items() if not n.startswith("_")}
    assert {"run", "train_step", "optimizer_step", "eval", "place", "checkpoint_tensors", "owned_grads",
            "partition_info", "step"} <= surface
    for cls in (LocalExecutor, DataParallel, PipelineParallel):
        assert issubclass(cls, Executor)
        for name in ("run", "train_step", "optimizer_step", "eval", "place"):
            assert getattr(cls, name) is not getattr(Executor, name), (cls.__name__, name)


def test_a_session_in_one_process_runs_through_a_local_executor():
    sess = _session()
    assert type(sess.executor) is LocalExecutor
    assert sess.data_shard == (0, 1) and sess.get_partition_info_map() == {}
    sess.run(["loss"], _batch())
    assert sess.step == sess.executor.step == 1


# ---------------------------------------------------------------------------- facts derived once
def test_the_model_facts_are_derived_once_and_shared():
    sess = _session()
    facts = sess.parts.facts
    assert sess.weights is facts.weights and sess.buffers is facts.buffers and sess.loss_name == facts.loss
    assert sorted(facts.weights) == ["B", "W"]
    assert {w: (s.shape, s.dtype) for w, s in facts.specs.items()} == {"W": ((3, 2), np.float32),
                                                                       "B": ((2,), np.float32)}
    assert all(s.strides == (0,) * s.ndim for s in facts.specs.values())  # dtype and shape only: no memory
    assert facts.inputs == ["x", "t"] and facts.outputs == ["loss"]
    with pytest.raises(Exception):
        facts.weights = []  # a record, not settings


def test_the_learning_rate_value_follows_the_rate_without_being_cleared_by_hand():
    sess = _session()
    first = sess.state.scalar(1e-3)
    assert sess.state.scalar(1e-3) is first
    sess.set_learning_rate(0.5)
    assert float(sess.state.scalar(0.5).numpy()) == 0.5
    sess.set_providers(CPU)  # the same device: the state stays, so does the value
    assert sess.state.scalar(0.5) is sess.state.scalar(0.5)


# ---------------------------------------------------------------------------- the kinds table
def test_each_kind_is_one_entry_of_one_table():
    assert [k.value for k in Kind] == ["step", "gradients", "accumulate", "optimizer", "eval"]
    assert Kind("step") is Kind.STEP and Kind.STEP == "step" and f"{Kind.EVAL}" == "eval"
    assert {k for k in Kind if k.bound} == {Kind.STEP, Kind.GRADIENTS, Kind.ACCUMULATE, Kind.OPTIMIZER}
    assert {k for k in Kind if k.takes_turns} == {Kind.GRADIENTS, Kind.ACCUMULATE, Kind.OPTIMIZER}
    assert {k for k in Kind if not k.mem_pattern} == {Kind.STEP}
    for path in [RUNTIME / "session.py", RUNTIME / "executor.py", *(RUNTIME / "distributed").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):  # no kind spelled as a bare string where graphs run
            if isinstance(node, ast.Subscript) or (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                                                   and node.func.attr in ("run_graph", "check_feeds")):
                spelled = [n.value for n in ast.walk(node) if isinstance(n, ast.Constant)]
                assert not set(spelled) & {k.value for k in Kind}, (path.name, node.lineno)


def _entry(options: ort.SessionOptions, key: str):
    try:
        return options.get_session_config_entry(key)
    except Exception:  # noqa: BLE001 - not set
        return None


@pytest.mark.parametrize("user_spinning", [None, "1"])
def test_each_kinds_session_options_come_from_the_table(user_spinning):
    so = ort.SessionOptions()
    if user_spinning is not None:
        so.add_session_config_entry(SPINNING, user_spinning)
    sess = _session(so)
    for kind in Kind:
        options = sess.graphs[kind].session.get_session_options()
        assert options.enable_mem_pattern == kind.mem_pattern, kind
        stops = kind.takes_turns and user_spinning is None
        assert _entry(options, STOP_SPINNING) == ("1" if stops else None), kind
    assert _entry(so, STOP_SPINNING) is None  # the caller's options are left as they were


def test_the_spinning_policy_is_written_once():
    so = taking_turns(None)
    assert _entry(so, STOP_SPINNING) == "1"
    mine = ort.SessionOptions()
    mine.add_session_config_entry(SPINNING, "0")
    assert _entry(taking_turns(mine), STOP_SPINNING) is None
    ortmodule = (RUNTIME.parent / "ortmodule" / "compiled.py").read_text()
    assert "taking_turns" in ortmodule and STOP_SPINNING not in ortmodule and SPINNING not in ortmodule


def test_ortmodules_graphs_stop_spinning_at_the_end_of_a_run():
    torch = pytest.importorskip("torch")
    from gradbuilder.ortmodule import ORTModule

    torch.manual_seed(0)
    m = ORTModule(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)))
    m(torch.randn(3, 4)).sum().backward()
    compiled = [v for v in vars(m).values() if hasattr(v, "forward_graph")]
    compiled += [c for v in vars(m).values() if isinstance(v, dict) for c in v.values() if hasattr(c, "forward_graph")]
    if not compiled:
        pytest.skip("no compiled signature found on the module")
    for c in compiled:
        assert _entry(c.forward_graph.session.get_session_options(), STOP_SPINNING) == "1"


def test_the_graph_cache_is_changed_through_its_methods_only():
    sess = _session()
    graphs = sess.graphs
    for attribute in ("providers", "provider_options", "device"):
        with pytest.raises(AttributeError):
            setattr(graphs, attribute, None)
    assert graphs.built("optimizer") is None
    graphs.serialized("optimizer")
    with pytest.raises(AssertionError):
        graphs.partition(["W"])  # after the optimizer graph was built


# ---------------------------------------------------------------------------- checkpoint policy
def test_the_checkpoint_compatibility_policy_lives_in_checkpoint(tmp_path):
    one = _session(gradient_accumulation_steps=1)
    two = _session(gradient_accumulation_steps=2)
    shapes = {n: tuple(two.state[n].shape()) for n in two.state}
    path = tmp_path / "c.ckpt"
    one.save_checkpoint(path)
    reader = checkpoint.open_checkpoint(path)
    mine = {n: tuple(one.state[n].shape()) for n in one.state}
    assert checkpoint.resumes(path, reader, one.parts.facts.identity, mine) is False
    assert checkpoint.resumes(path, reader, two.parts.facts.identity, shapes) is True  # saved between accumulations
    other = TrainingSession(regression_model(), TrainingParameters(loss_output_name="loss", training_optimizer_name="sgd"),
                            providers=CPU)
    theirs = {n: tuple(other.state[n].shape()) for n in other.state}
    with pytest.raises(CheckpointError, match="another model or optimizer"):
        checkpoint.resumes(path, reader, other.parts.facts.identity, theirs)
    two.run(["loss"], _batch())  # one micro-step in: Accumulation_Step 1
    two.save_checkpoint(path)
    with pytest.raises(CheckpointError, match="middle of a gradient accumulation"):
        checkpoint.resumes(path, checkpoint.open_checkpoint(path), one.parts.facts.identity, {})
