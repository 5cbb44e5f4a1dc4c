"""Scripts that measured a design question the product has settled (experiments/README.md); run one from the
repository root as `python -m experiments.<name> ...`. A repository tool, not part of the spd wheel."""
