"""The frozen target: loading, the project's KV cache, and stage splitting (outside the model class)."""

# the dtypes a target may be loaded in (`dtype=`); torch-free, so the configs check names before torch loads
DTYPE_NAMES = ("float32", "bfloat16", "float16")
