#!/usr/bin/env bash
# The check of ddpx's CUDA path on a GPU machine, one command from a source checkout:
#
#     bash tools/gpu_check.sh [--skip-build]     # report in $OUT (default: gpu_out)
#
# Steps, each under a time limit of its own and all within GPU_CHECK_BUDGET_S seconds (default
# 330), each run whatever the others did:
#   environment      nvidia-smi, the CUDA toolkit, torch's collect_env, environment.json
#   build            ddpx._C in place, with its CUDA kernels for this GPU's architecture (from
#                    the GPU's capability, else sm_90; TORCH_CUDA_ARCH_LIST overrides it)
#   build_info       the extension loads from this checkout, with CUDA kernels if torch has CUDA
#   tests            tests/test_cuda.py but its compile checks (the build is one), junit.xml
#   speed            tools/gpu_report.py speed: the kernels against a device-to-device copy,
#                    all-reduces and DDP steps at world size 1 (speed.json, speed.txt)
#   model_parallel   scripts/model_parallel.py with both halves on cuda:0, then on cuda:0 and cpu
# then report.json and report.txt (tools/gpu_summary.py). Exit status 0 when every step passed,
# 1 when any failed, timed out or found no time left. Each step's output is in OUT/<step>.log.
# --skip-build uses the extension already built in ddpx/ (a rerun after a build that passed).
#
# Without a GPU every step still runs: a CPU torch builds the C++ extension alone, the GPU tests
# skip, the speed report says there is no CUDA device and model_parallel.py trains on the CPU.
# PYTHON picks the interpreter (default: python, else python3).
set -u -o pipefail

usage() { sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
SKIP_BUILD=0
for arg in "$@"; do
  case $arg in
    --skip-build) SKIP_BUILD=1 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $arg (see --help)" >&2; exit 2 ;;
  esac
done

export ROOT OUT PYTHON
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-gpu_out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
PYTHON=${PYTHON:-$(command -v python || command -v python3)}
cd "$ROOT" || exit 2
rm -f "$OUT"/{steps.tsv,report.json,report.txt,junit.xml,environment.json,build_info.json} \
  "$OUT"/{speed.json,speed.txt} "$OUT"/*.log
: > "$OUT/steps.tsv"
# The extension is built into ddpx/ and imported from this checkout, not from an installed ddpx.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
DEADLINE=$(($(date +%s) + ${GPU_CHECK_BUDGET_S:-330}))

say() { echo "[gpu_check] $*"; }

# "torch.version.cuda capability" of this torch and its first GPU ("-" for none of either).
read -r TORCH_CUDA CAPABILITY < <(timeout 120 "$PYTHON" -c '
import torch
cuda = torch.cuda.is_available()
print(torch.version.cuda or "-", "%d.%d" % torch.cuda.get_device_capability(0) if cuda else "-")
' 2>/dev/null || echo "- -")
if [[ -z ${TORCH_CUDA_ARCH_LIST:-} ]]; then
  TORCH_CUDA_ARCH_LIST=$([[ $CAPABILITY != - ]] && echo "$CAPABILITY" || echo 9.0)
fi
export TORCH_CUDA_ARCH_LIST
export MAX_JOBS=${MAX_JOBS:-$(nproc)}

# A CUDA torch's build needs a toolkit: bin/nvcc and include/cuda_runtime.h under one folder.
# Tried in order: CUDA_HOME, the nvcc on PATH, /usr/local/cuda(-*), and pip's CUDA 13 wheels
# (site-packages/nvidia/cu13, a whole toolkit when nvidia-cuda-nvcc is installed).
toolkit_candidates() {
  [[ -n ${CUDA_HOME:-} ]] && echo "$CUDA_HOME"
  command -v nvcc > /dev/null && dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")"
  echo /usr/local/cuda
  ls -d /usr/local/cuda-* 2> /dev/null | sort -rV
  "$PYTHON" -c 'import os, torch; print(os.path.join(torch.__path__[0], "..", "nvidia", "cu13"))' \
    2> /dev/null
}
TOOLKIT_NOTE="torch is a CPU build (or does not import): no CUDA toolkit needed"
if [[ $TORCH_CUDA != - ]]; then
  TOOLKIT_NOTE="no CUDA toolkit found (looked in: $(toolkit_candidates | tr '\n' ' ')):"
  TOOLKIT_NOTE+=" the build will lack the CUDA kernels"
  while read -r home; do
    if [[ -x $home/bin/nvcc && -f $home/include/cuda_runtime.h ]]; then
      export CUDA_HOME=$home PATH="$home/bin:$PATH"
      TOOLKIT_NOTE="CUDA toolkit: $home"
      break
    fi
  done < <(toolkit_candidates)
fi
export TOOLKIT_NOTE TORCH_CUDA CAPABILITY

# run_step NAME CAP COMMAND...: runs COMMAND with its output in OUT/NAME.log, for at most CAP
# seconds or what is left of the budget, and records the outcome in OUT/steps.tsv.
run_step() {
  local name=$1 cap=$2
  shift 2
  local log="$name.log" left=$((DEADLINE - $(date +%s)))
  if ((left < 10)); then
    printf '%s\tout of time\t\t0\t\t%s\t%s\n' "$name" "$log" "$*" >> "$OUT/steps.tsv"
    echo "not run: the ${GPU_CHECK_BUDGET_S:-330} s budget was spent" > "$OUT/$log"
    say "$name: out of time"
    return
  fi
  local limit=$((cap < left ? cap : left)) start end status code
  say "$name: $* (at most $limit s)"
  start=$(date +%s.%N)
  # timeout signals the command's whole process group (the test ranks too), KILL 10 s later. In
  # the background, so that an interrupt of this script reaches it (see the trap below).
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$log" 2>&1 &
  STEP_PID=$!
  wait "$STEP_PID"
  code=$?
  STEP_PID=
  end=$(date +%s.%N)
  case $code in
    0) status=passed ;;
    124 | 137) status="timed out" ;;
    *) status=failed ;;
  esac
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$code" \
    "$(awk "BEGIN { printf \"%.1f\", $end - $start }")" "$limit" "$log" "$*" >> "$OUT/steps.tsv"
  say "$name: $status (exit $code)"
  if [[ $status != passed ]]; then
    tail -n 20 "$OUT/$log" | sed 's/^/    /'
  fi
}

skip_step() {
  printf '%s\tskipped\t\t0\t\t%s\t%s\n' "$1" "$1.log" "$2" >> "$OUT/steps.tsv"
  echo "$2" > "$OUT/$1.log"
  say "$1: skipped ($2)"
}

step_environment() {
  if command -v nvidia-smi > /dev/null; then nvidia-smi; else echo "nvidia-smi: not on PATH"; fi
  echo "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST MAX_JOBS=$MAX_JOBS; $TOOLKIT_NOTE"
  if command -v nvcc > /dev/null; then nvcc --version; else echo "nvcc: not on PATH"; fi
  "$PYTHON" -m torch.utils.collect_env || echo "(torch.utils.collect_env failed)"
  "$PYTHON" tools/gpu_report.py environment --json "$OUT/environment.json"
}

step_build() {
  if [[ $TORCH_CUDA == - ]]; then
    echo "torch is a CPU build (or does not import): the C++ extension only, no CUDA kernels"
  else
    echo "torch with CUDA $TORCH_CUDA: with the CUDA kernels for $TORCH_CUDA_ARCH_LIST;"
    echo "$TOOLKIT_NOTE"
  fi
  # build_ext --inplace, not pip: it needs nothing from a package index (this machine may have no
  # network, and pip's isolated build fetches setuptools) and leaves the environment's packages
  # as they are; PYTHONPATH above makes the checkout's ddpx the one imported.
  "$PYTHON" setup.py -q build_ext --inplace
}

export -f step_environment step_build
# timeout runs each step in a process group of its own, which an interrupt at the terminal misses.
STEP_PID=
trap 'say "interrupted"; [[ -n $STEP_PID ]] && kill -TERM "$STEP_PID" && wait "$STEP_PID"
  exit 130' INT TERM

run_step environment 60 bash -c step_environment
if ((SKIP_BUILD)); then
  skip_step build "--skip-build: the extension already in ddpx/ is used"
else
  run_step build 240 bash -c step_build
fi
run_step build_info 60 "$PYTHON" tools/gpu_report.py build-info --json "$OUT/build_info.json"
# Not the compile checks (half a minute): the build step compiles the same sources for real.
run_step tests 200 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_cuda.py \
  -k "not compile" --junitxml="$OUT/junit.xml"
run_step speed 120 "$PYTHON" tools/gpu_report.py speed --json "$OUT/speed.json" \
  --text "$OUT/speed.txt"
if [[ $CAPABILITY != - ]]; then
  run_step model_parallel-cuda0-cuda0 60 "$PYTHON" scripts/model_parallel.py \
    --devices cuda:0,cuda:0 --steps 20
  run_step model_parallel-cuda0-cpu 60 "$PYTHON" scripts/model_parallel.py \
    --devices cuda:0,cpu --steps 20
else
  run_step model_parallel-cpu 60 "$PYTHON" scripts/model_parallel.py --devices cpu,cpu --steps 20
fi

timeout 60 "$PYTHON" tools/gpu_summary.py "$OUT"
code=$?
if [[ ! -f $OUT/report.json ]]; then
  say "the summary failed (exit $code), so there is no report.json; the steps were:"
  cat "$OUT/steps.tsv"
  exit 1
fi
exit $code
