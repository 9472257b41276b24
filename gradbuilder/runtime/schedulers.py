"""Learning-rate schedules.

A schedule maps ``step``, the number of scheduler steps taken so far (an int >= 0), to a
learning rate, given the initial learning rate ``lr0``. ``w`` is ``warmup_steps`` and ``T`` is
``total_steps``:

    linear                lr = lr0 * step / max(1, w)                     while step < w
    (LinearWarmupDecay)   lr = lr0 * max(0, (T - step) / max(1, T - w))   after
    cosine                lr = lr0 * step / max(1, w)                     while step < w
    (Cosine)              p  = (step - w) / max(1, T - w)
                          f  = max(0, (1 + cos(2 * pi * num_cycles * p)) / 2)
                          lr = min_lr + (lr0 - min_lr) * f                after
    constant_with_warmup  lr = lr0 * step / max(1, w) while step < w, then lr0
    step (Step)           lr = lr0 * gamma ** (step // step_size)
    callable (Callable)   lr = fn(step)

These are the formulas of transformers' ``get_linear_schedule_with_warmup`` (onnxruntime's
``LinearLRScheduler``), ``get_cosine_schedule_with_warmup`` (with ``min_lr`` as in
``get_cosine_with_min_lr_schedule_with_warmup``), ``get_constant_schedule_with_warmup`` and
torch's ``StepLR``. As with torch schedulers, ``step_count`` starts at 0, ``step()`` advances
it by one and returns the new rate, and ``current_lr`` is ``lr(step_count)``.

``state_dict()`` is plain JSON data: ``{"name": ..., <constructor arguments>, "step_count": n}``.
A ``Callable`` schedule cannot save its function: its state holds ``initial_lr`` and the step
count only, and ``from_state_dict(d, fn=...)`` must be given the function again.
"""

import math
import numbers

from ..errors import InvalidArgumentError

__all__ = ["Schedule", "LinearWarmupDecay", "Cosine", "ConstantWithWarmup", "Step", "Callable",
           "make", "from_state_dict"]


def _check_int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidArgumentError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise InvalidArgumentError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_float(name, value, *, positive=False):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise InvalidArgumentError(f"{name} must be a finite number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise InvalidArgumentError(f"{name} must be {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def _check_warmup(warmup_steps, total_steps):
    warmup_steps = _check_int("warmup_steps", warmup_steps, 0)
    total_steps = _check_int("total_steps", total_steps, 1)
    if warmup_steps > total_steps:
        raise InvalidArgumentError(
            f"warmup_steps ({warmup_steps}) must be <= total_steps ({total_steps})")
    return warmup_steps, total_steps


class Schedule:
    """Base class: ``lr(step)``, ``step()``, ``step_count``, ``current_lr``, ``state_dict()``.

    Subclasses set ``name`` (their key in ``make`` and ``state_dict``), ``arguments`` (the
    constructor arguments saved by ``state_dict``) and implement ``_lr(step)``.
    """

    name = ""
    arguments = ("initial_lr",)

    def __init__(self, initial_lr):
        self.initial_lr = _check_float("initial_lr", initial_lr)
        self.step_count = 0

    def lr(self, step):
        """The learning rate after ``step`` scheduler steps (``step`` an int >= 0)."""
        return float(self._lr(_check_int("step", step, 0)))

    def _lr(self, step):
        raise NotImplementedError

    @property
    def current_lr(self):
        """``lr(step_count)``: the rate to use now."""
        return self.lr(self.step_count)

    def step(self):
        """Advance ``step_count`` by one and return the new learning rate."""
        self.step_count += 1
        return self.current_lr

    def state_dict(self):
        """``{"name", <arguments>, "step_count"}`` as plain JSON data."""
        state = {"name": self.name}
        state.update({arg: getattr(self, arg) for arg in self.arguments})
        state["step_count"] = self.step_count
        return state

    def __repr__(self):
        args = ", ".join(f"{arg}={getattr(self, arg)!r}" for arg in self.arguments)
        return f"{type(self).__name__}({args}, step_count={self.step_count})"


def _warmup_factor(step, warmup_steps):
    return step / max(1, warmup_steps)


class LinearWarmupDecay(Schedule):
    """0 -> ``initial_lr`` linearly over ``warmup_steps``, then linearly down to 0 at ``total_steps``
    (and 0 after)."""

    name = "linear"
    arguments = ("initial_lr", "warmup_steps", "total_steps")

    def __init__(self, initial_lr, warmup_steps, total_steps):
        super().__init__(initial_lr)
        self.warmup_steps, self.total_steps = _check_warmup(warmup_steps, total_steps)

    def _lr(self, step):
        w, t = self.warmup_steps, self.total_steps
        if step < w:
            return self.initial_lr * _warmup_factor(step, w)
        return self.initial_lr * max(0.0, (t - step) / max(1, t - w))


class Cosine(Schedule):
    """Linear warmup, then ``min_lr + (initial_lr - min_lr) * max(0, (1 + cos(2 pi num_cycles p)) / 2)``
    with ``p = (step - warmup_steps) / max(1, total_steps - warmup_steps)``. The default
    ``num_cycles=0.5`` is a half cosine from ``initial_lr`` down to ``min_lr`` at ``total_steps``."""

    name = "cosine"
    arguments = ("initial_lr", "warmup_steps", "total_steps", "num_cycles", "min_lr")

    def __init__(self, initial_lr, warmup_steps, total_steps, num_cycles=0.5, min_lr=0.0):
        super().__init__(initial_lr)
        self.warmup_steps, self.total_steps = _check_warmup(warmup_steps, total_steps)
        self.num_cycles = _check_float("num_cycles", num_cycles, positive=True)
        self.min_lr = _check_float("min_lr", min_lr)
        if self.min_lr > self.initial_lr:
            raise InvalidArgumentError(
                f"min_lr ({self.min_lr!r}) must be <= initial_lr ({self.initial_lr!r})")

    def _lr(self, step):
        w, t = self.warmup_steps, self.total_steps
        if step < w:
            return self.initial_lr * _warmup_factor(step, w)
        progress = (step - w) / max(1, t - w)
        factor = max(0.0, 0.5 * (1.0 + math.cos(math.pi * self.num_cycles * 2.0 * progress)))
        return self.min_lr + (self.initial_lr - self.min_lr) * factor


class ConstantWithWarmup(Schedule):
    """0 -> ``initial_lr`` linearly over ``warmup_steps``, then ``initial_lr``."""

    name = "constant_with_warmup"
    arguments = ("initial_lr", "warmup_steps")

    def __init__(self, initial_lr, warmup_steps):
        super().__init__(initial_lr)
        self.warmup_steps = _check_int("warmup_steps", warmup_steps, 0)

    def _lr(self, step):
        if step < self.warmup_steps:
            return self.initial_lr * _warmup_factor(step, self.warmup_steps)
        return self.initial_lr


class Step(Schedule):
    """``initial_lr * gamma ** (step // step_size)``: multiplied by ``gamma`` every ``step_size`` steps."""

    name = "step"
    arguments = ("initial_lr", "step_size", "gamma")

    def __init__(self, initial_lr, step_size, gamma=0.1):
        super().__init__(initial_lr)
        self.step_size = _check_int("step_size", step_size, 1)
        self.gamma = _check_float("gamma", gamma, positive=True)

    def _lr(self, step):
        return self.initial_lr * self.gamma ** (step // self.step_size)


class Callable(Schedule):
    """``fn(step)``: a user function of the step count returning the learning rate, a finite
    float >= 0. ``initial_lr`` is kept for reference only; the function is not saved by
    ``state_dict``."""

    name = "callable"

    def __init__(self, initial_lr, fn):
        super().__init__(initial_lr)
        if not callable(fn):
            raise InvalidArgumentError(f"fn must be callable, got {fn!r}")
        self.fn = fn

    def _lr(self, step):
        value = self.fn(step)
        if (isinstance(value, bool) or not isinstance(value, numbers.Real)
                or not math.isfinite(value) or value < 0):
            raise InvalidArgumentError(
                f"the learning-rate function {self.fn!r} returned {value!r} at step {step}; "
                "it must return a finite number >= 0")
        return value

    def state_dict(self):
        """``{"name": "callable", "initial_lr", "step_count", "note"}``: the function is not saved."""
        state = super().state_dict()
        state["note"] = "the learning-rate function is not saved; pass it as fn to from_state_dict"
        return state


_SCHEDULES = {cls.name: cls for cls in (LinearWarmupDecay, Cosine, ConstantWithWarmup, Step, Callable)}


def make(name_or_callable, initial_lr, **kwargs):
    """A schedule by name ("linear", "cosine", "constant_with_warmup", "step") with its
    constructor's keyword arguments, or ``Callable(initial_lr, fn)`` when given a function."""
    if callable(name_or_callable):
        if kwargs:
            raise InvalidArgumentError(
                f"a callable schedule takes no other arguments, got {sorted(kwargs)}")
        return Callable(initial_lr, name_or_callable)
    names = sorted(n for n in _SCHEDULES if n != Callable.name)
    if not isinstance(name_or_callable, str) or name_or_callable not in names:
        raise InvalidArgumentError(
            f"unknown learning-rate schedule {name_or_callable!r}; use one of {names} or a callable")
    cls = _SCHEDULES[name_or_callable]
    _check_keys(f"schedule {name_or_callable!r}", kwargs, cls, required=False)
    try:
        return cls(initial_lr, **kwargs)
    except TypeError as e:  # a required argument is missing
        raise InvalidArgumentError(f"schedule {name_or_callable!r}: {e}") from None


def _check_keys(what, given, cls, required, extra=()):
    allowed = set(cls.arguments) | set(extra)
    if not required:
        allowed.discard("initial_lr")
    unknown = sorted(set(given) - allowed)
    if unknown:
        raise InvalidArgumentError(f"{what} has no argument(s) {unknown}; it takes {sorted(allowed)}")
    if required:
        missing = sorted(set(cls.arguments) - set(given))
        if missing:
            raise InvalidArgumentError(f"{what} is missing {missing}")


def from_state_dict(d, fn=None):
    """Rebuild a schedule, step count included, from ``state_dict()``. A ``callable``
    schedule needs its function again as ``fn``; other schedules ignore ``fn``."""
    if not isinstance(d, dict) or not isinstance(d.get("name"), str) or d["name"] not in _SCHEDULES:
        raise InvalidArgumentError(
            f"not a schedule state dict (needs 'name', one of {sorted(_SCHEDULES)}): {d!r}")
    cls = _SCHEDULES[d["name"]]
    extra = ("name", "step_count", "note") if cls is Callable else ("name", "step_count")
    _check_keys(f"state dict of schedule {d['name']!r}", d, cls, required=True, extra=extra)
    if "step_count" not in d:
        raise InvalidArgumentError(f"state dict of schedule {d['name']!r} is missing 'step_count'")
    args = {arg: d[arg] for arg in cls.arguments}
    if cls is Callable:
        if fn is None:
            raise InvalidArgumentError(
                "a callable schedule's function is not saved in its state dict; pass it as fn")
        schedule = Callable(fn=fn, **args)
    else:
        schedule = cls(**args)
    schedule.step_count = _check_int("step_count", d["step_count"], 0)
    return schedule
