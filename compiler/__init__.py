"""Model config normalization, architecture registry, model definitions, tracing and artifact build."""
