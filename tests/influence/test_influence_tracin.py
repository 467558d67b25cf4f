"""`backpack.influence.tracin` against explicit sums of learning rate × gradient dot products."""

from __future__ import annotations

import pytest
import torch
from influence_problems import PROBLEMS, Reference

from backpack.influence import tracin


def checkpoints(problem, count=3):
    models = []
    for c in range(count):
        model = problem.model()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.3 * c * torch.randn_like(p))
        models.append(model)
    return models


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_tracin_of_models(name, reduction):
    problem = PROBLEMS[name]
    models = checkpoints(problem)
    lrs = [0.5, 0.2, 0.1]
    scores = tracin(models, problem.make_loss(reduction), problem.query(), problem.train(), lrs)
    expected = 0
    for model, lr in zip(models, lrs):
        ref = Reference(problem, model)
        expected = expected + lr * ref.query_grads() @ ref.train_grads().T
    torch.testing.assert_close(scores, expected, atol=1e-10, rtol=1e-8)


def test_tracin_of_state_dicts_restores_the_model():
    problem = PROBLEMS["mlp"]
    models = checkpoints(problem)
    states = [m.state_dict() for m in models]
    target = problem.model()
    with torch.no_grad():
        target[0].weight.mul_(2)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    lossfunc = problem.make_loss("mean")
    scores = tracin(states, lossfunc, problem.query(), problem.train(), 0.1, model=target)
    expected = tracin(models, lossfunc, problem.query(), problem.train(), [0.1] * 3)
    torch.testing.assert_close(scores, expected, atol=1e-12, rtol=1e-10)
    for k, v in target.state_dict().items():
        assert torch.equal(v, before[k])


def test_tracin_errors():
    problem = PROBLEMS["mlp"]
    lossfunc = problem.make_loss("mean")
    models = checkpoints(problem, 2)
    with pytest.raises(ValueError, match="at least one"):
        tracin([], lossfunc, problem.query(), problem.train(), 0.1)
    with pytest.raises(ValueError, match="learning rates"):
        tracin(models, lossfunc, problem.query(), problem.train(), [0.1])
    with pytest.raises(ValueError, match="model="):
        tracin([models[0].state_dict()], lossfunc, problem.query(), problem.train(), 0.1)
