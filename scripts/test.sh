#!/usr/bin/env bash
# The test command: tools, typecheck, lint, then the suite against real PostgreSQL and Temporal.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ -d node_modules ] || npm ci --no-audit --no-fund
bash scripts/tools.sh
npx tsc --noEmit
npx eslint .
npx vitest run "$@"
