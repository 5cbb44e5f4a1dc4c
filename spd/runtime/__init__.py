"""Decoding runtimes: one tensor-free schedule (`schedule.py`), one decoding loop (`pipeline.py`), and the
executors that run the stages (`local.py` in-process, `distributed/` one process per stage)."""
