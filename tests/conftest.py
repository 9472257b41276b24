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
