"""Decoding runtimes: one tensor-free schedule (`schedule.py`), one decoding loop (`pipeline.py`), and the
executors that run the stages (`local.py` in-process, `distributed/` one process per stage).

Torch-free: the configs read the runtimes' names from here before anything heavy is imported."""

RUNTIMES = ("local", "distributed", "streams")
