#!/usr/bin/env bash
# The GPU run rehearsed on a CPU against a stand-in of the GPU image (docs/gpu.md, "Rehearsal on the image's
# stand-in"): a venv with Python 3.12 and the image's recorded versions (bench/gpu_image.txt: torch 2.11.0+cu130,
# transformers 5.17.0, huggingface_hub 1.33.0, tokenizers 0.23.2, safetensors 0.8.0) and the image packages the
# payload's wheels require, then the payload's wheels installed --no-deps into a site of their own exactly as the
# device's setup installs them (bench.gpu_session.install_wheels), then the import check and the documented calls as
# dry runs on a tiny random target: the whole run, the speed call, and its resume from the rows that call returned.
#
#   bash bench/gpu_image_rehearsal.sh [ROOT]     # ROOT: where the venv, wheels and results go
#                                                 # (default ~/.cache/spd-gpu-rehearsal; never inside the repository)
#
# Needs PyPI (the venv, and the wheels: `python -m bench.gpu_pack wheels`, run with the repository's .venv, whose
# versions the payload carries) and ~5 GiB of disk: PyPI's torch 2.11.0 is the CUDA build with its nvidia-* wheels,
# the image's own build, which imports and runs on a CPU. Exits non-zero at the first step that fails.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
ROOT=${1:-$HOME/.cache/spd-gpu-rehearsal}
PY312=${PY312:-/root/.pyenv/versions/3.12.1/bin/python3.12}      # any CPython 3.12, the image's
[ -x "$PY312" ] || PY312=$(command -v python3.12) || { echo "gpu_image_rehearsal: no python3.12 (set PY312)" >&2; exit 2; }
case "$(realpath -m "$ROOT")/" in
    "$REPO"/*) echo "gpu_image_rehearsal: $ROOT is inside the repository" >&2; exit 2;;
esac
mkdir -p "$ROOT"
start=$(date +%s)
say() { echo "[rehearsal $(( $(date +%s) - start ))s] $*"; }

# 1. the image's stand-in: its recorded versions (the local +cu130 tag is PyPI's default build of 2.11.0)
pins=$(sed -e 's/#.*//' -e 's/+[a-z0-9]*$//' bench/gpu_image.txt | grep '==' | grep -v '^python==' | tr '\n' ' ')
[ -x "$ROOT/venv/bin/python" ] || "$PY312" -m venv "$ROOT/venv"
say "stand-in venv: $pins"
# --isolated: this machine's pip configuration (local indexes, a torch cap) is not the image's
"$ROOT/venv/bin/python" -m pip install -q --isolated --disable-pip-version-check $pins

# 2. the payload's wheels, resolved against bench/gpu_image.txt as `gpu_pack build` resolves them
rm -rf "$ROOT/wheels"
.venv/bin/python -m bench.gpu_pack wheels "$ROOT/wheels"
# what the wheels and the suite itself (pyproject.toml) need that the image holds at an unrecorded version: the
# stand-in takes PyPI's
assumed=$("$ROOT/venv/bin/python" bench/gpu_image_rehearsal_needs.py "$ROOT/wheels/resolved.json")
say "image packages at PyPI's versions: ${assumed:-none}"
[ -z "$assumed" ] || "$ROOT/venv/bin/python" -m pip install -q --isolated --disable-pip-version-check $assumed
"$ROOT/venv/bin/python" -c "import torch, transformers, huggingface_hub as h; print('stand-in: torch', torch.__version__, \
'transformers', transformers.__version__, 'huggingface_hub', h.__version__)"

# 3. the documented calls as dry runs, the wheels installed --no-deps as on the device (a fresh site for each call)
run() {   # NAME, then gpu_session's options
    local name=$1; shift
    rm -rf "$ROOT/runs/$name"
    say "call $name: $*"
    OMP_NUM_THREADS=1 "$ROOT/venv/bin/python" -m bench.gpu_session --device cpu --dry-run --wheels "$ROOT/wheels" \
        --out "$ROOT/runs/$name/out" --work "$ROOT/runs/$name/work" "$@" > "$ROOT/runs/$name.log" 2>&1 \
        || { tail -30 "$ROOT/runs/$name.log"; say "call $name FAILED (log: $ROOT/runs/$name.log)"; exit 1; }
    "$ROOT/venv/bin/python" - "$ROOT/runs/$name/out/session.json" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
print("  imports:", s["steps"]["setup"].get("imports"))
for name, step in s["steps"].items():
    print(f"  {name}: {step['status']}" + (f" {step.get('rows_by_status')}" if step.get("rows_by_status") else ""))
bad = [n for n, st in s["steps"].items() if st["status"] not in ("ok", "skipped")]
sys.exit(f"steps not ok: {bad}" if bad else 0)
EOF
}
mkdir -p "$ROOT/runs"
# the documented speed call's rows; the first call measures the first half (as a call cut by its box would), the
# second resumes from the rows.jsonl the first returned and measures the rest against the resumed reference
FIRST=suite_ar_device_graphs,hf_static_compile,default_device_graphs,spd_device_graphs,spd_lookup_device_graphs,eagle3_device_graphs
ROWS=$FIRST,eagle3_tree_device_graphs,selfdraft_device_graphs,selfdraft_chain,lookup_device_graphs,suite_ar_graphs,suite_ar_device_compiled_graphs,default_device_compiled_graphs
run whole                                                    # every step: the dry run of tests/test_gpu_session.py
run speed --skip correctness,eval --train '' --rows "$FIRST"
run resumed --skip correctness,eval --train '' --rows "$ROWS" --resume "$ROOT/runs/speed/out/rows.jsonl"
"$ROOT/venv/bin/python" - "$ROOT/runs/speed/out/session.json" "$ROOT/runs/resumed/out/session.json" <<'EOF'
import json, sys
first, second = (json.load(open(p))["steps"]["speed"]["runs"]["float32"]["rows"] for p in sys.argv[1:])
measured = [k for k, v in first.items() if "tokens_per_s" in v]
kept = [k for k in measured if second[k].get("resumed")]
new = [k for k, v in second.items() if "tokens_per_s" in v and not v.get("resumed")]
print(f"  speed call: {len(measured)} rows measured; resumed call: {len(kept)} kept, {len(new)} measured, "
      f"verdicts {sorted({second[k].get('verdict') for k in new})}")
assert kept == measured and new and all(second[k].get("verdict") == "equal" for k in new), (kept, measured, new)
EOF
# 4. the real payload (gpu_pack build --no-data: SmolLM2's GGUF, both shipped modules, the wheels) carried part by
# part as the device calls carry it, through the GPU run's own setup (not the dry run's): call 1 unpacks the wheels
# from part 1 alone and checks every import, call 2 stashes, call 3 assembles, verifies, installs, converts the
# target and runs the baseline rows on the real target on this CPU (bfloat16, 3 prompts x 64 tokens)
if [ "${REHEARSE_PAYLOAD:-1}" = 1 ]; then
    say "the payload: gpu_pack build --no-data"
    .venv/bin/python -m bench.gpu_pack build --no-data 2>&1 | grep -v "^WARNING: Location"
    rm -rf "$ROOT/stash" "$ROOT/calls"
    for k in 1 2 3; do
        mkdir -p "$ROOT/calls/$k/pack"
        cp -r ".gpu/part$k" "$ROOT/calls/$k/pack/"
        extra=()
        [ "$k" = 3 ] && extra=(--skip correctness,eval --train '' --box speed=240
                               --rows suite_ar_fixed_eager,suite_ar_device_graphs,eagle3_device_graphs)
        say "device call $k (carries part$k)"
        "$ROOT/venv/bin/python" -m bench.gpu_session --device cpu --minutes 9.5 --pack "$ROOT/calls/$k/pack" \
            --stash "$ROOT/stash" --out "$ROOT/calls/$k/out" --work "$ROOT/calls/$k/work" "${extra[@]}" \
            > "$ROOT/calls/$k.log" 2>&1 || { tail -30 "$ROOT/calls/$k.log"; say "device call $k FAILED"; exit 1; }
        grep -E "imports:|parts missing|payload assembled|step .*: (ok|failed|incomplete)" "$ROOT/calls/$k.log" \
            | sed 's/^/  /'
    done
    "$ROOT/venv/bin/python" - "$ROOT/calls/3/out/session.json" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
env = s["steps"]["env"]["env"]
print(f"  call 3 on torch {env['torch']}, transformers {env['transformers']}, deepspeed {env['deepspeed']}")
rows = s["steps"]["speed"]["runs"]["bfloat16"]["rows"]
for name in ("suite_ar_fixed_eager", "suite_ar_device_graphs", "eagle3_device_graphs"):
    row = rows[name]
    print(f"  {name}: " + (f"{row['tokens_per_s']:.1f} tokens/s on this CPU, {row.get('verdict', 'reference')}"
                           if "tokens_per_s" in row else str(row.get("error") or row.get("skipped"))))
assert all(rows[n].get("tokens_per_s") for n in ("suite_ar_fixed_eager", "suite_ar_device_graphs"))
assert s["steps"]["speed"]["runs"]["bfloat16"]["eagle3_checkpoint"].endswith("smollm2-eagle3")
EOF
fi
say "passed in $(( $(date +%s) - start )) s"
