"""The benchmarks a user reruns and the data builders they use; run one from the repository root as
`python -m bench.<name> ...` (docs/*.md give each figure's command). A repository tool, not part of the spd wheel.
Stdlib only: bench/gpu_session.py imports this package before any wheel is installed."""
