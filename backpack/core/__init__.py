"""Framework-independent math shared by the rules (derivatives of module types)."""
