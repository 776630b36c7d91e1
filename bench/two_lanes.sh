#!/usr/bin/env bash
# Two lanes of single-GPU benches side by side on a 2-GPU machine (nvidia-h200-x2): lane A on
# GPU 0 and the first half of the cores, lane B on GPU 1 and the second half; each lane runs its
# commands one after another. A lane then looks like the single-H200 machine (one GPU, 16 of its
# 32 cores); the lanes share the disk, the RAM and its bandwidth, so pair a disk-bound bench with
# one that is not. Every lane is cut at LANE_SECONDS (default 560) and its output goes to
# $OUT/laneA.log / laneB.log; each bench writes its own JSON under $OUT.
#   usage: bench/two_lanes.sh "CMD; CMD" "CMD; CMD"
set -u
cores=$(nproc)
half=$((cores / 2))
lane() {  # name gpu first_core last_core commands
  ( export CUDA_VISIBLE_DEVICES=$2 OMP_NUM_THREADS=$half
    exec timeout "${LANE_SECONDS:-560}" taskset -c "$3-$4" bash -c "$5" ) >"${OUT:-.}/lane$1.log" 2>&1
  echo "lane $1 exit $?" >>"${OUT:-.}/lane$1.log"
}
lane A 0 0 $((half - 1)) "$1" &
lane B 1 "$half" $((cores - 1)) "$2" &
wait
tail -n 4 "${OUT:-.}/laneA.log" "${OUT:-.}/laneB.log"
