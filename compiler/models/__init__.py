"""Model definitions: thin compositions over the shared layers in ``kiln.compiler.layers``."""
