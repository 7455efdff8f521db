#!/usr/bin/env bash
# A host switch's effect on the medians, in one device call (issue 13: a faster run must not change
# the numbers it measures). After `source .device/pN/install.sh`:
#
#   bash benchmarks/switch_ab.sh OUT [SWITCH ...]     # default: ORCHESTRATE_STANDBY ORCHESTRATE_WARM
#
# Runs benchmarks/switch-check.toml through `orchestrate run` (the embedded default) four times in
# ABBA order: the switches at 0 (before), 1, 1, 0; then `orchestrate compare --by run` of each
# before/after pair. Writes OUT/switch_ab.txt.
set -u
out=${1:?usage: switch_ab.sh OUT [SWITCH ...]}
shift
switches=("$@")
[[ $# -eq 0 ]] && switches=(ORCHESTRATE_STANDBY ORCHESTRATE_WARM)
mkdir -p "$out"
export ORCHESTRATE_RESULTS=/tmp/switch-ab ORCHESTRATE_SPOOL=/tmp/switch-ab-spool PYTHONUNBUFFERED=1
rm -rf "$ORCHESTRATE_RESULTS" "$ORCHESTRATE_SPOOL"
sweep=${SWEEP:-$(cd "$(dirname "$0")" && pwd)/switch-check.toml}  # SWEEP: another sweep file (its name must be switch-check)
runs=()
for value in 0 1 1 0; do
  settings=()
  for name in "${switches[@]}"; do settings+=("$name=$value"); done
  line=$(env "${settings[@]}" orchestrate run --sweep "$sweep" --force 2>&1 | tee -a "$out/switch_ab.log" | grep -E '^Run ')
  echo "${settings[*]}: $line" | tee -a "$out/switch_ab.txt"
  runs+=("$(echo "$line" | awk '{print $2}' | tr -d :)")
done
for pair in "0 1" "3 2"; do
  set -- $pair
  echo "== before ${runs[$1]} (off) vs after ${runs[$2]} (on)" | tee -a "$out/switch_ab.txt"
  COLUMNS=200 orchestrate compare --sweep switch-check --by run --baseline "${runs[$1]}" --contender "${runs[$2]}" \
    2>&1 | tee -a "$out/switch_ab.txt"
done
