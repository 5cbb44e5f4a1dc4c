"""Evaluation: the benchmark harness, its reports and the measured-cost speedup."""
