"""The frozen target: loading, the project's KV cache, and stage splitting (outside the model class)."""

# the dtypes a target may be loaded in (`dtype=`); torch-free, so the configs check names before torch loads
DTYPE_NAMES = ("float32", "bfloat16", "float16")
# what a target's products read (`weights=`): the float32 weights, or a GGUF file's own 4- and 8-bit blocks
# (spd.targets.blocks; the same bits, fewer bytes a token)
WEIGHT_NAMES = ("float32", "q4")
