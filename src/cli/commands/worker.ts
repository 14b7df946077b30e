/**
 * `billing-outbox worker` (`npm run worker`, src/bin/worker.ts): one worker process against configured services
 * (DATABASE_URL, TEMPORAL_ADDRESS, STRIPE_API_KEY), on the same launch as the library's
 * createWorker (src/worker.ts). Migrates on boot (safe with many workers), runs until SIGTERM, then
 * drains. With WORKER_METRICS_PORT set, serves GET /metrics and GET /health on
 * API_HOST:WORKER_METRICS_PORT: this process's registry followed by the Temporal SDK's worker
 * metrics (exported on a loopback port), and whether the worker runs and reaches PostgreSQL.
 */
import { DEFAULT_TEMPORAL_ADDRESS } from '../../temporal/connection.js';
import { ConfigError, loadConfig, misspelledVariableWarnings } from '../../config.js';
import { halfSetBesideStack, loadDotEnv } from '../../embedded/local-files.js';
import { redactUrl } from '../../db.js';
import { freePort } from '../../embedded/postgres.js';
import { createLogger } from '../../log.js';
import { createMetrics } from '../../metrics.js';
import { schemaFor } from '../../outbox/sql/schema.js';
import { requireStripeKey } from '../../stripe/client.js';
import { installTemporalRuntime, sdkLogLevel } from '../../temporal/runtime.js';
import { launchWorker } from '../../temporal/worker.js';

/** Runs the worker until a signal has drained it; throws what stops it otherwise. */
export async function runWorker(): Promise<void> {
  loadDotEnv();
  const config = loadConfig();
  const databaseUrl = config.databaseUrl;
  if (!databaseUrl) throw new ConfigError(['DATABASE_URL: is not set (npm start runs everything embedded instead)']);
  const unset = halfSetBesideStack(config);
  if (unset) throw unset;
  requireStripeKey(config.stripe, 'the worker');
  const log = createLogger(config.logLevel);
  for (const warning of misspelledVariableWarnings()) log.warn(warning);
  const sdkMetricsAddress = config.workerMetricsPort === undefined ? undefined : `127.0.0.1:${await freePort()}`;
  installTemporalRuntime(log, sdkLogLevel(config.logLevel), sdkMetricsAddress);
  const worker = await launchWorker(config, {
    migrate: true,
    handleSignals: true,
    log,
    // Created here rather than by the launch: the SDK's exporter is appended to every scrape.
    metrics: (pool) => createMetrics(undefined, { db: pool, schema: schemaFor(config.databaseSchema), temporalSdkUrl: sdkMetricsAddress && `http://${sdkMetricsAddress}/metrics` }),
    ...(config.workerMetricsPort === undefined ? {} : { http: { host: config.api.host, port: config.workerMetricsPort } }),
    onRunning: () => {
      if (worker.url) log.info({ metrics: `${worker.url}/metrics`, health: `${worker.url}/health` }, 'worker metrics and health served');
      log.info({ database: redactUrl(databaseUrl), temporal: config.temporal.address ?? DEFAULT_TEMPORAL_ADDRESS, stripe: config.stripe.apiBase }, 'billing-outbox worker running');
    },
  });
  await worker.run();
  log.info('worker stopped');
}
