"""Smoke test of the cost model (benchmarks/cost_model.py): counts at real size on meta tensors.

No timing: the counts are deterministic (aten calls, FLOPs by precision, bytes, peak memory),
so they are checked against what the models' arithmetic must be.
"""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

pytest.importorskip("torchvision")
from benchmarks import cost_model as C  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def resnet():
    return {row: C.count_row("resnet18", row) for row in ("plain", "hooks only", "BatchL2Grad")}


def test_plain_resnet18_counts(resnet):
    plain = resnet["plain"]
    assert isinstance(plain, C.Counts)
    # forward + backward of ResNet-18 at 224x224: 1.82 GMACs per image forward, three times
    # that for forward and backward, 64 images, in cuDNN's precision (TF32 by default)
    gflops = sum(plain.flops.values()) / 1e9
    assert 600 < gflops < 750
    assert plain.syncs == 0 and plain.kernels > 100
    assert 1.0e9 < plain.peak_bytes < 2.0e9


def test_extensions_add_calls_not_host_reads(resnet):
    plain, hooks, l2 = resnet["plain"], resnet["hooks only"], resnet["BatchL2Grad"]
    assert isinstance(hooks, C.Counts) and isinstance(l2, C.Counts)
    assert hooks.flops == plain.flops  # the hooks alone compute nothing
    assert plain.calls <= hooks.calls < l2.calls
    assert l2.syncs == 0  # a steady step reads nothing on the host
    assert l2.peak_bytes < 1.1 * plain.peak_bytes  # squared norms never form [N, *weight]


def test_floors_and_prediction_are_consistent(resnet):
    card, cal = C.CARDS["h100"], C.CALIBRATION
    forward = C.count_row("resnet18", "forward")
    floor_work = C.floors(C.survey("resnet18"), card, cal)
    plain = resnet["plain"]
    plain_time = C.predict(plain, 0.0, card, cal)
    for row in ("BatchL2Grad", "KFAC"):
        floor = C.floor_seconds(plain, forward, floor_work[row], card, cal, 0.0)
        assert floor > plain_time
    l2 = C.predict(resnet["BatchL2Grad"], 0.0, card, cal)
    assert l2 >= C.floor_seconds(plain, forward, ([], False), card, cal, 0.0)


def test_report_marks_targets(monkeypatch):
    lines = C.run(["resnet18"], ["plain", "hooks only", "BatchGrad"], "h100", host=False)
    text = "\n".join(lines)
    plain_row = next(line for line in lines if line.startswith("| plain |"))
    assert plain_row.split("|")[2].strip().endswith("(1.00x)")
    assert "Targets of the GPU issue" in text and ("✓" in text or "✗" in text)
    assert torch.backends.cuda.matmul.allow_tf32 is False  # the rules restored the setting


def test_vit_second_order_rows_are_counted_without_host_reads():
    """ViT-B/16's class token and position embedding take their curvature at their sites (no
    re-run of the model, no value read on the meta device); KFAC's row freezes the position
    embedding, which it refuses."""
    pytest.importorskip("timm")
    counts = {row: C.count_row("vit_b_16", row) for row in ("plain", "DiagGGNMC", "KFAC")}
    for row, c in counts.items():
        assert isinstance(c, C.Counts), (row, c)
        assert c.syncs == 0, row
    assert counts["DiagGGNMC"].calls > counts["plain"].calls
    torch.manual_seed(0)
    model, x, y = C.MODELS["vit_b_16"]("tiny")
    C.make_step("KFAC", model, x.repeat(2, 1, 1, 1), y.repeat(2))()
    assert not model.pos_embed.requires_grad and not hasattr(model.pos_embed, "kfac")
    assert len(model.cls_token.kfac) == 1  # its dense block
