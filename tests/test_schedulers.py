"""Learning-rate schedules against torch's schedulers (LambdaLR with transformers' formulas,
StepLR) and transformers' own functions; state dicts; argument checks."""

import json
import math

import pytest
import torch

from gradbuilder.runtime import schedulers
from gradbuilder.errors import InvalidArgumentError

LR0 = 0.03
STEPS = 50


# transformers' lr_lambda formulas (transformers/optimization.py), written out
def linear_lambda(warmup, total):
    def f(step):
        if step < warmup:
            return float(step) / float(max(1, warmup))
        return max(0.0, float(total - step) / float(max(1, total - warmup)))
    return f


def cosine_lambda(warmup, total, num_cycles=0.5, min_lr_rate=0.0):
    def f(step):
        if step < warmup:
            return float(step) / float(max(1, warmup))
        progress = float(step - warmup) / float(max(1, total - warmup))
        factor = 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress))
        return max(0.0, factor * (1 - min_lr_rate) + min_lr_rate)
    return f


def constant_lambda(warmup):
    def f(step):
        return float(step) / float(max(1.0, warmup)) if step < warmup else 1.0
    return f


def torch_lrs(make_scheduler, steps=STEPS):
    """The learning rate torch's scheduler gives after 0, 1, ..., steps scheduler steps."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR0)
    scheduler = make_scheduler(optimizer)
    lrs = [scheduler.get_last_lr()[0]]
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
        lrs.append(scheduler.get_last_lr()[0])
    return lrs


def our_lrs(schedule, steps=STEPS):
    lrs = [schedule.current_lr]
    lrs += [schedule.step() for _ in range(steps)]
    assert schedule.step_count == steps
    assert [schedule.lr(i) for i in range(steps + 1)] == lrs
    return lrs


def lambda_lr(lam):
    return lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lam)


CASES = [  # (name, kwargs, torch scheduler); total_steps < STEPS checks what comes after the end
    ("linear", dict(warmup_steps=10, total_steps=40), lambda_lr(linear_lambda(10, 40))),
    ("linear", dict(warmup_steps=0, total_steps=50), lambda_lr(linear_lambda(0, 50))),
    ("linear", dict(warmup_steps=7, total_steps=7), lambda_lr(linear_lambda(7, 7))),
    ("cosine", dict(warmup_steps=5, total_steps=45), lambda_lr(cosine_lambda(5, 45))),
    ("cosine", dict(warmup_steps=0, total_steps=30, num_cycles=2.0), lambda_lr(cosine_lambda(0, 30, 2.0))),
    ("cosine", dict(warmup_steps=8, total_steps=40, min_lr=0.003),
     lambda_lr(cosine_lambda(8, 40, min_lr_rate=0.003 / LR0))),
    ("cosine", dict(warmup_steps=3, total_steps=20, num_cycles=1.25, min_lr=0.01),
     lambda_lr(cosine_lambda(3, 20, 1.25, min_lr_rate=0.01 / LR0))),
    ("constant_with_warmup", dict(warmup_steps=12), lambda_lr(constant_lambda(12))),
    ("constant_with_warmup", dict(warmup_steps=0), lambda_lr(constant_lambda(0))),
    ("step", dict(step_size=7), lambda opt: torch.optim.lr_scheduler.StepLR(opt, 7)),
    ("step", dict(step_size=1, gamma=0.9), lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)),
    ("step", dict(step_size=10, gamma=2.0), lambda opt: torch.optim.lr_scheduler.StepLR(opt, 10, gamma=2.0)),
]


@pytest.mark.parametrize("name,kwargs,torch_scheduler", CASES)
def test_matches_torch(name, kwargs, torch_scheduler):
    ours = our_lrs(schedulers.make(name, LR0, **kwargs))
    assert ours == pytest.approx(torch_lrs(torch_scheduler), rel=1e-12, abs=1e-15)


def test_matches_transformers():
    from transformers import optimization as hf

    cases = [
        (schedulers.LinearWarmupDecay(LR0, 10, 40),
         lambda opt: hf.get_linear_schedule_with_warmup(opt, 10, 40)),
        (schedulers.Cosine(LR0, 5, 45), lambda opt: hf.get_cosine_schedule_with_warmup(opt, 5, 45)),
        (schedulers.Cosine(LR0, 5, 30, num_cycles=1.5),
         lambda opt: hf.get_cosine_schedule_with_warmup(opt, 5, 30, num_cycles=1.5)),
        (schedulers.Cosine(LR0, 6, 40, min_lr=0.002),
         lambda opt: hf.get_cosine_with_min_lr_schedule_with_warmup(opt, 6, 40, min_lr=0.002)),
        (schedulers.ConstantWithWarmup(LR0, 9), lambda opt: hf.get_constant_schedule_with_warmup(opt, 9)),
    ]
    for ours, theirs in cases:
        assert our_lrs(ours) == pytest.approx(torch_lrs(theirs), rel=1e-12, abs=1e-15), ours


def test_shapes_of_the_schedules():
    linear = schedulers.LinearWarmupDecay(1.0, warmup_steps=4, total_steps=12)
    assert [linear.lr(s) for s in (0, 2, 4, 8, 12, 20)] == [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    cosine = schedulers.Cosine(1.0, warmup_steps=0, total_steps=10, min_lr=0.2)
    assert cosine.lr(0) == 1.0 and cosine.lr(5) == pytest.approx(0.6) and cosine.lr(10) == pytest.approx(0.2)
    step = schedulers.Step(8.0, step_size=3, gamma=0.5)
    assert [step.lr(s) for s in range(7)] == [8.0, 8.0, 8.0, 4.0, 4.0, 4.0, 2.0]


def test_callable():
    schedule = schedulers.make(lambda step: 0.1 / (1 + step), LR0)
    assert isinstance(schedule, schedulers.Callable)
    assert schedule.current_lr == 0.1
    assert [schedule.step() for _ in range(3)] == [0.1 / 2, 0.1 / 3, 0.1 / 4]
    state = schedule.state_dict()
    assert state["name"] == "callable" and state["step_count"] == 3 and "not saved" in state["note"]
    assert not any(callable(v) for v in state.values())
    json.dumps(state)


@pytest.mark.parametrize("value", [-0.1, float("nan"), float("inf"), "0.1", None, True])
def test_callable_result_is_checked(value):
    schedule = schedulers.Callable(LR0, lambda step: value)
    with pytest.raises(InvalidArgumentError, match="returned"):
        schedule.lr(0)


@pytest.mark.parametrize("name,kwargs", [(name, kwargs) for name, kwargs, _ in CASES])
def test_state_dict_round_trip_continues_identically(name, kwargs):
    uninterrupted = schedulers.make(name, LR0, **kwargs)
    want = our_lrs(uninterrupted, 40)[18:]

    first = schedulers.make(name, LR0, **kwargs)
    for _ in range(17):
        first.step()
    state = json.loads(json.dumps(first.state_dict()))
    assert set(state) == {"name", "step_count", *type(first).arguments}
    assert state["name"] == name and state["initial_lr"] == LR0 and state["step_count"] == 17
    assert all(state[k] == v for k, v in kwargs.items())
    resumed = schedulers.from_state_dict(state, fn=abs)  # fn matters only to callable schedules
    assert type(resumed) is type(first) and resumed.step_count == 17
    assert [resumed.step() for _ in range(23)] == want  # steps 18..40
    assert resumed.state_dict() == uninterrupted.state_dict()


def test_callable_state_dict_round_trip():
    def fn(step):
        return 0.5 ** step

    schedule = schedulers.Callable(LR0, fn)
    for _ in range(5):
        schedule.step()
    state = json.loads(json.dumps(schedule.state_dict()))
    with pytest.raises(InvalidArgumentError, match="fn"):
        schedulers.from_state_dict(state)
    resumed = schedulers.from_state_dict(state, fn=fn)
    assert resumed.step_count == 5 and resumed.step() == 0.5 ** 6


@pytest.mark.parametrize("state,fn,match", [
    ({"name": "linear", "initial_lr": 0.1, "warmup_steps": 1, "step_count": 0}, None, "total_steps"),
    ({"name": "linear", "initial_lr": 0.1, "warmup_steps": 1, "total_steps": 5}, None, "step_count"),
    ({"name": "step", "initial_lr": 0.1, "step_size": 1, "gamma": 0.5, "step_count": -1}, None, "step_count"),
    ({"name": "step", "initial_lr": 0.1, "step_size": 1, "gamma": 0.5, "step_count": 0, "x": 1}, None, "'x'"),
    ({"name": "warp", "step_count": 0}, None, "name"),
    ([1, 2], None, "name"),
])
def test_bad_state_dict(state, fn, match):
    with pytest.raises(InvalidArgumentError, match=match):
        schedulers.from_state_dict(state, fn=fn)


@pytest.mark.parametrize("make_it,match", [
    (lambda: schedulers.LinearWarmupDecay(0.1, 10, 5), "warmup_steps"),
    (lambda: schedulers.LinearWarmupDecay(0.1, -1, 5), "warmup_steps"),
    (lambda: schedulers.LinearWarmupDecay(0.1, 0, 0), "total_steps"),
    (lambda: schedulers.LinearWarmupDecay(0.1, 1.5, 5), "warmup_steps"),
    (lambda: schedulers.LinearWarmupDecay(0.1, True, 5), "warmup_steps"),
    (lambda: schedulers.LinearWarmupDecay(-0.1, 1, 5), "initial_lr"),
    (lambda: schedulers.LinearWarmupDecay(float("nan"), 1, 5), "initial_lr"),
    (lambda: schedulers.LinearWarmupDecay("0.1", 1, 5), "initial_lr"),
    (lambda: schedulers.Cosine(0.1, 6, 5), "warmup_steps"),
    (lambda: schedulers.Cosine(0.1, 1, 5, num_cycles=0), "num_cycles"),
    (lambda: schedulers.Cosine(0.1, 1, 5, num_cycles=float("inf")), "num_cycles"),
    (lambda: schedulers.Cosine(0.1, 1, 5, min_lr=0.2), "min_lr"),
    (lambda: schedulers.Cosine(0.1, 1, 5, min_lr=-0.01), "min_lr"),
    (lambda: schedulers.ConstantWithWarmup(0.1, -3), "warmup_steps"),
    (lambda: schedulers.Step(0.1, 0), "step_size"),
    (lambda: schedulers.Step(0.1, 2, gamma=0), "gamma"),
    (lambda: schedulers.Step(0.1, 2, gamma=-0.5), "gamma"),
    (lambda: schedulers.Callable(0.1, 3.0), "fn"),
    (lambda: schedulers.make("warp", 0.1), "unknown learning-rate schedule 'warp'"),
    (lambda: schedulers.make(None, 0.1), "unknown learning-rate schedule"),
    (lambda: schedulers.make("linear", 0.1, warmup_steps=1), "total_steps"),
    (lambda: schedulers.make("linear", 0.1, warmup_steps=1, total_steps=5, gamma=2), "gamma"),
    (lambda: schedulers.make(abs, 0.1, warmup_steps=1), "warmup_steps"),
    (lambda: schedulers.Step(0.1, 2).lr(-1), "step"),
    (lambda: schedulers.Step(0.1, 2).lr(1.0), "step"),
])
def test_bad_arguments(make_it, match):
    with pytest.raises(InvalidArgumentError, match=match):
        make_it()


def test_make_builds_each_class():
    assert type(schedulers.make("linear", 0.1, warmup_steps=1, total_steps=5)) is schedulers.LinearWarmupDecay
    assert type(schedulers.make("cosine", 0.1, warmup_steps=1, total_steps=5)) is schedulers.Cosine
    assert type(schedulers.make("constant_with_warmup", 0.1, warmup_steps=1)) is schedulers.ConstantWithWarmup
    assert type(schedulers.make("step", 0.1, step_size=3)) is schedulers.Step
    assert type(schedulers.make(abs, 0.1)) is schedulers.Callable
