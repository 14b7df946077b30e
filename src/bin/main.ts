/**
 * `npm start`: the main job. Whatever is configured is used; whatever is not runs embedded
 * (src/embedded/stack.ts):
 * - no DATABASE_URL      → embedded PostgreSQL with its data under .data/pg
 * - no TEMPORAL_ADDRESS  → a file-backed Temporal dev server (.data/temporal.db) with its Web UI
 * - no STRIPE_API_KEY    → the local Stripe-compatible server: NOTHING IS BILLED
 * then migrates and runs a worker (relays + usage workflows) and the HTTP API (API_HOST:API_PORT)
 * in one process, sharing one metrics registry, until SIGTERM/SIGINT.
 */
import { writeFile } from 'node:fs/promises';
import path from 'node:path';
import { loadConfig } from '../config.js';
import { redactUrl } from '../db.js';
import { createLogger } from '../log.js';
import { runMain, untilSignal } from './run-main.js';
import { localStripeBanner, startStack } from '../embedded/stack.js';

await runMain(async () => {
  const config = loadConfig();
  const log = createLogger(config.logLevel);
  const stack = await startStack(config, { log });
  try {
    const { databaseUrl, temporalAddress, temporalUi, localStripe, apiUrl, dataDir } = stack;
    if (localStripe) console.error(localStripeBanner(localStripe.url));

    // Where everything is, for tools on this machine (the file may hold the local database password).
    const endpoints = {
      pid: process.pid,
      databaseUrl,
      temporalAddress,
      temporalUi,
      stripeApiBase: stack.config.stripe.apiBase,
      localStripe: Boolean(localStripe),
      api: apiUrl,
    };
    await writeFile(path.join(dataDir, 'endpoints.json'), JSON.stringify(endpoints, null, 2), { mode: 0o600 });
    console.error(
      [
        'billing-outbox is running.',
        `  PostgreSQL:       ${redactUrl(databaseUrl)}`,
        `  Temporal:         ${temporalAddress}${temporalUi ? `   Web UI: ${temporalUi}` : ''}`,
        `  Stripe API base:  ${stack.config.stripe.apiBase}${localStripe ? '  (local: nothing is billed)' : ''}`,
        `  API:              ${apiUrl}  (POST /v1/usage, GET /healthz, GET /metrics)`,
        `  Dead letters:     temporal workflow list -q 'OutboxStatus="dead"'`,
        'Stop with Ctrl-C.',
      ].join('\n'),
    );
    log.info({ endpoints: path.join(dataDir, 'endpoints.json') }, 'ready');

    const signal = await Promise.race([untilSignal(), stack.workerDone.then(() => undefined)]);
    log.info({ signal }, 'shutting down');
  } finally {
    await stack.stop();
  }
  log.info('billing-outbox stopped');
});
