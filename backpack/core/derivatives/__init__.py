"""Derivatives of module types (convolutions, ...), shared by the rules."""
