#!/usr/bin/env bash
# The test command: tools, typecheck and lint, the suite against real PostgreSQL and Temporal, then
# two short seeded chaos runs (v1 and v2; every fault in the catalogue at least once each), then the
# quick subset of the guarantee map's mutants (mutants/map.ts: each break must be caught) and
# StrykerJS over the pure logic.
# Arguments go to vitest; with arguments (a file, -t …) the chaos runs and mutants are skipped.
#
# Steps that share nothing run side by side (the machine this is written for has two cores): each
# line of their output carries the step's name, and the step fails if any of them does.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ -d node_modules ] || npm ci --no-audit --no-fund
bash scripts/tools.sh --test-server
source scripts/node-lts.sh

side_by_side() {
  local names=() pids=() failed=0 i
  while [ "$#" -ge 2 ]; do
    names+=("$1")
    (eval "$2" 2>&1 | sed -u "s/^/[$1] /") &
    pids+=("$!")
    shift 2
  done
  for i in "${!pids[@]}"; do
    if ! wait "${pids[$i]}"; then
      echo "${names[$i]} failed" >&2
      failed=1
    fi
  done
  return "$failed"
}

side_by_side typecheck 'npx tsc --noEmit' lint 'npx eslint .'
npx vitest run "$@"
# Without arguments: the two chaos runs side by side (each with its own PostgreSQL, Temporal, Stripe,
# ports and folder, by seed), then the quick mutants (the suite above just passed: that is their
# baseline) beside StrykerJS (the pure logic under the unit tests alone: validation, keys, Stripe
# error classification and rules, statuses; fails under an 85 % mutation score). StrykerJS beside
# the chaos runs instead made all three twice as slow: the chaos runs are not idle.
if [ "$#" -eq 0 ] && [ "${SKIP_CHAOS:-}" != "1" ]; then
  side_by_side 'chaos v1' 'npx tsx chaos/main.ts --seed 20261202 --events 1500 --duration 45 --stripe-api v1' \
    'chaos v2' 'npx tsx chaos/main.ts --seed 20261203 --events 1500 --duration 45 --stripe-api v2'
fi
if [ "$#" -eq 0 ] && [ "${SKIP_MUTANTS:-}" != "1" ]; then
  side_by_side mutants 'npx tsx mutants/run.ts --quick --no-baseline' stryker 'npx stryker run'
fi
