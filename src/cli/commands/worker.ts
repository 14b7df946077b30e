/**
 * `billing-outbox worker` (`npm run worker`, src/bin/worker.ts): one worker process against configured services
 * (DATABASE_URL, TEMPORAL_ADDRESS, STRIPE_API_KEY), on the same launch as the library's
 * createWorker (src/worker.ts). Migrates on boot (safe with many workers), runs until SIGTERM, then
 * drains. With WORKER_METRICS_PORT set, serves GET /metrics and GET /health on
 * API_HOST:WORKER_METRICS_PORT: this process's registry followed by the Temporal SDK's worker
 * metrics (exported on a loopback port), and whether the worker runs and reaches PostgreSQL.
 */
import { DEFAULT_TEMPORAL_ADDRESS } from '../../temporal/connection.js';
import { loadConfig } from '../../config.js';
import { loadDotEnv } from '../../embedded/local-files.js';
import { redactUrl } from '../../db.js';
import { freePort } from '../../embedded/postgres.js';
import { createLogger } from '../../log.js';
import { createMetrics } from '../../metrics.js';
import { installTemporalRuntime, sdkLogLevel } from '../../temporal/runtime.js';
import { launchWorker } from '../../temporal/worker.js';

export const WORKER_HELP = `Usage: billing-outbox worker

Runs a worker: the relays (claiming outbox rows) and the usage workflows (reporting each to
Stripe), on TEMPORAL_TASK_QUEUE. Run as many as you like. Migrates the database first (safe with
many at once). On SIGTERM or SIGINT it stops claiming and lets in-flight deliveries finish.

Environment: DATABASE_URL (required), TEMPORAL_ADDRESS (default localhost:7233),
TEMPORAL_NAMESPACE, TEMPORAL_TLS_* or TEMPORAL_API_KEY, STRIPE_API_KEY (required for Stripe
itself), STRIPE_METER_API, and the tuning variables of .env.example. With WORKER_METRICS_PORT:
GET /metrics and GET /health (200 while it runs and reaches PostgreSQL, else 503 and why) on
API_HOST:WORKER_METRICS_PORT. In your own process instead: createWorker from billing-outbox/worker.

Exit codes: 0 stopped by a signal, 1 failed, 2 a configuration error.
`;

/** Runs the worker until a signal has drained it; throws what stops it otherwise. */
export async function runWorker(): Promise<void> {
  loadDotEnv();
  const config = loadConfig();
  const log = createLogger(config.logLevel);
  const sdkMetricsAddress = config.workerMetricsPort === undefined ? undefined : `127.0.0.1:${await freePort()}`;
  installTemporalRuntime(log, sdkLogLevel(config.logLevel), sdkMetricsAddress);
  if (!config.databaseUrl) throw new Error('DATABASE_URL is not set (npm start runs everything embedded instead)');
  if (!config.stripe.apiKey && config.stripe.isRealStripe) {
    throw new Error('STRIPE_API_KEY is not set: the worker cannot report usage to Stripe without it');
  }
  const worker = await launchWorker(config, {
    migrate: true,
    handleSignals: true,
    log,
    // Created here rather than by the launch: the SDK's exporter is appended to every scrape.
    metrics: (pool) => createMetrics(undefined, { db: pool, temporalSdkUrl: sdkMetricsAddress && `http://${sdkMetricsAddress}/metrics` }),
    ...(config.workerMetricsPort === undefined ? {} : { http: { host: config.api.host, port: config.workerMetricsPort } }),
  });
  const running = worker.run();
  if (worker.url) log.info({ metrics: `${worker.url}/metrics`, health: `${worker.url}/health` }, 'worker metrics and health served');
  log.info({ database: redactUrl(config.databaseUrl), temporal: config.temporal.address ?? DEFAULT_TEMPORAL_ADDRESS, stripe: config.stripe.apiBase }, 'billing-outbox worker running');
  await running;
  log.info('worker stopped');
}
