"""GGN diagonals and their per-sample terms, at the original's module path."""

from backpack.extensions.secondorder import (
    BatchDiagGGNExact,
    BatchDiagGGNMC,
    DiagGGNExact,
    DiagGGNMC,
)

__all__ = ["DiagGGNExact", "DiagGGNMC", "BatchDiagGGNExact", "BatchDiagGGNMC"]
