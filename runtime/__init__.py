"""Load an artifact and drive batched decode. Never imports ``kiln.compiler``: the runtime knows
artifacts, not architectures."""
