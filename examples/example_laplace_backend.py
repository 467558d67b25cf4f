"""laplace-torch's own workflow on backpack's curvature backend: a CNN and a LoRA GPT-2.

laplace-torch (`pip install --no-deps laplace-torch`, see the docs page "Laplace
(laplace-torch)") fits Laplace approximations batch by batch through a curvature *backend*.
`backpack.laplace.LaplaceGGN` is one, selected with `backend=LaplaceGGN`:

1. A small CNN trained on the digits that ship with the package: `Laplace(...)` with the
   diagonal, Kronecker-factored and EK-FAC (`hessian_structure="ekfac"`, added by
   `backpack.laplace`) GGN, `fit` on a DataLoader, the log marginal likelihood, the prior
   precision optimised on it, and the GLM (linearised, probit) predictive on test digits
   compared with the MAP network. The diagonal is checked against `Σ_n J_nᵀ H_n J_n` from
   `torch.func` Jacobians, the GLM predictive's variances against `J P⁻¹ Jᵀ` with the dense
   posterior precision.
2. A tiny GPT-2 (random weights, nothing downloaded) with LoRA adapters on its attention, only
   the adapters trainable, classifying which of three short texts a snippet of characters comes
   from. Batches are dictionaries (`input_ids`, `attention_mask`, `labels`), as a Hugging Face
   data collator gives them; `HuggingFaceLogits` turns the model into the `dict -> logits`
   function laplace-torch calls. laplace-torch's own BackPACK backend refuses both the frozen
   weights and the dict batches; here the same workflow runs, and the diagonal is checked
   against `torch.func` brute force on the adapters.

Needs laplace-torch, and `transformers` and `peft` for part 2.

    python examples/example_laplace_backend.py --train-size 256 --steps 100
"""

from __future__ import annotations

import argparse
import math
import os
import warnings

import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev

from backpack.utils.examples import load_digits_dataset

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach out for weights or configs

TEXTS = [
    "the cat sat on the mat and looked at the rain falling on the garden",
    "stocks rose sharply today as markets priced in lower interest rates",
    "add two eggs to the flour and stir the batter until it is smooth",
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train-size", type=int, default=256, help="training digits")
    parser.add_argument("--test-size", type=int, default=256, help="test digits")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--channels", type=int, default=4)
    parser.add_argument("--steps", type=int, default=100, help="training steps per model")
    parser.add_argument("--snippets", type=int, default=48, help="text snippets (part 2)")
    parser.add_argument("--context", type=int, default=12, help="characters per snippet")
    parser.add_argument("--dim", type=int, default=16, help="GPT-2 width")
    parser.add_argument("--rank", type=int, default=4, help="LoRA rank")
    parser.add_argument("--no-gpt", action="store_true", help="skip part 2")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


# --- brute force (torch.func, no backpack) ----------------------------------------------------


def brute_jacobians(model: nn.Module, X) -> tuple[Tensor, Tensor]:
    """`[N, C, P]` Jacobians of the logits w.r.t. the trainable parameters, and the logits."""
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    jac = jacrev(lambda pp: functional_call(model, pp, (X,)))(params)
    with torch.no_grad():
        f = model(X)
    return torch.cat([j.flatten(2) for j in jac.values()], dim=2), f


def brute_ggn(model: nn.Module, X) -> tuple[Tensor, Tensor]:
    """`Σ_n J_nᵀ (diag(p_n) − p_n p_nᵀ) J_n` of the summed cross-entropy, and the Jacobians."""
    J, f = brute_jacobians(model, X)
    p = f.softmax(-1)
    H = torch.diag_embed(p) - torch.einsum("nc,nd->ncd", p, p)
    return torch.einsum("ncp,ncd,ndq->pq", J, H, J), J


# --- helpers ---------------------------------------------------------------------------------


def train(model: nn.Module, batches, steps: int, lr: float = 1e-2) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=lr)
    batches = list(batches)
    for step in range(steps):
        X, y = batches[step % len(batches)]
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(X), y).backward()
        optimizer.step()


def nll_and_accuracy(probs: Tensor, y: Tensor) -> tuple[float, float, float]:
    """Mean NLL of the labels, accuracy, and mean confidence (the largest probability)."""
    nll = -probs[torch.arange(len(y)), y].clamp_min(1e-12).log().mean().item()
    accuracy = (probs.argmax(-1) == y).double().mean().item()
    return nll, accuracy, probs.max(-1).values.mean().item()


def laplace_workflow(model, likelihood, structure, loader, backend):
    """laplace-torch's own steps: fit, marginal likelihood, prior precision by marglik."""
    from laplace import Laplace

    la = Laplace(
        model, likelihood, subset_of_weights="all", hessian_structure=structure, backend=backend
    )
    la.fit(loader)
    before = la.log_marginal_likelihood().item()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "By default `link_approx` is `probit`")
        la.optimize_prior_precision(method="marglik", n_steps=50)
    after = la.log_marginal_likelihood().item()
    assert math.isfinite(before) and after >= before - 1e-6, (before, after)
    return la, before, after


# --- part 1: a CNN on digits -----------------------------------------------------------------


def digits_part(args: argparse.Namespace) -> dict[str, object]:
    from backpack.laplace import LaplaceGGN

    X_all, y_all = load_digits_dataset()
    X_all = nn.functional.avg_pool2d(X_all, 4).double()  # 7x7 images
    g = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(y_all), generator=g)
    train_idx = order[: args.train_size]
    test_idx = order[args.train_size : args.train_size + args.test_size]
    X, y, X_test, y_test = X_all[train_idx], y_all[train_idx], X_all[test_idx], y_all[test_idx]
    torch.manual_seed(args.seed)
    model = nn.Sequential(
        nn.Conv2d(1, args.channels, 3, stride=2), nn.Tanh(), nn.Flatten(),
        nn.Linear(args.channels * 3 * 3, 10),
    ).double()
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(X, y), batch_size=args.batch_size
    )
    train(model, loader, args.steps)
    model.eval()
    with torch.no_grad():
        map_probs = model(X_test).softmax(-1)
    results = {"map": nll_and_accuracy(map_probs, y_test)}
    P = sum(p.numel() for p in model.parameters())
    print(f"CNN on {len(y)} digits, {P} parameters; test NLL / accuracy / mean confidence:")
    print(f"  MAP                    {results['map'][0]:.4f} / {results['map'][1]:.3f} / "
          f"{results['map'][2]:.3f}")
    ggn, _ = brute_ggn(model, X)
    for structure in ("diag", "kron", "ekfac"):
        la, before, after = laplace_workflow(model, "classification", structure, loader,
                                             LaplaceGGN)
        probs = la(X_test, pred_type="glm", link_approx="probit")
        results[structure] = nll_and_accuracy(probs, y_test)
        tau = la.prior_precision.item()
        print(
            f"  GLM, {structure:5s} GGN       {results[structure][0]:.4f} / "
            f"{results[structure][1]:.3f} / {results[structure][2]:.3f}   (log marglik "
            f"{before:.1f} -> {after:.1f}, prior precision {tau:.3g})"
        )
        if structure == "diag":
            error = (la.H - ggn.diagonal()).abs().max().item()
            assert error <= 1e-9 * ggn.diagonal().abs().max().item(), error
            J, _ = brute_jacobians(model, X_test[:8])
            _, f_var = la._glm_predictive_distribution(X_test[:8])
            expected = J @ (J / la.posterior_precision.reshape(1, 1, -1)).transpose(1, 2)
            torch.testing.assert_close(f_var, expected, rtol=1e-8, atol=1e-12)
            print(f"    diagonal GGN = torch.func Σ JᵀHJ (max error {error:.1e}); "
                  "GLM variances = J P⁻¹ Jᵀ")
    worse = [s for s in ("diag", "kron", "ekfac") if results[s][0] > results["map"][0]]
    if worse:
        under = all(results[s][2] < results[s][1] for s in worse)
        print(
            f"  -> the GLM predictive's NLL is above MAP's for {', '.join(worse)}"
            + (
                ": it is underconfident (mean confidence below accuracy). The prior precision "
                "that maximises the marginal likelihood of a network trained without that "
                "prior, on a few hundred digits, leaves the logits too much spread; the "
                "accuracy is MAP's. `optimize_prior_precision(method=\"gridsearch\", "
                "val_loader=...)` tunes it for predictions instead."
                if under
                else ": the marginal likelihood's prior precision does not carry over to the "
                "test digits here."
            )
        )
    return results


# --- part 2: a LoRA GPT-2 on dict batches ------------------------------------------------------


def text_batches(args: argparse.Namespace, vocab: dict[str, int]):
    g = torch.Generator().manual_seed(args.seed + 1)
    rows = []
    for i in range(args.snippets):
        label = i % len(TEXTS)
        text = TEXTS[label]
        start = int(torch.randint(0, len(text) - args.context, (1,), generator=g))
        ids = torch.tensor([vocab[c] for c in text[start : start + args.context]])
        mask = torch.ones(args.context, dtype=torch.long)
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": torch.tensor(label)})
    return rows


def gpt_part(args: argparse.Namespace) -> dict[str, object]:
    from laplace.curvature import BackPackGGN
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2ForSequenceClassification

    from backpack.laplace import HuggingFaceLogits, LaplaceGGN

    chars = sorted(set("".join(TEXTS)))
    vocab = {c: i + 1 for i, c in enumerate(chars)}  # 0: padding
    torch.manual_seed(args.seed)
    config = GPT2Config(
        vocab_size=len(vocab) + 1, n_positions=args.context, n_embd=args.dim, n_layer=1,
        n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
        eos_token_id=0, pad_token_id=0, num_labels=len(TEXTS),
    )
    lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
                      target_modules=["c_attn"], fan_in_fan_out=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(GPT2ForSequenceClassification(config), lora)
    model = HuggingFaceLogits(peft_model).double()
    # peft freezes the base model (the classifier head too, without modules_to_save)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    rows = text_batches(args, vocab)
    loader = torch.utils.data.DataLoader(rows, batch_size=16)
    train(model, ((b, b["labels"]) for b in loader), args.steps, lr=3e-2)
    model.eval()
    P = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"\nLoRA GPT-2 (r={args.rank}) on {len(rows)} text snippets, dict batches, {P} "
          f"trainable of {sum(p.numel() for p in model.parameters())} parameters:")
    try:
        from laplace import Laplace

        Laplace(model, "classification", subset_of_weights="all", hessian_structure="diag",
                backend=BackPackGGN)
        refused = None
    except ValueError as error:  # expected: the base model is frozen
        refused = str(error)
    if refused:
        print(f"  laplace-torch's own BackPACK backend refuses this model, as expected (frozen "
              f"base weights): \"{refused.rstrip('.')}\". backpack.laplace.LaplaceGGN "
              "takes it:")
    else:
        print("  laplace-torch's own BackPACK backend accepted this model")
    full = {k: torch.stack([r[k] for r in rows]) for k in ("input_ids", "attention_mask")}
    ggn, _ = brute_ggn(model, full)
    results = {"refused": refused}
    for structure in ("diag", "kron"):
        la, before, after = laplace_workflow(model, "classification", structure, loader,
                                             LaplaceGGN)
        batch = next(iter(loader))
        probs = la(batch, pred_type="glm", link_approx="probit")
        results[structure] = nll_and_accuracy(probs, batch["labels"])
        print(f"  {structure:5s}: log marglik {before:.1f} -> {after:.1f}, prior precision "
              f"{la.prior_precision.item():.3g}, GLM NLL / accuracy of one batch "
              f"{results[structure][0]:.3f} / {results[structure][1]:.3f}")
        if structure == "diag":
            error = (la.H - ggn.diagonal()).abs().max().item()
            assert error <= 1e-8 * ggn.diagonal().abs().max().item(), error
            print(f"    diagonal GGN of the adapters = torch.func Σ JᵀHJ (max error {error:.1e})")
    return results


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    results = {"digits": digits_part(args)}
    if not args.no_gpt:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "There is a performance drop")
            results["gpt2"] = gpt_part(args)
    return results


if __name__ == "__main__":
    main()
