"""The PyTorch front end: ``model = ORTModule(model)`` trains a torch.nn.Module through
onnxruntime with the training loop unchanged. Needs PyTorch (``pip install gradbuilder[torch]``)."""

from ..errors import ExportError
from .module import ORTModule
from .options import DebugOptions, LogLevel

__all__ = ["ORTModule", "DebugOptions", "LogLevel", "ExportError"]
