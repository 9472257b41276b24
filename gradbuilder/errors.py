"""One exception hierarchy for everything gradbuilder refuses to do.

Every message names what was involved (node, op type, domain, opset, value) and what
the user can do about it. Every gradbuilder exception is defined here and importable from
``gradbuilder``; the old homes of two (``gradbuilder.compat.MissingDependencyError``,
``gradbuilder.ortmodule.ExportError``) still name the same classes.
"""


class GradBuilderError(Exception):
    """Root of every error raised by gradbuilder."""


class ModelLoadError(GradBuilderError):
    """The model could not be read: missing file, malformed bytes, unsupported opset."""


class InvalidModelError(GradBuilderError):
    """The model was read but does not type-check or is otherwise inconsistent."""


class InvalidArgumentError(GradBuilderError, ValueError):
    """A name or option given by the caller does not fit the model."""


class UnsupportedOpError(GradBuilderError):
    """A node on the path from the weights to the loss has no gradient rule."""


class GradientRuleError(GradBuilderError):
    """A gradient rule failed or returned something malformed."""


class OutputError(GradBuilderError):
    """The result could not be serialized or written."""


class CheckpointError(GradBuilderError):
    """A checkpoint could not be written, or read back: corrupt, truncated, or from another model."""


class ProviderError(GradBuilderError):
    """An execution provider does not exist, cannot be loaded, or failed."""


class NonFiniteError(GradBuilderError, FloatingPointError):
    """A training step's loss or gradients hold an inf or NaN, and the session was asked to
    raise (``TrainingParameters.on_nonfinite_step = "raise"``); the step changed nothing."""


class DistributedError(GradBuilderError):
    """Distributed training could not start, or a collective failed: another process died,
    raised, or did not answer within the timeout (the message names the rank)."""


class MissingDependencyError(GradBuilderError, ImportError):
    """An optional package a feature needs is not installed; the message names the extra."""


class ExportError(GradBuilderError):
    """torch's exporter could not turn the module into an ONNX graph we can train."""
