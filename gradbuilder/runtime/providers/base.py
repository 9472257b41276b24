"""What the parts of ``providers`` share: the names of the two providers they all speak of and the
one lock over the provider state (probe results, warnings given, cached sessions, plugin
libraries)."""

from __future__ import annotations

import threading

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"

lock = threading.RLock()  # held while any of that state is read or changed
