"""Helper modules that make more models expressible as plain containers of modules."""
