"""The frozen target: loading, the project's KV cache, and stage splitting (outside the model class)."""
