#!/bin/bash
# The refactor benches before and after a change in one sitting, interleaved, so that both sides see the same machine:
#   bash bench/before_after.sh BEFORE_DIR AFTER_DIR   (two checkouts; run on a quiet machine, ~25 minutes)
# Each checkout runs on this repository's .venv with PYTHONPATH set to it; logs go to /tmp/sit_<bench>_<side>.log.
set -u
PY="$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python"
BEFORE=$1 AFTER=$2
run() {  # run NAME SIDE DIR ARGS...
  local name=$1 side=$2 dir=$3; shift 3
  echo "=== $name $side $(date +%T)"
  (cd "$dir" && PYTHONPATH="$dir" timeout 1500 "$PY" "$@" > "/tmp/sit_${name}_${side}.log" 2>&1; echo "rc=$? $(date +%T)")
  tail -15 "/tmp/sit_${name}_${side}.log"
}
for side in before after; do dir=$BEFORE; [ $side = after ] && dir=$AFTER; run e2e $side "$dir" bench/e2e_overhead.py --repeats 3; done
# (the after side also without the chunked wide steps of wide_step_rows, which 8db786f's engine did not have: the
# same work as before, and the fairness setting's own cost)
WIDE="bench/wide_beams.py --beams 256 --history 1024 --concurrent 0 --hf-max-cost 0"
run wide before "$BEFORE" $WIDE
run wide after "$AFTER" $WIDE
run wide_unchunked after "$AFTER" $WIDE --wide-step-rows 0
for side in before after; do dir=$BEFORE; [ $side = after ] && dir=$AFTER
  run patch $side "$dir" bench/catalog_patch.py --items 1000000 --rounds 3 --no-in-process; done
