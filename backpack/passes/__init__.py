"""The passes of one backward: each receives the backward's state (`BackwardState`) as plain data.

- `first_order`: per-sample gradients and their reductions;
- `curvature`: curvature of each parameter from the loss-Hessian factors at its calls;
- `coverage`: whether extended calls account for a parameter's whole gradient;
- `views`: calls seen with their samples first and placed among the pass's samples.

The curvature propagation itself (`backpack.secondorder`) and KFRA (`backpack.kfra`) are passes
too; they keep their module paths, which messages and settings name.
"""
