"""Helper utilities: example data, brute-force references and small tensor tools."""
