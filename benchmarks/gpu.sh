#!/usr/bin/env bash
# One command for a GPU machine (README "GPU"): install what is missing, run the GPU tests, time the models.
#
#   make gpu-wheels                      # first, where pip reaches PyPI: the wheels such a machine lacks -> .whl/
#   bash benchmarks/gpu.sh [--released /path/to/LipsFormer] [--out results/DIR] [--python python3]
#       [--only tests,matrix,base]
#
# Uses the machine's own Python and torch (never replaced). Steps, each under its own time limit (a step that runs
# out is killed and reported missing); the default steps (tests, matrix) end within 8 minutes on one H100, so that
# one command of at most 10 minutes holds them; `--only base` is a second command with the same --out (the report
# gathers every result in the folder):
#   1. installs the project and each dependency missing or too old from .whl/ into a target folder
#      (pip --no-index --no-deps), then checks and records every version (versions.json); starts
#      benchmarks/step_cost.py on the CPU beside the GPU steps: the estimate for this card (step_cost.json);
#   2. pytest -m gpu in 4 processes (gpu_tests.log, gpu_tests.xml; no test starts after 120 s, 150 s at most);
#   3. benchmarks/throughput.py --matrix --device cuda --amp bf16 (docs/speed.md's training benchmark; 270 s at
#      most): eager at batch 64 and 256, then compiled (by region) at batch 256 with the compiler's default:
#      lipsformer_swin_t and lipsformer_cswin_t against swin_tiny (and the released implementation with
#      --released), inference and training img/s, ratios, per-FLOP ratios, the bytes autograd saves and the peak
#      allocated (throughput_matrix.json, .log);
#   4. (--only base) benchmarks/throughput.py --device cuda --batch 256 --train-batch 256 --amp bf16:
#      lipsformer_swin_b against swin_base, eager (throughput_base_eager.json, .log);
#   5. one JSON (gpu.json) and one markdown table (gpu.md) of it all, the estimate beside each eager row.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=python3
OUT="results/gpu-$(date -u +%Y%m%dT%H%M%SZ)"
RELEASED=""
ONLY="tests,matrix"
SITE=${LIPSFORMER_SITE:-/tmp/lipsformer-site}
while [ $# -gt 0 ]; do
  case "$1" in
    --released) RELEASED=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --python) PY=$2; shift 2 ;;
    --only) ONLY=$2; shift 2 ;;
    *) echo "error: unknown argument $1 (--released PATH, --out DIR, --python PYTHON, --only STEPS)" >&2; exit 2 ;;
  esac
done
for step in ${ONLY//,/ }; do
  case "$step" in
    tests|matrix|base) ;;
    *) echo "error: --only takes steps among tests, matrix, base (comma-separated), got $step" >&2; exit 2 ;;
  esac
done
want() { [[ ",$ONLY," == *",$1,"* ]]; }
mkdir -p "$OUT"
START=$(date +%s)
stamp() { echo "== $(( $(date +%s) - START )) s: $*"; }

stamp "installing into $SITE"
WHEELS=$("$PY" benchmarks/gpu_check.py requirements .whl) || exit 2
mkdir -p "$SITE"
if [ -n "$WHEELS" ]; then
  # shellcheck disable=SC2086
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" $WHEELS || exit 2
fi
"$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target "$SITE" . \
  || { echo "error: could not install the project (needs setuptools>=68 on this Python)" >&2; exit 2; }
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
"$PY" benchmarks/gpu_check.py requirements .whl >/dev/null || exit 2  # everything satisfied now
"$PY" - "$OUT/versions.json" <<'EOF' || exit 2
import json, platform, subprocess, sys
from importlib import metadata
import torch
if not torch.cuda.is_available():
    sys.exit("error: torch sees no CUDA device")
v = {"device": torch.cuda.get_device_name(0), "python": platform.python_version(), "torch": torch.__version__,
     "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()}
v.update({n: metadata.version(n) for n in ("torchvision", "timm", "accelerate", "fvcore", "lipsformer")})
v["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip()
open(sys.argv[1], "w").write(json.dumps(v, indent=2))
print(v)
EOF

CARD=$("$PY" -c "import torch; n = torch.cuda.get_device_name(0); print('h200' if 'H200' in n else 'a100' if 'A100' in n \
  else 'h100')")
stamp "step-cost estimate for $CARD (CPU, beside the GPU steps)"
timeout 300 "$PY" benchmarks/step_cost.py --gpu "$CARD" --batches 64 256 --json "$OUT/step_cost.json" \
  > "$OUT/step_cost.log" 2>&1 &
COST=$!

if want tests; then
  # in 4 processes (pytest-xdist), 4 CPU threads each: Triton compiles each kernel specialization on its first launch,
  # on the launching thread, and each `accelerate launch` test starts processes of its own (those come first in the
  # file, so that they start at once); pytest starts no test after 120 s and writes what ran (the report counts those
  # not run); the 150 s limit, which loses the XML, is a backstop for a test still running then
  stamp "GPU tests"
  OMP_NUM_THREADS=4 TORCHINDUCTOR_COMPILE_THREADS=4 timeout 150 "$PY" -m pytest -m gpu -n 4 -p no:cacheprovider \
    --timeout 90 --session-timeout 120 --junitxml "$OUT/gpu_tests.xml" tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log"
fi

bench() {  # bench NAME SECONDS ARGS...: one throughput.py run, its JSON and log under $OUT
  local name=$1 seconds=$2; shift 2
  stamp "throughput $name"
  timeout "$seconds" "$PY" benchmarks/throughput.py --device cuda --amp bf16 \
    --json "$OUT/throughput_$name.json" "$@" 2>&1 | tee "$OUT/throughput_$name.log"
  [ -f "$OUT/throughput_$name.json" ] || echo "throughput $name: no result (failed or out of time, see its log)"
}
REL=()
[ -n "$RELEASED" ] && REL=(--released "$RELEASED")
if want matrix; then
  bench matrix 270 --matrix --train-batches 64 256 --compiled-batches 256 --reps 3 --iters 5 --compiled none \
    --models lipsformer_swin_t lipsformer_cswin_t "${REL[@]}"
fi
if want base; then
  bench base_eager 45 --batch 256 --train-batch 256 --reps 3 --iters 3 --baseline swin_base_patch4_window7_224 \
    --models lipsformer_swin_b
fi

wait "$COST" || echo "step-cost estimate: no result (see $OUT/step_cost.log)"
stamp "report"
"$PY" benchmarks/gpu_check.py report "$OUT"
stamp "done: $OUT/gpu.json, $OUT/gpu.md"
