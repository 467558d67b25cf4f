import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
# tiny float64 problems: one thread avoids oversubscription when pytest-xdist runs workers
torch.set_num_threads(1)

# Devices (see the README): BACKPACK_TEST_DEVICE=cuda moves every problem of the shared table
# to the GPU; BACKPACK_TEST_DEFAULT_DEVICE=cuda makes it torch's default device for the whole
# suite, as a user calling torch.set_default_device would. On GPUs both keep TF32 off, so float32
# tests compare exact products (cuDNN convolutions and RNNs would otherwise round to TF32).
DEFAULT_DEVICE = os.environ.get("BACKPACK_TEST_DEFAULT_DEVICE")
if DEFAULT_DEVICE:
    torch.set_default_device(DEFAULT_DEVICE)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


@pytest.fixture(autouse=True)
def _shape_only_records_everywhere(monkeypatch):
    """Records of Conv/Linear keep shape-only NaN stand-ins of their outputs whatever their size
    (in use only from 64K elements): every test then shows a rule that reads output values."""
    from backpack import recording

    monkeypatch.setattr(recording, "SHAPE_ONLY_MIN_ELEMENTS", 0)


@pytest.fixture(autouse=True)
def _problems_valid_on_the_device(request):
    """Skip a problem of the table whose model plain PyTorch refuses on the test device."""
    from problems import DEVICE

    problem = getattr(getattr(request.node, "callspec", None), "params", {}).get("problem")
    reason = getattr(problem, "options", {}).get("not_on_cuda")
    if reason and (DEVICE.type == "cuda" or os.environ.get("BACKPACK_CUDA_CHECK_DEVICE")):
        pytest.skip(f"not a valid model on CUDA: {reason}")


@pytest.fixture(autouse=True)
def _seed_and_dtype(request):
    """Every test starts from the same seed; problems build their own float64 tensors."""
    torch.manual_seed(0)
    if request.node.get_closest_marker("cpu_only") is not None:
        # tests of CPU-only code paths (or of references that live on the CPU by design)
        with torch.device("cpu"):
            yield
    else:
        yield


def pytest_collection_modifyitems(items):
    """Problems of the shared table may mark tests as known failures (strict xfail).

    `Problem.options["xfail"]` is a reason (every test of that problem) or a dict from test
    function name to reason (only those tests); strict, so a fix shows up as XPASS.
    """
    for item in items:
        callspec = getattr(item, "callspec", None)
        problem = callspec.params.get("problem") if callspec is not None else None
        xfail = getattr(problem, "options", {}).get("xfail") if problem is not None else None
        if isinstance(xfail, dict):
            xfail = xfail.get(item.originalname)
        if xfail:
            item.add_marker(pytest.mark.xfail(strict=True, reason=xfail))
