"""Which training digits support or oppose a prediction: influence functions with EK-FAC.

A small classifier is trained on handwritten digits (the 8x8 digits bundled with the package,
scaled to MNIST's format). `backpack.influence.fit` then fits EK-FAC to the training set's
Fisher once, and `scores` gives for every test image q and training image t

    s(q, t) = ∇ℓ_qᵀ (F + λI)⁻¹ ∇ℓ_t,

positive for training images whose gradient step lowers the test image's loss (proponents,
"helpful") and negative for those that raise it (opponents, "harmful"). The script prints, for a
few test images, the image and its most helpful and most harmful training images as text.

Checks: the scores equal dense linear algebra with per-sample gradients from `torch.func` and the
fitted EK-FAC written out as a matrix, and TracIn at the final parameters (one checkpoint)
equals the gradient dot products.

    python examples/example_influence_digits.py --train 500 --test 3
"""

from __future__ import annotations

import argparse

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

from backpack.influence import fit, tracin
from backpack.utils.examples import load_digits_dataset

_SHADES = " .:-=+*#%@"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train", type=int, default=500, help="training digits")
    parser.add_argument("--test", type=int, default=3, help="test digits to explain")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=16)
    parser.add_argument("--train-steps", type=int, default=300)
    parser.add_argument("--top", type=int, default=3, help="helpful/harmful images shown")
    parser.add_argument(
        "--strategy", default="ekfac", choices=["identity", "diagonal", "kfac", "ekfac"]
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def ascii_image(image: Tensor) -> list[str]:
    """A digit as 10 lines of 10 characters: its 20x20 box, 2x2 average pooling, dark = high."""
    box = image.reshape(1, 1, 28, 28)[:, :, 4:24, 4:24]
    small = nn.functional.avg_pool2d(box, 2)[0, 0]
    low, high = small.min(), small.max()
    levels = ((small - low) / (high - low + 1e-12) * (len(_SHADES) - 1)).round().long()
    return ["".join(_SHADES[v] for v in row) for row in levels.tolist()]


def side_by_side(images: list[Tensor], captions: list[str]) -> str:
    """Images next to each other, each under its caption."""
    columns = [ascii_image(im) for im in images]
    width = max(12, *(len(c) for c in captions))
    lines = ["  ".join(f"{c:<{width}}" for c in captions)]
    for r in range(len(columns[0])):
        lines.append("  ".join(f"[{col[r]}]".ljust(width) for col in columns))
    return "\n".join(lines)


def per_sample_grads(model: nn.Module, X: Tensor, y: Tensor) -> Tensor:
    """`[n, P]`: each example's gradient of its own loss, with `torch.func` (no backpack)."""
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss(p, x, t):
        out = functional_call(model, p, (x.unsqueeze(0),))
        return nn.functional.cross_entropy(out, t.unsqueeze(0), reduction="sum")

    g = vmap(grad(loss), in_dims=(None, 0, 0))(params, X, y)
    return torch.cat([g[n].flatten(1) for n in params], dim=1)


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    images, labels = load_digits_dataset()
    order = torch.randperm(len(labels))
    images, labels = images[order].double(), labels[order]
    X_train, y_train = images[: args.train], labels[: args.train]
    X_test, y_test = images[args.train : args.train + args.test], labels[args.train :][: args.test]

    model = nn.Sequential(
        nn.AvgPool2d(4),  # 7x7 inputs keep the dense check cheap
        nn.Flatten(),
        nn.Linear(49, args.hidden),
        nn.Tanh(),
        nn.Linear(args.hidden, 10),
    ).double()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(args.train_steps):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(X_train), y_train).backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        accuracy = (model(X_train).argmax(1) == y_train).double().mean().item()
        predictions = model(X_test).argmax(1)
    print(f"trained on {args.train} digits: training accuracy {accuracy:.3f}")

    def batches(X, y):
        return [
            (X[i : i + args.batch_size], y[i : i + args.batch_size])
            for i in range(0, len(y), args.batch_size)
        ]

    train, query = batches(X_train, y_train), batches(X_test, y_test)
    lossfunc = nn.CrossEntropyLoss()
    influence = fit(model, lossfunc, train, strategy=args.strategy)
    scores = influence.scores(query, train)
    print(
        f"{args.strategy} fitted on {influence.info.get('num_samples', args.train)} digits; "
        f"scores {tuple(scores.shape)}"
    )

    # check: dense linear algebra with independent per-sample gradients
    G_test = per_sample_grads(model, X_test, y_test)
    G_train = per_sample_grads(model, X_train, y_train)
    if args.strategy == "identity":
        expected = G_test @ G_train.T
    else:
        dense = torch.block_diag(*[b.dense(b.values) for b in influence.blocks])
        damping = torch.cat(
            [
                torch.full((b.numel,), influence.damping[b.name], dtype=dense.dtype)
                for b in influence.blocks
            ]
        )
        expected = G_test @ torch.linalg.solve(dense + torch.diag(damping), G_train.T)
    error = ((scores - expected).abs().max() / expected.abs().max()).item()
    if not error < 1e-8:
        raise AssertionError(f"influence scores differ from dense linear algebra ({error:.1e})")
    dots = tracin([model], lossfunc, query, train, 1.0)
    if not torch.allclose(dots, G_test @ G_train.T, rtol=1e-8, atol=1e-10):
        raise AssertionError("TracIn at one checkpoint differs from the gradient dot products")
    print(f"scores match dense linear algebra with torch.func gradients ({error:.1e})")

    same_label = []
    for i in range(len(y_test)):
        helpful = scores[i].topk(args.top).indices
        harmful = (-scores[i]).topk(args.top).indices
        same_label.append((y_train[helpful] == predictions[i]).double().mean().item())
        print(f"\ntest digit {i}: label {y_test[i].item()}, predicted {predictions[i].item()}")
        shown = [X_test[i]] + [X_train[j] for j in helpful] + [X_train[j] for j in harmful]
        captions = [f"test {y_test[i].item()}"]
        captions += [f"+{scores[i, j]:.2g} ({y_train[j].item()})" for j in helpful]
        captions += [f"{scores[i, j]:.2g} ({y_train[j].item()})" for j in harmful]
        print("  query, then most helpful (+), then most harmful (-): score (training label)")
        print(side_by_side(shown, captions))
    share = sum(same_label) / len(same_label)
    print(f"\nshare of the most helpful images with the predicted label: {share:.2f}")
    return {"scores": scores, "relative_error": error, "same_label": share}


if __name__ == "__main__":
    main()
