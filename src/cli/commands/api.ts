/**
 * `billing-outbox api` (`npm run api`, src/bin/api.ts): the HTTP ingestion API on its own (DATABASE_URL and API_TOKENS required). Listens
 * on API_HOST:API_PORT; on SIGTERM/SIGINT it stops accepting connections, lets in-flight requests
 * finish, then closes the pool. Run it next to any number of workers (`npm run worker`).
 */
import { DEFAULT_TEMPORAL_ADDRESS } from '../../temporal/connection.js';
import { buildApi, temporalHealthConnection } from '../../api/index.js';
import { ConfigError, loadConfig, misspelledVariableWarnings } from '../../config.js';
import { halfSetBesideStack, loadDotEnv } from '../../embedded/local-files.js';
import { createPool, migrate, redactUrl } from '../../db.js';
import { postgresUnreachable, untilReachable } from '../../reachable.js';
import { createLogger } from '../../log.js';
import { untilSignal } from '../../bin/run-main.js';
import { createMetrics } from '../../metrics.js';
import { schemaFor } from '../../outbox/sql/schema.js';
import { createStripeClient, requireStripeKey } from '../../stripe/client.js';
import { startTracingSdk } from '../../tracing.js';
import { MeterCatalog } from '../../stripe/meters.js';

/** Serves the API until a signal; throws what stops it otherwise. */
export async function runApi(): Promise<void> {
  loadDotEnv();
  const config = loadConfig();
  const log = createLogger(config.logLevel);
  for (const warning of misspelledVariableWarnings()) log.warn(warning);
  if (!config.databaseUrl) throw new ConfigError(['DATABASE_URL: is not set (npm start runs everything embedded instead)']);
  const unset = halfSetBesideStack(config);
  if (unset) throw unset;
  // In production the API checks meters at the door with Stripe; elsewhere, without a key, it does
  // not check them (the worker still does, before sending).
  if (config.production) requireStripeKey(config.stripe, 'the API (its meter check at the door, its webhook route)');
  // Its webhook route reads each notification back from Stripe: without a key every one would be
  // answered 503 until Stripe gave up redelivering it, its rejected events never marked.
  if (config.stripe.webhookSecret !== undefined) requireStripeKey(config.stripe, 'the API (its webhook route reads each notification back from Stripe)');
  if (config.api.tokens.length === 0) {
    throw new ConfigError(['API_TOKENS: is not set: every route but /health needs a bearer token (see .env.example)']);
  }
  const temporalAddress = config.temporal.address ?? DEFAULT_TEMPORAL_ADDRESS;

  // OTEL_EXPORTER_OTLP_ENDPOINT set: each POST /v1/usage begins its event's trace.
  const sdk = await startTracingSdk(config.tracing);
  // Safe with workers migrating at the same time; the API may well be the first process up.
  // PostgreSQL restarting as the API starts: waited for (src/reachable.ts), each try logged.
  const databaseUrl = config.databaseUrl;
  await untilReachable('PostgreSQL', () => migrate(databaseUrl, { schema: config.databaseSchema, onWait: (message) => log.warn(message) }), { waitMs: config.startupWaitMs, log, unreachable: postgresUnreachable });
  // Every statement of the API is quick (a usage and its outbox row, a webhook's rows, the status
  // counts): one unanswered for statementAnswerMs is a connection gone silent (a failover), and the
  // request is answered 503 at once instead of hanging on it.
  const pool = createPool(databaseUrl, 10, { answerMs: config.timings.statementAnswerMs });
  // Lazy: ingestion needs only PostgreSQL, so the API starts (and /health says so) while Temporal is away.
  const temporal = temporalHealthConnection(config.temporal);
  const metrics = createMetrics(undefined, { db: pool, schema: schemaFor(config.databaseSchema), worker: false });
  const meters = config.stripe.apiKey || !config.stripe.isRealStripe ? new MeterCatalog(createStripeClient(config.stripe, { log })) : undefined;
  const app = buildApi({ config, db: pool, log, temporal, metrics, meters });

  try {
    await app.listen({ host: config.api.host, port: config.api.port });
    log.info(
      { address: app.server.address(), database: redactUrl(config.databaseUrl), temporal: temporalAddress, tokens: config.api.tokens.map((t) => t.name) },
      'billing-outbox API listening',
    );
    const signal = await untilSignal();
    log.info({ signal }, 'shutting down: finishing in-flight requests');
  } finally {
    // close(): stop accepting, answer 503 to new requests on kept-alive sockets, wait for the rest.
    await app.close();
    await temporal.close();
    await pool.end();
    await sdk?.shutdown();
  }
  log.info('API stopped');
}
