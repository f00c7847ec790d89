#!/usr/bin/env bash
# The check of ddpx's CUDA path on a GPU machine, one command from a source checkout; nothing is
# fetched (a GPU machine may have no package index):
#
#     bash tools/gpu_check.sh [--skip-build] [--only STEP,...]   # report in $OUT (gpu_out)
#
# The steps, in this order, each with a time limit in seconds; all of them and the summary end
# within GPU_CHECK_BUDGET_S (default 330), so that a rerun fits in the machine's time too:
#   preflight           30  what is here and what is missing (tools/gpu_preflight.py), printed
#                           first; a step that needs something missing is "not run", at once
#   build               90  ddpx._C in place, with the CUDA kernels for this GPU (its capability,
#                           else sm_90; TORCH_CUDA_ARCH_LIST overrides it)
#   build_info          20  the extension loads from this checkout, with CUDA kernels if torch has
#                           CUDA; if not, the steps below do not run (ddpx would build itself)
#   speed               45  tools/gpu_report.py speed: the kernels against a device-to-device copy,
#                           all-reduces and DDP steps at world size 1 (speed.json, speed.txt)
#   model_parallel-ddp  40  scripts/model_parallel.py under DDP with ddpx's hook: one process
#                           under torchrun (NCCL), both halves on cuda:0 (the CPU without a GPU)
#   model_parallel-cuda0-cpu  25  its halves on cuda:0 and the CPU: one process, no DDP (DDP
#                           takes no model that spans device types); only with a GPU
#   tests               the rest, at least 70 s: tests/test_cuda.py but its compile checks, in
#                           the file's order; each test's result goes to tests.tsv as it ends
#   summary             10  report.txt and report.json (tools/gpu_summary.py)
# Exit status 0 when every step passed, 1 when any failed, timed out, was not run or found no
# time left, 2 for a wrong argument. Each step's output is in OUT/<step>.log.
#   --skip-build     use the extension already built in ddpx/ (a rerun after a build that passed)
#   --only STEP,...  run only these of build, speed, model_parallel-ddp, model_parallel-cuda0-cpu,
#                    tests (preflight and build_info always run): a rerun of the tests with all
#                    the time there is: --only tests
# GPU_CHECK_TESTS: what the tests step gives pytest (default tests/test_cuda.py): files, node ids.
# PYTHON picks the interpreter (default: python, else python3).
#
# Without a GPU every step still runs: a CPU torch builds the C++ extension alone, the GPU tests
# skip, the speed report says there is no CUDA device and model_parallel.py trains on the CPU.
set -u -o pipefail

usage() { sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
OPTIONAL="build speed model_parallel-ddp model_parallel-cuda0-cpu tests"
SKIP_BUILD=0
ONLY=
while (($#)); do
  case $1 in
    --skip-build) SKIP_BUILD=1 ;;
    --only) ONLY=${2:-}; shift ;;
    --only=*) ONLY=${1#--only=} ;;
    -h | --help) usage; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
for name in ${ONLY//,/ }; do
  if [[ " $OPTIONAL " != *" $name "* ]]; then
    echo "gpu_check.sh: --only takes steps of: $OPTIONAL; not $name" >&2
    exit 2
  fi
done

export ROOT OUT PYTHON
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-gpu_out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
PYTHON=${PYTHON:-$(command -v python || command -v python3)}
cd "$ROOT" || exit 2
rm -f "$OUT"/{steps.tsv,report.json,report.txt,junit.xml,tests.tsv,build_info.json} \
  "$OUT"/{preflight.json,preflight.env,preflight.txt,speed.json,speed.txt} "$OUT"/*.log
: > "$OUT/steps.tsv"
# The extension is built into ddpx/ and imported from this checkout, not from an installed ddpx.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

BUDGET=${GPU_CHECK_BUDGET_S:-330}
SUMMARY_S=10 # kept back from every step for the summary
GRACE_S=3    # from timeout's TERM to its KILL, inside a step's limit
declare -A CAP=([preflight]=30 [build]=90 [build_info]=20 [speed]=45 [model_parallel-ddp]=40
  [model_parallel-cuda0-cpu]=25 [tests]=$BUDGET)
# What each step needs: the names of tools/gpu_preflight.py's checks, and "ddpx", a build that
# build_info accepted.
declare -A NEEDS=([preflight]="" [build]="torch compiler ninja setuptools nvcc disk"
  [build_info]="torch" [speed]="torch ddpx" [model_parallel-ddp]="torch numpy accelerate ddpx"
  [model_parallel-cuda0-cpu]="torch numpy accelerate ddpx" [tests]="torch pytest ddpx")
MISSING=
SECONDS=0

say() { echo "[gpu_check] $*"; }

# record NAME STATUS CODE SECONDS LIMIT COMMAND NOTE: a line of OUT/steps.tsv.
record() {
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" "$1.log" "$6" "$7" \
    >> "$OUT/steps.tsv"
}

# The needs of step NAME that are missing, as words for people.
missing_for() {
  local need found=
  for need in ${NEEDS[$1]}; do
    [[ " $MISSING " == *" $need "* ]] || continue
    [[ $need == ddpx ]] && need="a build of ddpx that loads"
    found+="${found:+, }$need"
  done
  echo "$found"
}

# Whether step NAME is to run at all: --skip-build and --only leave steps out.
wanted() {
  [[ $1 == build ]] && ((SKIP_BUILD)) && return 1
  [[ -z $ONLY || " $OPTIONAL " != *" $1 "* || ",$ONLY," == *",$1,"* ]]
}

# run_step NAME COMMAND...: runs COMMAND with its output in OUT/NAME.log, unless --skip-build or
# --only leaves it out or something it needs is missing, for at most its CAP or what is left of
# the budget but the summary's share; records the outcome in OUT/steps.tsv.
run_step() {
  local name=$1
  shift
  local log=$OUT/$name.log why
  if ! wanted "$name"; then
    why="not in --only"
    [[ $name == build ]] && ((SKIP_BUILD)) &&
      why="--skip-build: the extension already in ddpx/ is used"
    record "$name" skipped "" 0 "" "$*" "$why"
    echo "skipped: $why" > "$log"
    say "$name: skipped ($why)"
    return
  fi
  why=$(missing_for "$name")
  if [[ -n $why ]]; then
    record "$name" "not run" "" 0 "" "$*" "missing: $why"
    echo "not run: missing $why (see preflight.log)" > "$log"
    say "$name: not run, missing $why"
    return
  fi
  local left=$((BUDGET - SUMMARY_S - SECONDS)) cap=${CAP[$name]}
  local limit=$((cap < left ? cap : left)) start end code status
  if ((limit < 10)); then
    record "$name" "out of time" "" 0 "" "$*" "the ${BUDGET} s budget was spent"
    echo "not run: the $BUDGET s budget was spent" > "$log"
    say "$name: out of time"
    return
  fi
  say "$name: $* (at most $limit s)"
  start=$(date +%s.%N)
  # timeout signals the command's whole process group (pytest's ranks, torchrun's workers too),
  # then KILLs it GRACE_S later, within the limit. In the background, so that an interrupt of
  # this script reaches it (see the trap below).
  timeout --kill-after=$GRACE_S $((limit - GRACE_S)) "$@" > "$log" 2>&1 &
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
  record "$name" "$status" "$code" "$(awk "BEGIN { printf \"%.1f\", $end - $start }")" \
    "$limit" "$*" ""
  say "$name: $status (exit $code)"
  if [[ $status != passed ]]; then
    tail -n 20 "$log" | awk '{ print "    " $0 }'
  fi
}

# The last status recorded for step NAME.
status_of() { awk -F '\t' -v name="$1" '$1 == name { status = $2 } END { print status }' \
  "$OUT/steps.tsv"; }

# shellcheck disable=SC2317  # run by bash -c
step_preflight() {
  set -o pipefail
  "$PYTHON" tools/gpu_preflight.py "$OUT" | tee "$OUT/preflight.txt" || return
  # For the record; nothing below decides anything.
  echo
  if command -v nvidia-smi > /dev/null; then nvidia-smi; else echo "nvidia-smi: not on PATH"; fi
  "$PYTHON" -m torch.utils.collect_env || echo "(torch.utils.collect_env failed)"
}

# shellcheck disable=SC2317  # run by bash -c
step_build() {
  echo "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST MAX_JOBS=$MAX_JOBS CUDA_HOME=${CUDA_HOME:-}"
  # build_ext --inplace, not pip: it needs nothing from a package index (pip's isolated build
  # fetches setuptools) and leaves the environment's packages as they are; PYTHONPATH above makes
  # the checkout's ddpx the one imported.
  "$PYTHON" setup.py -q build_ext --inplace
}

# scripts/model_parallel.py under DDP: one process launched by torchrun, which makes the process
# group (NCCL on a GPU) that the script wraps its model in DDP for.
# shellcheck disable=SC2317  # run by bash -c
step_model_parallel_ddp() {
  "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node 1 scripts/model_parallel.py \
    --devices "$1" --steps 20 || return
  # Rank 0 names the comm path; "none" would be a run without DDP.
  if ! grep -q '^comm path: ddpx' "$OUT/model_parallel-ddp.log"; then
    echo "FAILED: no 'comm path: ddpx' above: the model was not under DDP with ddpx's hook"
    return 1
  fi
}

export -f step_preflight step_build step_model_parallel_ddp
# timeout runs each step in a process group of its own, which an interrupt at the terminal misses.
STEP_PID=
trap 'say "interrupted"; [[ -n $STEP_PID ]] && kill -TERM "$STEP_PID" && wait "$STEP_PID"
  exit 130' INT TERM

run_step preflight bash -c step_preflight
CAPABILITY=- GPUS=0 TOOLKIT='' NINJA_DIR='' BUILD_CXX=''
if [[ -f $OUT/preflight.env ]]; then
  # shellcheck source=/dev/null
  source "$OUT/preflight.env"
  sed 's/^/    /' "$OUT/preflight.txt"
else
  say "the preflight found nothing out (see preflight.log): every step is tried"
fi
if ((GPUS > 0)); then
  PLAN="build build_info speed model_parallel-ddp model_parallel-cuda0-cpu tests"
else
  PLAN="build build_info speed model_parallel-ddp tests"
fi
floor=$((BUDGET - SUMMARY_S - SECONDS))
for name in $PLAN; do
  wanted "$name" || continue
  missing=$(missing_for "$name")
  if [[ -n $missing ]]; then
    say "will not run: $name, for lack of $missing"
  elif [[ $name != tests ]]; then
    floor=$((floor - CAP[$name]))
  fi
done
say "budget $BUDGET s: the tests get what the other steps leave," \
  "at least $((floor > 0 ? floor : 0)) s; the summary $SUMMARY_S s"

if [[ -z ${TORCH_CUDA_ARCH_LIST:-} ]]; then
  TORCH_CUDA_ARCH_LIST=$([[ $CAPABILITY != - ]] && echo "$CAPABILITY" || echo 9.0)
fi
export TORCH_CUDA_ARCH_LIST MAX_JOBS=${MAX_JOBS:-$(nproc)}
[[ -n $TOOLKIT ]] && export CUDA_HOME=$TOOLKIT PATH="$TOOLKIT/bin:$PATH"
[[ -n $NINJA_DIR ]] && export PATH="$NINJA_DIR:$PATH"
[[ -n $BUILD_CXX ]] && export CXX=$BUILD_CXX

run_step build bash -c step_build
run_step build_info "$PYTHON" tools/gpu_report.py build-info --json "$OUT/build_info.json"
# A build that failed may have left an older one behind, which build_info would accept.
if [[ $(status_of build_info) != passed || $(status_of build) =~ failed|timed ]]; then
  MISSING+=" ddpx"
fi
run_step speed "$PYTHON" tools/gpu_report.py speed --json "$OUT/speed.json" \
  --text "$OUT/speed.txt"
if ((GPUS > 0)); then
  run_step model_parallel-ddp bash -c 'step_model_parallel_ddp cuda:0,cuda:0'
  run_step model_parallel-cuda0-cpu "$PYTHON" scripts/model_parallel.py --devices cuda:0,cpu \
    --steps 20
else
  run_step model_parallel-ddp bash -c 'step_model_parallel_ddp cpu,cpu'
fi
# Last, to take all the time the others left. Not the compile checks (half a minute): the build
# step compiles the same sources for real. pytest_tsv records each test as it ends, as pytest's
# junit.xml is written only by a pytest that was not killed.
read -r -a TESTS <<< "${GPU_CHECK_TESTS:-tests/test_cuda.py}"
run_step tests env PYTHONPATH="$ROOT/tools:$PYTHONPATH" "$PYTHON" -m pytest -q \
  -p no:cacheprovider -p pytest_tsv --tsv "$OUT/tests.tsv" --junitxml="$OUT/junit.xml" \
  -k "not compile" "${TESTS[@]}"

left=$((BUDGET - SECONDS))
timeout --kill-after=1 $((left > 2 ? left - 1 : 1)) "$PYTHON" tools/gpu_summary.py "$OUT" \
  --elapsed "$SECONDS" --budget "$BUDGET"
code=$?
if [[ ! -f $OUT/report.json ]]; then
  say "the summary failed (exit $code), so there is no report.json; the steps were:"
  cut -f 1-5,8 "$OUT/steps.tsv"
  exit 1
fi
exit $code
