#!/usr/bin/env bash
# `npm run build` (and `npm pack`/`npm publish` through prepack): the package as it ships, in dist/.
#   dist/src, dist/workflows, dist/activities  compiled JavaScript, declarations, source maps
#   dist/migrations                             the SQL files (src/db.ts reads ../migrations)
#   dist/workflow-bundle.js                     the workflows bundled once for Temporal's sandbox
#   dist/workflow-bundle-tracing.js             the same with OpenTelemetry's workflow interceptors
#   dist/entries/                               billing-outbox/worker and /fastify, which say what
#                                               to install when an optional peer is missing
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rm -rf dist
npx tsc -p tsconfig.build.json
cp -R migrations dist/migrations
npx tsx scripts/bundle-workflows.ts dist/workflows/index.js dist/workflow-bundle.js
npx tsx scripts/bundle-workflows.ts dist/workflows/index.js dist/workflow-bundle-tracing.js --tracing
npx tsx scripts/build-entries.ts
