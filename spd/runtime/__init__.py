"""Decoding runtimes: the tensor-free pipeline schedule (`schedule.py`), the decoders — SPD's step loop
(`pipeline.py`), FlowSpec's segments (`segments.py`), the draft-then-verify chain (`chain.py`), plain AR (`ar.py`),
many requests per forward (`batch.py`, `seed.py`), the device steps (`device_step.py`, `device_chain.py`,
`device_pipeline.py`) — and the executors that run the stages (`local.py` in-process, `streams.py` fixed-shape
steps, `distributed/` one process per stage). What each runtime is and can do is named in spd/runtimes.py; which
decoder runs where, in spd/decoders.py."""
