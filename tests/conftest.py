import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
# tiny float64 problems: one thread avoids oversubscription when pytest-xdist runs workers
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed_and_dtype():
    """Every test starts from the same seed; problems build their own float64 tensors."""
    torch.manual_seed(0)
    yield
