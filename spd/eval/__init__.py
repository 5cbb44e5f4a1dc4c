"""Evaluation: the benchmark harness, the exact fast evaluators it scores greedy runs with, its reports and the
measured-cost speedup."""
