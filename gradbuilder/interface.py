"""The names of the training graphs' interface, defined once.

A loop (``TrainingSession``, onnxruntime-training's on-device API, a JavaScript program) binds
each state input ``X`` of one run to the output ``X.updated`` of the run before, so these names
are part of the written models' contract; every module that writes or reads such a graph
spells them through this module.
"""

STEP = "Step"  # int64 scalar: optimizer updates done so far
LEARNING_RATE = "Learning_Rate"  # float scalar input
ACCUMULATION_STEP = "Accumulation_Step"  # int64 scalar: micro-steps into the current accumulation
LOSS_SCALE = "Loss_Scale"  # float scalar: the dynamic loss scale
LOSS_SCALE_GOOD_STEPS = "Loss_Scale_Good_Steps"  # int64 scalar: finite steps since the scale last changed
ALL_FINITE = "All_Finite"  # bool output: this run's loss and gradients are finite (else it changed nothing)
GRADIENT_SQUARES = "Gradient_Squares"  # float scalar input: the squared global gradient norm, summed across processes
FLAT_WEIGHTS = "Weights"  # prefix of a flat state's group buffers: Weights.float32 (training.stages.flat)

UPDATED = ".updated"  # suffix of the output that carries a state input to the next run
GRAD_ACCUM = ".grad_accum"  # suffix of a weight's gradient accumulation buffer
GRADIENT = "_grad"  # suffix of a weight's gradient output
GRADIENT_OUTPUT = "_grad_output"  # suffix of the backward input taking an output's gradient (split graphs)


def updated(name: str) -> str:
    """The output that carries state input ``name`` to the next run: ``name.updated``."""
    return name + UPDATED


def grad_accum(weight: str) -> str:
    """The gradient accumulation buffer of ``weight``: ``weight.grad_accum``."""
    return weight + GRAD_ACCUM


def state_of(weight: str, state: str) -> str:
    """The input holding optimizer state ``state`` of ``weight``: ``weight.state``."""
    return f"{weight}.{state}"


def state_input(output: str) -> str | None:
    """The state input an output name carries (``X`` for ``X.updated``), or None."""
    return output[: -len(UPDATED)] if output.endswith(UPDATED) else None
