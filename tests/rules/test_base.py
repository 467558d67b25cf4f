"""Helpers shared by the rules."""

import torch

from backpack.rules.base import gram


def test_gram_sums_outer_products_over_all_leading_axes():
    torch.manual_seed(0)
    a = torch.randn(3, 4, 2, 5, dtype=torch.float64)
    b = torch.randn(3, 4, 2, 6, dtype=torch.float64)
    rows_a, rows_b = a.reshape(-1, 5), b.reshape(-1, 6)
    expected = sum(torch.outer(x, y) for x, y in zip(rows_a, rows_b))
    torch.testing.assert_close(gram(a, b), expected)
    torch.testing.assert_close(gram(a), sum(torch.outer(x, x) for x in rows_a))
    # non-contiguous leading axes (a transposed view) reshape to the same rows
    torch.testing.assert_close(gram(a.transpose(0, 1)), gram(a))
