/**
 * `npm run worker`: one worker process against configured services (DATABASE_URL, TEMPORAL_ADDRESS,
 * STRIPE_API_KEY). Migrates on boot (safe with many workers), runs until SIGTERM, then drains.
 * With WORKER_METRICS_PORT set, serves GET /metrics on API_HOST:WORKER_METRICS_PORT: this
 * process's registry followed by the Temporal SDK's worker metrics (exported on a loopback port).
 */
import { DEFAULT_TEMPORAL_ADDRESS } from '../temporal/connection.js';
import { loadConfig } from '../config.js';
import { loadDotEnv } from '../embedded/local-files.js';
import { createPool, migrate, redactUrl } from '../db.js';
import { freePort } from '../embedded/postgres.js';
import { createLogger } from '../log.js';
import { createMetrics, startMetricsServer, type MetricsServer } from '../metrics.js';
import { installTemporalRuntime, sdkLogLevel } from '../temporal/runtime.js';
import { runMain, untilSignal } from './run-main.js';
import { createStripeClient } from '../stripe/client.js';
import { connectTemporal, startWorker } from '../temporal/worker.js';
import { schemaFor } from '../outbox/sql/schema.js';

await runMain(async () => {
  loadDotEnv();
  const config = loadConfig();
  const log = createLogger(config.logLevel);
  const sdkMetricsAddress = config.workerMetricsPort === undefined ? undefined : `127.0.0.1:${await freePort()}`;
  installTemporalRuntime(log, sdkLogLevel(config.logLevel), sdkMetricsAddress);
  if (!config.databaseUrl) throw new Error('DATABASE_URL is not set (npm start runs everything embedded instead)');
  if (!config.stripe.apiKey && config.stripe.isRealStripe) {
    throw new Error('STRIPE_API_KEY is not set: the worker cannot report usage to Stripe without it');
  }
  const address = config.temporal.address ?? DEFAULT_TEMPORAL_ADDRESS;
  await migrate(config.databaseUrl, { schema: config.databaseSchema });
  const pool = createPool(config.databaseUrl);
  const { connection, client, clientConnection } = await connectTemporal(config.temporal);
  const stripe = createStripeClient(config.stripe);
  const metrics = createMetrics(undefined, { db: pool, schema: schemaFor(config.databaseSchema), temporalSdkUrl: sdkMetricsAddress && `http://${sdkMetricsAddress}/metrics` });
  const running = await startWorker({ config, databaseUrl: config.databaseUrl, pool, stripe, connection, client, log, metrics });
  let metricsServer: MetricsServer | undefined;
  if (config.workerMetricsPort !== undefined) {
    metricsServer = await startMetricsServer(metrics, { host: config.api.host, port: config.workerMetricsPort });
    log.info({ url: metricsServer.url }, 'worker metrics served');
  }
  log.info({ database: redactUrl(config.databaseUrl), temporal: address, stripe: config.stripe.apiBase }, 'billing-outbox worker running');

  const signal = await Promise.race([untilSignal(), running.done.then(() => undefined)]);
  if (signal) log.info({ signal }, 'shutting down: finishing in-flight activities');
  await running.shutdown();
  await metricsServer?.close();
  await clientConnection.close();
  await connection.close();
  await pool.end();
  log.info('worker stopped');
});
