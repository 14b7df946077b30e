/**
 * The whole main job in one process, for `npm start` (src/bin/main.ts) and `npm run demo` (src/bin/demo.ts).
 *
 * Whatever the configuration names is used; whatever it leaves out runs embedded:
 * - no DATABASE_URL      → embedded PostgreSQL with its data under `<dataDir>/pg`
 * - no TEMPORAL_ADDRESS  → a file-backed Temporal dev server (`<dataDir>/temporal.db`) with its Web UI
 * - no STRIPE_API_KEY    → the local Stripe-compatible server (nothing is billed), with the demo
 *                          customers seeded on both sides; refused in NODE_ENV=production
 * - a live STRIPE_API_KEY → refused outside NODE_ENV=production (refuseUnfitConfig)
 * then it migrates and runs a worker (relays + usage workflows) and the HTTP API, sharing one
 * metrics registry. `stop()` undoes all of it, newest first.
 */
import { randomBytes } from 'node:crypto';
import { existsSync } from 'node:fs';
import { mkdir, readFile, rename, writeFile } from 'node:fs/promises';
import net from 'node:net';
import path from 'node:path';
import type { Client } from '@temporalio/client';
import type pg from 'pg';
import type Stripe from 'stripe';
import { buildApi, temporalHealthConnection } from '../api/index.js';
import { WEBHOOK_PATH } from '../api/webhooks.js';
import { ConfigError, PRODUCTION_ENVS, type ApiToken, type Config } from '../config.js';
import { answeredWithin, createPool, migrate, redactUrl, withPgTypes } from '../db.js';
import { stopLeftovers } from './leftovers.js';
import { describePortHolder, localUrl } from './ports.js';
import { EmbeddedPostgresError, freePort, startEmbeddedPostgres } from './postgres.js';
import { NoTemporalCliError, PROJECT_ROOT, startTemporalDevServer, type DevServer } from './temporal.js';
import { createLogger, type Logger } from '../log.js';
import { createMetrics } from '../metrics.js';
import { seedTenants } from '../ops/customers.js';
import { createStripeClient, LOCAL_TEST_KEY } from '../stripe/client.js';
import { MeterCatalog } from '../stripe/meters.js';
import { LocalStripe, type LocalStripeState } from './stripe/server.js';
import { installTemporalRuntime, sdkLogLevel } from '../temporal/runtime.js';
import { connectTemporal, startWorker } from '../temporal/worker.js';
import { ensureReconcileScheduleOrWarn } from '../temporal/reconcile-schedule.js';
import { schemaFor } from '../outbox/sql/schema.js';

/** How the refusals below say what production is (the NODE_ENV values that mean it). */
const IN_PRODUCTION = `in production (NODE_ENV ${PRODUCTION_ENVS.join(', ')}`;

/** Tenants the embedded defaults come with (tenant → Stripe customer), so events flow without set-up. */
export const DEMO_CUSTOMERS: Readonly<Record<string, string>> = {
  acme: 'cus_local_acme',
  globex: 'cus_local_globex',
  initech: 'cus_local_initech',
};

/** Meter event names the local Stripe server has meters for, besides STRIPE_METER_EVENT_NAME. */
export const LOCAL_METERS = ['api_requests', 'tokens'] as const;

export interface StackPorts {
  postgres: number;
  temporal: number;
  temporalUi: number;
  localStripe: number;
}

/** Where `npm start` puts the embedded services when these ports are free. */
export const PREFERRED_PORTS: StackPorts = { postgres: 54329, temporal: 7233, temporalUi: 8233, localStripe: 12111 };

export interface StackOptions {
  /** Embedded data (PostgreSQL, Temporal's SQLite file); default DATA_DIR, else `.data` in the project. */
  dataDir?: string;
  /**
   * Bearer tokens accepted besides API_TOKENS, for the caller's own client (the demo's). Like every
   * token, only their names are ever logged.
   */
  apiTokens?: ApiToken[];
  /**
   * Ports tried first for the embedded services; 0 means any free port. A preferred port that is
   * taken falls back to a free one. Default: PREFERRED_PORTS.
   */
  ports?: Partial<StackPorts>;
  /**
   * Logs errors only, the Temporal SDK's included: for a program that prints its own progress. The
   * SDK core's warnings still reach the console (each is a bug to fix).
   */
  quiet?: boolean;
  /** Default: a logger at LOG_LEVEL (at `error` when quiet). */
  log?: Logger;
}

export interface Stack {
  /** The configuration in effect: with the local Stripe server's base URL and key when it runs. */
  config: Config;
  dataDir: string;
  log: Logger;
  databaseUrl: string;
  pool: pg.Pool;
  temporalAddress: string;
  /** The embedded dev server's Web UI; undefined when TEMPORAL_ADDRESS was configured. */
  temporalUi: string | undefined;
  client: Client;
  /** The client the worker reports usage with. */
  stripe: Stripe;
  /** The local Stripe-compatible server, when no STRIPE_API_KEY was configured. */
  localStripe: LocalStripe | undefined;
  /** Tenant → Stripe customer seeded into billing_customers (local Stripe only; otherwise empty). */
  seededCustomers: Readonly<Record<string, string>>;
  apiUrl: string;
  /** Settles when the worker stops on its own (rejects if it crashed); stop() also ends it. */
  workerDone: Promise<void>;
  /**
   * Stops the API, the worker, the connections and every embedded service, newest first. Safe to
   * call twice (the first call's options apply).
   */
  stop(opts?: StopOptions): Promise<void>;
}

export interface StopOptions {
  /**
   * How long each step may take before the next one goes ahead anyway (default 30 s; the worker's
   * activities get 20 s to drain). A Ctrl-C in a terminal also reaches the embedded PostgreSQL,
   * which then shuts down at once: in-flight workflow tasks can no longer finish, and stopping a
   * server that is already gone waits for an exit that has happened. Neither must hang the stop.
   */
  stepTimeoutMs?: number;
}

const LIVE_KEY = /^(sk|rk)_live_/;

/**
 * Throws a ConfigError before anything starts when this configuration must not run as the stack:
 *
 * - Embedded services are for a developer's machine (a local PostgreSQL, a single-node Temporal on
 *   SQLite, the local Stripe-compatible server): in production they must be named.
 * - Outside production, a live Stripe key is refused. `npm start` and the CLI read `.env` in the
 *   checkout, the very file a deployment's settings used to be copied to: a developer starting the
 *   stack there would report synthetic or local usage to live Stripe, billed to real customers.
 *   NODE_ENV=production is the explicit way to run the main job against live Stripe (and it
 *   already requires a real PostgreSQL and Temporal). A test-mode key to Stripe itself bills
 *   nothing and stays allowed.
 *
 * `npm start` calls it before it writes anything (its API token); startStack calls it again for
 * every other caller.
 */
export function refuseUnfitConfig(config: Config): void {
  const problems: string[] = [];
  if (config.production) {
    if (!config.databaseUrl) problems.push(`DATABASE_URL: is required ${IN_PRODUCTION}; npm start does not run an embedded PostgreSQL in production)`);
    if (!config.temporal.address) problems.push(`TEMPORAL_ADDRESS: is required ${IN_PRODUCTION}; npm start does not run an embedded Temporal dev server in production)`);
    if (config.stripe.apiKey === undefined && config.stripe.isRealStripe) {
      problems.push(`STRIPE_API_KEY: is required ${IN_PRODUCTION}; npm start's local Stripe-compatible server bills nothing: the outbox's usage would be delivered to it, never to Stripe)`);
    }
  } else if (config.stripe.apiKey && LIVE_KEY.test(config.stripe.apiKey)) {
    problems.push(
      'STRIPE_API_KEY: is a live key, which the local stack never uses: live Stripe bills real customers. ' +
        'Use a test-mode key (sk_test_…), or none for the local Stripe-compatible server. ' +
        'A deployment keeps its settings in deploy/compose.env, not in .env (which npm start and the CLI read). ' +
        'To run the main job against live Stripe on purpose, set NODE_ENV=production (with DATABASE_URL and TEMPORAL_ADDRESS).',
    );
  }
  if (problems.length > 0) throw new ConfigError(problems);
}

/**
 * `preferred` if nothing listens there now, else any free port (0: any free port). A taken port is
 * said loudly, with what holds it: often a server an earlier run left behind, which links and
 * tools would otherwise reach instead of this run's.
 */
async function portOr(preferred: number, what: string, log: Logger): Promise<number> {
  if (!preferred) return freePort();
  const free = await new Promise<boolean>((resolve) => {
    const srv = net.createServer();
    srv.once('error', () => resolve(false));
    srv.listen(preferred, '127.0.0.1', () => srv.close(() => resolve(true)));
  });
  if (free) return preferred;
  const port = await freePort();
  const holder = await describePortHolder(preferred);
  log.warn({ what, preferredPort: preferred, port, holder }, `${what}: port ${preferred} is taken; using ${port}`);
  console.error(`billing-outbox: ${what} cannot have port ${preferred}: it is held by ${holder}. Using port ${port} instead; stop that process to get ${preferred} back.`);
  return port;
}

const portTaken = (err: unknown) =>
  (err instanceof EmbeddedPostgresError && err.portTaken) || (err as NodeJS.ErrnoException | undefined)?.code === 'EADDRINUSE';

/**
 * Starts a service on its preferred port when that is free (see portOr), else on any free one.
 * Another process can take the port between that check and the service's bind (two `npm start`s,
 * or the demo beside the main job): a preferred port lost that way is given up for a free one.
 */
export async function startOnPort<T>(what: string, preferred: number, log: Logger, start: (port: number) => Promise<T>): Promise<T> {
  const port = await portOr(preferred, what, log);
  try {
    return await start(port);
  } catch (err) {
    if (port !== preferred || !portTaken(err)) throw err;
    const other = await freePort();
    log.warn({ what, preferredPort: preferred, port: other }, `${what}: port ${preferred} was taken while it started; using ${other}`);
    return start(other);
  }
}

/**
 * How `promise` settles within `ms`: 'done', its error, or 'late' (it is then left running, its
 * eventual failure ignored). The pending timer keeps the process alive while waiting.
 */
async function within(promise: Promise<unknown>, ms: number): Promise<'done' | 'late' | { error: unknown }> {
  let timer: NodeJS.Timeout | undefined;
  const late = new Promise<'late'>((resolve) => (timer = setTimeout(() => resolve('late'), ms)));
  try {
    return await Promise.race([promise.then(() => 'done' as const, (error: unknown) => ({ error })), late]);
  } finally {
    clearTimeout(timer);
  }
}

const isAlive = (server: DevServer) => server.alive();

/**
 * Waits for the dev server's Web UI to answer and checks that the server is still running. The CLI
 * refuses to start when one of its ports is taken, but the frontend port check in
 * startTemporalDevServer cannot tell our server from another one that grabbed the same port a
 * moment earlier; a server that has exited by the time its UI answers was not ours.
 */
async function confirmDevServer(server: DevServer, log: Logger): Promise<void> {
  const until = Date.now() + 15_000;
  while (server.uiUrl && isAlive(server) && Date.now() < until) {
    const ok = await fetch(server.uiUrl, { signal: AbortSignal.timeout(1_000) }).then(
      (res) => res.ok,
      () => false,
    );
    if (ok) break;
    await new Promise((r) => setTimeout(r, 100));
  }
  if (!isAlive(server)) throw new Error('temporal dev server exited right after starting');
  if (server.uiUrl && Date.now() >= until) log.warn({ ui: server.uiUrl }, 'Temporal Web UI is not answering yet');
}

/**
 * Starts every service the configuration does not name, then the worker and the API. On a failure
 * part-way, what was started is stopped again before the error is thrown.
 */
export async function startStack(configured: Config, opts: StackOptions = {}): Promise<Stack> {
  let config = configured;
  if (opts.apiTokens?.length) config = { ...config, api: { ...config.api, tokens: [...config.api.tokens, ...opts.apiTokens] } };
  const quietLevel = ['fatal', 'silent'].includes(config.logLevel) ? config.logLevel : 'error';
  const log = opts.log ?? createLogger(opts.quiet ? quietLevel : config.logLevel);
  const ports: StackPorts = { ...PREFERRED_PORTS, ...opts.ports };
  // The SDK's own worker metrics, on loopback only: the API's GET /metrics appends them.
  const sdkMetricsAddress = `127.0.0.1:${await freePort()}`;
  installTemporalRuntime(log, opts.quiet ? 'ERROR' : sdkLogLevel(config.logLevel), sdkMetricsAddress, !opts.quiet);
  const dataDir = path.resolve(opts.dataDir ?? config.dataDir ?? path.join(PROJECT_ROOT, '.data'));
  await mkdir(dataDir, { recursive: true, mode: 0o755 });

  const steps: { what: string; run: () => Promise<void> }[] = [];
  const onStop = (what: string, run: () => Promise<void>) => steps.push({ what, run });
  let stopping: Promise<void> | undefined;
  const stop = (stopOpts: StopOptions = {}) =>
    (stopping ??= (async () => {
      const timeoutMs = stopOpts.stepTimeoutMs ?? 30_000;
      for (const { what, run } of steps.reverse()) {
        const outcome = await within(run(), timeoutMs);
        if (outcome === 'late') log.warn({ step: what, timeoutMs }, 'did not stop in time; going on without it');
        else if (outcome !== 'done') log.warn({ step: what, err: String(outcome.error) }, 'stop failed');
      }
    })());

  refuseUnfitConfig(config);

  // Servers an earlier run left on these files would hold their locks and ports.
  if (!config.databaseUrl || !config.temporal.address) await stopLeftovers(dataDir, (line) => console.error(line));

  try {
    let databaseUrl = config.databaseUrl;
    if (!databaseUrl) {
      const pg = await startOnPort('embedded PostgreSQL', ports.postgres, log, (port) => startEmbeddedPostgres({ dataDir: path.join(dataDir, 'pg'), port }));
      onStop('embedded PostgreSQL', () => pg.stop());
      databaseUrl = pg.url;
      log.info({ database: redactUrl(databaseUrl) }, 'embedded PostgreSQL started');
    }
    await migrate(databaseUrl, { schema: config.databaseSchema, onWait: (message) => log.warn(message) });
    const pool = createPool(databaseUrl, 10, { waitMs: config.timings.statementAnswerMs });
    onStop('database pool', () => pool.end());
    // The scrape's counts are maintenance, as in a worker: never waited on for good.
    const metrics = createMetrics(undefined, { db: answeredWithin(pool, config.timings.maintenanceAnswerMs), schema: schemaFor(config.databaseSchema), temporalSdkUrl: `http://${sdkMetricsAddress}/metrics` });

    let temporalAddress = config.temporal.address;
    let temporalUi: string | undefined;
    if (!temporalAddress) {
      const start = async (port: number, uiPort: number) => {
        const server = await startTemporalDevServer({
          dbFile: path.join(dataDir, 'temporal.db'),
          port,
          uiPort,
          headless: false,
          namespace: config.temporal.namespace,
          cliPath: config.temporalCliPath,
        });
        try {
          await confirmDevServer(server, log);
        } catch (err) {
          await server.stop();
          throw err;
        }
        return server;
      };
      const preferred = [await portOr(ports.temporal, 'Temporal dev server', log), await portOr(ports.temporalUi, 'Temporal Web UI', log)] as const;
      let server: DevServer;
      try {
        server = await start(...preferred);
      } catch (err) {
        // Another process can take a port between our check and the server's bind (two `npm start`s,
        // or the demo next to the main job): once more, on ports no one asked for.
        if ((preferred[0] !== ports.temporal && preferred[1] !== ports.temporalUi) || err instanceof NoTemporalCliError) throw err;
        log.warn({ err: String(err) }, 'temporal dev server did not start on its preferred ports; trying free ones');
        server = await start(await freePort(), await freePort());
      }
      onStop('Temporal dev server', server.stop);
      temporalAddress = server.address;
      temporalUi = server.uiUrl;
      log.info({ temporal: temporalAddress, ui: temporalUi }, 'embedded Temporal dev server started');
    }

    let localStripe: LocalStripe | undefined;
    const seededCustomers: Record<string, string> = {};
    if (!config.stripe.apiKey && config.stripe.isRealStripe) {
      // Its account and recorded events live with the rest of the data folder, so that after a
      // restart "Stripe" still agrees with the outbox (and its identifier dedup still holds).
      const stateFile = path.join(dataDir, 'stripe-local.json');
      const state = await loadLocalStripeState(stateFile, log);
      const stripeServer = await startOnPort('local Stripe', ports.localStripe, log, (port) =>
        LocalStripe.start({
          port,
          meters: [...new Set([config.stripe.meterEventName, ...LOCAL_METERS])],
          customers: Object.values(DEMO_CUSTOMERS),
          ...(state ? { state } : {}),
        }),
      );
      localStripe = stripeServer;
      const saver = keepLocalStripeState(stripeServer, stateFile, log);
      onStop('local Stripe', async () => {
        await saver.stop();
        await stripeServer.close();
      });
      // Its error reports go to this stack's API (set once the API listens), signed with a secret
      // of this run's own that the API verifies: an event it takes for a customer it does not have
      // ends `rejected_async`, as with Stripe and a configured webhook. Never the deployment's
      // STRIPE_WEBHOOK_SECRET(_FILE): nothing else signs for this server, and a secret file changed
      // while running would leave the two apart.
      const { webhookSecretFile: _deployments, ...stripeConfig } = config.stripe;
      const webhookSecret = `whsec_local${randomBytes(24).toString('hex')}`;
      config = { ...config, stripe: { ...stripeConfig, apiBase: stripeServer.url, apiKey: LOCAL_TEST_KEY, isRealStripe: false, webhookSecret } };
      // An operator's own mapping for one of these tenants is kept.
      await seedTenants(pool, schemaFor(config.databaseSchema), DEMO_CUSTOMERS);
      Object.assign(seededCustomers, DEMO_CUSTOMERS);
      log.warn({ stripe: stripeServer.url }, 'local Stripe-compatible server: nothing is billed');
    }

    const { connection, client, close } = await connectTemporal({ ...config.temporal, address: temporalAddress });
    onStop('Temporal connections', close);
    const stripe = createStripeClient(config.stripe, { log });
    const running = await startWorker({ config, databaseUrl, pool, stripe, connection, client, log, metrics, keepReconcileSchedule: config.reconcile.schedule });
    onStop('worker', () => running.shutdown());
    if (config.reconcile.schedule) await ensureReconcileScheduleOrWarn(client, config, log);
    // Handled here so a crash before anyone awaits it is not an unhandled rejection; callers that
    // await workerDone still see it.
    running.done.catch(() => undefined);

    // Stopped first (steps run in reverse): no new usage is taken while the worker drains.
    const temporalHealth = temporalHealthConnection({ ...config.temporal, address: temporalAddress });
    onStop('health connection', () => temporalHealth.close());
    // Each of the API's statements answered within statementAnswerMs, as the standalone API's pool
    // gives them (its own pool is the worker's here, whose maintenance takes longer).
    const apiDb = withPgTypes(pool, { answerMs: config.timings.statementAnswerMs });
    const api = buildApi({ config, db: apiDb, log, temporal: temporalHealth, metrics, meters: new MeterCatalog(stripe) });
    await api.listen({ host: config.api.host, port: await portOr(config.api.port, 'HTTP API', log) });
    onStop('API', () => api.close());
    const apiUrl = localUrl(config.api.host, (api.server.address() as net.AddressInfo).port);
    if (localStripe && config.stripe.webhookSecret) localStripe.setWebhook({ url: `${apiUrl}${WEBHOOK_PATH}`, secret: config.stripe.webhookSecret });
    if (config.api.tokens.length === 0) log.warn('API_TOKENS is not set: the API answers GET /health only, every other route 401');

    return {
      config,
      dataDir,
      log,
      databaseUrl,
      pool,
      temporalAddress,
      temporalUi,
      client,
      stripe,
      localStripe,
      seededCustomers,
      apiUrl,
      workerDone: running.done,
      stop,
    };
  } catch (err) {
    await stop();
    throw err;
  }
}

async function loadLocalStripeState(file: string, log: Logger): Promise<LocalStripeState | undefined> {
  if (!existsSync(file)) return undefined;
  try {
    const state = JSON.parse(await readFile(file, 'utf8')) as LocalStripeState;
    if (state.version !== 1) throw new Error(`unknown version ${String(state.version)}`);
    return state;
  } catch (err) {
    log.warn({ file, err: String(err) }, 'local Stripe: could not read its saved state; starting empty');
    return undefined;
  }
}

/** Saves the local Stripe's state every few seconds when it changed, and once more at stop. */
function keepLocalStripeState(server: LocalStripe, file: string, log: Logger): { stop(): Promise<void> } {
  let saved = '';
  const save = async () => {
    if (server.stateMark === saved) return;
    const snapshot = server.snapshot();
    // After the snapshot: taking it publishes the failures still waiting for their report.
    const mark = server.stateMark;
    const tmp = `${file}.tmp`;
    await writeFile(tmp, JSON.stringify(snapshot), { mode: 0o600 });
    await rename(tmp, file);
    saved = mark;
  };
  let saving = Promise.resolve();
  const timer = setInterval(() => {
    saving = saving.then(save).catch((err: unknown) => log.warn({ err: String(err) }, 'local Stripe: could not save its state'));
  }, 3_000);
  timer.unref();
  return {
    async stop() {
      clearInterval(timer);
      await saving;
      await save();
    },
  };
}

/** The warning `npm start` prints when usage goes to the local Stripe server. */
export function localStripeBanner(url: string): string {
  return [
    '',
    '  ╔══════════════════════════════════════════════════════════════════════╗',
    '  ║  STRIPE IS THE LOCAL STRIPE-COMPATIBLE SERVER: NOTHING IS BILLED.   ║',
    '  ║  Set STRIPE_API_KEY (a test-mode key first) to report to Stripe.    ║',
    '  ╚══════════════════════════════════════════════════════════════════════╝',
    `    local Stripe: ${url}  (recorded events: ${url}/_local/events)`,
    '',
  ].join('\n');
}
