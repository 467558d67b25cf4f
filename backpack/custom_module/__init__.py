"""Helper modules that make more models expressible as plain containers of modules.

- `branching`: `Parallel` (same input to several branches, then a merge module), the merges
  `SumModule`, `MultiplyModule`, `CatModule`, and `ActiveIdentity`;
- `scale_module.ScaleModule`, `permute.Permute`, `slicing.Slicing`, `pad.Pad`,
  `reduce_tuple.ReduceTuple`: functional operations as modules;
- `graph_utils`: `BackpackTracer` and `convert_module_to_backpack`, the `torch.fx` converter
  behind `extend(model, use_converter=True)`.
"""
