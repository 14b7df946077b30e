/**
 * `npm start`: the main job. Whatever is configured is used; whatever is not runs embedded:
 * - no DATABASE_URL      → embedded PostgreSQL with its data under .data/pg
 * - no TEMPORAL_ADDRESS  → a file-backed Temporal dev server (.data/temporal.db) with its Web UI
 * - no STRIPE_API_KEY    → the local Stripe-compatible server: NOTHING IS BILLED
 * then migrates and runs a worker (relays + usage workflows) and the HTTP API (API_HOST:API_PORT)
 * in one process, sharing one metrics registry, until SIGTERM/SIGINT.
 */
import { mkdir, writeFile } from 'node:fs/promises';
import net from 'node:net';
import path from 'node:path';
import { buildApi, temporalHealthConnection } from './api/index.js';
import { loadConfig, type Config } from './config.js';
import { createPool, migrate, redactUrl } from './db.js';
import { freePort, startEmbeddedPostgres } from './embedded/postgres.js';
import { PROJECT_ROOT, startTemporalDevServer } from './embedded/temporal.js';
import { createLogger } from './log.js';
import { createMetrics } from './metrics.js';
import { installTemporalRuntime } from './temporal-runtime.js';
import { runMain, untilSignal } from './main-util.js';
import { createStripeClient, LOCAL_TEST_KEY } from './stripe-client.js';
import { LocalStripe } from './stripe-local/server.js';
import { connectTemporal, startWorker } from './worker.js';

/** Tenants the embedded defaults come with, so events can flow without any set-up. */
export const DEMO_CUSTOMERS: Record<string, string> = { acme: 'cus_local_acme', globex: 'cus_local_globex', initech: 'cus_local_initech' };

async function portOr(preferred: number): Promise<number> {
  const free = await new Promise<boolean>((resolve) => {
    const srv = net.createServer();
    srv.once('error', () => resolve(false));
    srv.listen(preferred, '127.0.0.1', () => srv.close(() => resolve(true)));
  });
  return free ? preferred : freePort();
}

await runMain(async () => {
  let config: Config = loadConfig();
  const log = createLogger(config.logLevel);
  // The SDK's own worker metrics, on loopback only: the API's GET /metrics appends them.
  const sdkMetricsAddress = `127.0.0.1:${await freePort()}`;
  installTemporalRuntime(log, 'WARN', sdkMetricsAddress);
  const dataDir = path.resolve(config.dataDir ?? path.join(PROJECT_ROOT, '.data'));
  await mkdir(dataDir, { recursive: true, mode: 0o755 });
  const stops: (() => Promise<void>)[] = [];
  const stopAll = async () => {
    for (const stop of stops.reverse()) await stop().catch((err: unknown) => log.warn({ err: String(err) }, 'stop failed'));
  };

  try {
    let databaseUrl = config.databaseUrl;
    if (!databaseUrl) {
      const pg = await startEmbeddedPostgres({ dataDir: path.join(dataDir, 'pg'), port: await portOr(54329) });
      stops.push(pg.stop);
      databaseUrl = pg.url;
      log.info({ database: redactUrl(databaseUrl) }, 'embedded PostgreSQL started');
    }
    await migrate(databaseUrl);
    const pool = createPool(databaseUrl);
    stops.push(() => pool.end());
    const metrics = createMetrics(undefined, { db: pool, temporalSdkUrl: `http://${sdkMetricsAddress}/metrics` });

    let temporalAddress = config.temporal.address;
    let temporalUi: string | undefined;
    if (!temporalAddress) {
      const server = await startTemporalDevServer({
        dbFile: path.join(dataDir, 'temporal.db'),
        port: await portOr(7233),
        uiPort: await portOr(8233),
        headless: false,
        namespace: config.temporal.namespace,
        cliPath: config.temporalCliPath,
      });
      stops.push(server.stop);
      temporalAddress = server.address;
      temporalUi = server.uiUrl;
      log.info({ temporal: temporalAddress, ui: temporalUi }, 'embedded Temporal dev server started');
    }

    let localStripe: LocalStripe | undefined;
    if (!config.stripe.apiKey && config.stripe.isRealStripe) {
      localStripe = await LocalStripe.start({
        port: await portOr(12111),
        meters: [...new Set([config.stripe.meterEventName, 'tokens'])],
        customers: Object.values(DEMO_CUSTOMERS),
      });
      stops.push(() => localStripe!.close());
      config = { ...config, stripe: { ...config.stripe, apiBase: localStripe.url, apiKey: LOCAL_TEST_KEY, isRealStripe: false } };
      for (const [tenant, customer] of Object.entries(DEMO_CUSTOMERS)) {
        await pool.query(
          `INSERT INTO billing_customers (tenant_id, stripe_customer_id) VALUES ($1, $2) ON CONFLICT (tenant_id) DO NOTHING`,
          [tenant, customer],
        );
      }
      const banner = [
        '',
        '  ╔══════════════════════════════════════════════════════════════════════╗',
        '  ║  STRIPE IS THE LOCAL STRIPE-COMPATIBLE SERVER: NOTHING IS BILLED.   ║',
        '  ║  Set STRIPE_API_KEY (a test-mode key first) to report to Stripe.    ║',
        '  ╚══════════════════════════════════════════════════════════════════════╝',
        `    local Stripe: ${localStripe.url}  (recorded events: ${localStripe.url}/_local/events)`,
        '',
      ];
      console.error(banner.join('\n'));
      log.warn({ stripe: localStripe.url }, 'local Stripe-compatible server: nothing is billed');
    }

    const { connection, client, clientConnection } = await connectTemporal(temporalAddress, config.temporal.namespace);
    stops.push(async () => {
      await clientConnection.close();
      await connection.close();
    });
    const running = await startWorker({
      config,
      databaseUrl,
      pool,
      stripe: createStripeClient(config.stripe),
      connection,
      client,
      log,
      metrics,
    });
    stops.push(() => running.shutdown());

    // Stopped first (stops run in reverse): no new usage is taken while the worker drains.
    const temporalHealth = temporalHealthConnection(temporalAddress);
    stops.push(() => temporalHealth.close());
    const api = buildApi({ config, db: pool, log, temporal: temporalHealth, metrics });
    await api.listen({ host: config.api.host, port: await portOr(config.api.port) });
    stops.push(() => api.close());
    const apiUrl = `http://${config.api.host}:${(api.server.address() as net.AddressInfo).port}`;
    if (config.api.tokens.length === 0) log.warn('API_TOKENS is not set: the API answers GET /healthz only, every other route 401');

    // Where everything is, for tools on this machine (the file may hold the local database password).
    const endpoints = { pid: process.pid, databaseUrl, temporalAddress, temporalUi, stripeApiBase: config.stripe.apiBase, localStripe: Boolean(localStripe), api: apiUrl };
    await writeFile(path.join(dataDir, 'endpoints.json'), JSON.stringify(endpoints, null, 2), { mode: 0o600 });
    console.error(
      [
        'billing-outbox is running.',
        `  PostgreSQL:       ${redactUrl(databaseUrl)}`,
        `  Temporal:         ${temporalAddress}${temporalUi ? `   Web UI: ${temporalUi}` : ''}`,
        `  Stripe API base:  ${config.stripe.apiBase}${localStripe ? '  (local: nothing is billed)' : ''}`,
        `  API:              ${apiUrl}  (POST /v1/usage, GET /healthz, GET /metrics)`,
        `  Dead letters:     temporal workflow list -q 'OutboxStatus="dead"'`,
        'Stop with Ctrl-C.',
      ].join('\n'),
    );
    log.info({ endpoints: path.join(dataDir, 'endpoints.json') }, 'ready');

    const signal = await Promise.race([untilSignal(), running.done.then(() => undefined)]);
    log.info({ signal }, 'shutting down');
  } finally {
    await stopAll();
  }
  log.info('billing-outbox stopped');
});
