#!/usr/bin/env bash
# The test command: tools, typecheck and lint, the suite against real PostgreSQL and Temporal, then
# two short seeded chaos runs (v1 and v2; every fault in the catalogue at least once each), then the
# quick subset of the guarantee map's mutants (mutants/map.ts: each break must be caught) and
# StrykerJS over the pure logic.
# Arguments go to vitest; with arguments (a file, -t …) the chaos runs and mutants are skipped.
#
# Steps that do not share anything run two at a time (the machine this is written for has two
# cores): each line of their output carries the step's name, and the step fails if either does.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ -d node_modules ] || npm ci --no-audit --no-fund
bash scripts/tools.sh --test-server
source scripts/node-lts.sh

side_by_side() {
  local names=("$1" "$3") commands=("$2" "$4") pids=() failed=0 i
  for i in 0 1; do
    (eval "${commands[$i]}" 2>&1 | sed -u "s/^/[${names[$i]}] /") &
    pids+=("$!")
  done
  for i in 0 1; do
    if ! wait "${pids[$i]}"; then
      echo "${names[$i]} failed" >&2
      failed=1
    fi
  done
  return "$failed"
}

side_by_side typecheck 'npx tsc --noEmit' lint 'npx eslint .'
npx vitest run "$@"
if [ "$#" -eq 0 ] && [ "${SKIP_CHAOS:-}" != "1" ]; then
  # Each run has its own PostgreSQL, Temporal, Stripe and ports, and its own folder (by seed).
  side_by_side 'chaos v1' 'npx tsx chaos/main.ts --seed 20261202 --events 2000 --duration 60 --stripe-api v1' \
    'chaos v2' 'npx tsx chaos/main.ts --seed 20261203 --events 1500 --duration 45 --stripe-api v2'
fi
if [ "$#" -eq 0 ] && [ "${SKIP_MUTANTS:-}" != "1" ]; then
  # The suite above just passed: that is the baseline. StrykerJS mutates the pure logic
  # (validation, keys, Stripe error classification and rules, statuses) under the unit tests alone
  # and fails under an 85 % mutation score.
  side_by_side mutants 'npx tsx mutants/run.ts --quick --no-baseline' stryker 'npx stryker run'
fi
