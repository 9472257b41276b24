import os
import warnings

import numpy as np
import pytest

os.environ.setdefault("ORT_LOGGING_LEVEL", "3")


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def pytest_configure(config):
    warnings.filterwarnings("ignore", message=".*Initializer .* appears in graph inputs.*")


def pytest_collection_modifyitems(config, items):
    """The long tests first, so that pytest-xdist's workers run them beside the short ones
    instead of finishing on them alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
