#!/usr/bin/env bash
# docs/benchmarks.md's "A rank's cores" on a machine with more than 2 cores (the GPU machine's
# kind has 16): 2, 4 and 8 ranks with cores / ranks threads each, 64 KB to 100 MB,
# every engine at those threads (gloo, ddpx, the arena, OpenMPI, DeepSpeed's OpenMP op, and the
# copy floor on torch's threads), then the DDP step at 2 ranks. One JSON per run under OUT
# (default cores_out/), the tables on stdout; about 6 minutes on 16 cores.
#
#     bash tools/cores_check.sh [OUT]
#     CORES_CHECK_PLAN=1 bash tools/cores_check.sh    # the commands, without running them
#
# Needs ddpx installed with its [bench] and [peers] extras (pip install -e ".[bench,peers]").
set -euo pipefail
cd "$(dirname "$0")/.."

out=${1:-cores_out}
cores=$(python3 -c 'import os; print(len(os.sched_getaffinity(0)))')
share() { local t=$((cores / $1)); echo $((t > 0 ? t : 1)); }
plan=()
for ranks in 2 4 8; do
  plan+=("ddpx-bench allreduce --world_sizes $ranks --threads $(share "$ranks") \
--sizes 64K,1M,4M,25M,100M --engines gloo,ddpx,ddpx-arena,mpi,deepspeed,copy \
--iters 10 --min_time 0.2 --json $out/allreduce-$ranks-ranks.json")
done
plan+=("ddpx-bench train --world_sizes 2 --threads $(share 2) --json $out/train-2-ranks.json")

if [ -n "${CORES_CHECK_PLAN:-}" ]; then
  printf '%s\n' "${plan[@]}"
  exit 0
fi
mkdir -p "$out"
echo "cores_check: $cores CPUs, $(date -u +%FT%TZ)"
for command in "${plan[@]}"; do
  echo "cores_check: $command"
  start=$SECONDS
  $command
  echo "cores_check: $((SECONDS - start)) s"
done
