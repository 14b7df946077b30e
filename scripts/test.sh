#!/usr/bin/env bash
# The test command: tools, typecheck, lint, the suite against real PostgreSQL and Temporal, then
# two short seeded chaos runs (v1 and v2; every fault in the catalogue at least once each).
# then the quick subset of the guarantee map's mutants (mutants/map.ts: each break must be caught).
# Arguments go to vitest; with arguments (a file, -t …) the chaos runs and mutants are skipped.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ -d node_modules ] || npm ci --no-audit --no-fund
bash scripts/tools.sh --test-server
source scripts/node-lts.sh
npx tsc --noEmit
npx eslint .
npx vitest run "$@"
if [ "$#" -eq 0 ] && [ "${SKIP_CHAOS:-}" != "1" ]; then
  npx tsx chaos/main.ts --seed 20261202 --events 2000 --duration 60 --stripe-api v1
  npx tsx chaos/main.ts --seed 20261203 --events 1500 --duration 45 --stripe-api v2
fi
if [ "$#" -eq 0 ] && [ "${SKIP_MUTANTS:-}" != "1" ]; then
  # The suite above just passed: that is the baseline.
  npx tsx mutants/run.ts --quick --no-baseline
  # StrykerJS over the pure logic (validation, keys, Stripe error classification and rules,
  # statuses): fails under an 85 % mutation score.
  npx stryker run
fi
