"""SPD: Speculative Pipeline Decoding — speculation module, staged target and lossless pipelined decoding."""

__version__ = "0.1.0"
