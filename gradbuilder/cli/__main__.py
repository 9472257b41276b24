"""``python -m gradbuilder.cli``: the ``gradbuilder`` command (torch's launcher starts each
process of ``train --nproc-per-node N`` this way)."""

import sys

from . import main

sys.exit(main())
