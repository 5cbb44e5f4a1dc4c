#!/usr/bin/env bash
# The command of every call of a GPU run (docs/gpu.md): the same line each time, only `carry` changes
# (.gpu/part1, then .gpu/part2, ...). Each call stashes the part it carried; the call that completes the set runs
# the whole run (bench/gpu_session.py, <= 9 minutes) and leaves its files in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
exec python3 -m bench.gpu_session --out "${OUT:?the runner sets OUT to the folder it returns}" "$@"
