"""The package version: the one place it is written (pyproject.toml and the docs read it)."""

__version__ = "0.3.0"
