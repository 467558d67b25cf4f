"""Hessian diagonals and their per-sample terms, at the original's module path."""

from backpack.extensions.secondorder import BatchDiagHessian, DiagHessian

__all__ = ["DiagHessian", "BatchDiagHessian"]
