/**
 * The low-level parts the fixture in ./hooks.ts is built from: a fresh database per test file on
 * the shared PostgreSQL server, a Temporal client and worker on the shared dev server with a task
 * queue of the file's own, and configs. Test files ask hooks.ts (useDatabase, useStripe,
 * usePipeline); a file that runs servers of its own (restarts) takes these parts directly.
 */
import { randomUUID } from 'node:crypto';
import { readFileSync } from 'node:fs';
import pg from 'pg';
import { inject } from 'vitest';
import { Client as TemporalClient, Connection, type Client } from '@temporalio/client';
import { msToTs } from '@temporalio/common/lib/time.js';
import { temporal } from '@temporalio/proto';
import { bundleWorkflowCode, type NativeConnection } from '@temporalio/worker';
import { loadConfig, type Config } from '../src/config.js';
import { createPool, migrate, type Queryable } from '../src/db.js';
import type { Metrics } from '../src/metrics.js';
import { setBillingCustomer } from '../src/outbox/customers.js';
import { schemaFor } from '../src/outbox/sql/schema.js';
import { createStripeClient } from '../src/stripe/client.js';
import { connectTemporal, startWorker, WORKFLOWS_PATH, type RunningWorker } from '../src/temporal/worker.js';
import { workflowTracingModule, type Tracing } from '../src/tracing.js';
import { installTemporalRuntime } from '../src/temporal/runtime.js';
import { SEARCH_ATTRIBUTES } from '../workflows/shared.js';
import './provided.js';

// The SDK's warnings (every injected Stripe failure is one) would drown the test output.
installTemporalRuntime(undefined, 'ERROR');

export interface TestDb {
  /** The database's URL, as the product is given it (no search_path of its own). */
  url: string;
  /**
   * A pool whose search_path is the default schema's, so that a test reads `FROM outbox`. For the
   * tests' own statements: the product never relies on search_path (test/schema.test.ts runs it on
   * connections whose search_path finds an application's tables of the same names first).
   */
  pool: pg.Pool;
  drop(): Promise<void>;
}

export function databaseUrlFor(name: string): string {
  const url = new URL(inject('adminDatabaseUrl'));
  url.pathname = `/${name}`;
  return url.toString();
}

/** A new database of the test file's own, migrated into the default schema (unless `migrate: false`). */
export async function createTestDb(opts: { migrate?: boolean } = {}): Promise<TestDb> {
  const name = `bo_test_${randomUUID().replace(/-/g, '').slice(0, 12)}`;
  const admin = new pg.Client({ connectionString: inject('adminDatabaseUrl') });
  await admin.connect();
  await admin.query(`CREATE DATABASE ${name}`);
  await admin.end();
  const url = databaseUrlFor(name);
  if (opts.migrate !== false) await migrate(url);
  const pool = createPool(withSearchPath(url, schemaFor().name), 20);
  return {
    url,
    pool,
    async drop() {
      await pool.end();
      const a = new pg.Client({ connectionString: inject('adminDatabaseUrl') });
      await a.connect();
      await a.query(`DROP DATABASE IF EXISTS ${name} WITH (FORCE)`);
      await a.end();
    },
  };
}

/** `url` with `schema` as its connections' search_path: only for tests' own pools. */
export function withSearchPath(url: string, schema: string): string {
  const u = new URL(url);
  u.searchParams.set('options', `-c search_path=${schema}`);
  return u.toString();
}

/**
 * A new Temporal namespace on the shared dev server (with the search attributes), for a second
 * deployment in a test: deployments with the same tenant and usage ids have the same keys, so the
 * same workflow ids, which must live in namespaces of their own.
 */
export async function temporalNamespace(opts: { searchAttributes?: boolean } = {}): Promise<string> {
  const name = `bo-ns-${randomUUID().slice(0, 8)}`;
  const connection = await Connection.connect({ address: inject('temporalAddress') });
  try {
    await connection.workflowService.registerNamespace({ namespace: name, workflowExecutionRetentionPeriod: msToTs('1 day') });
    if (opts.searchAttributes === false) {
      // Known to the server (its namespace cache) before it is used.
      await waitFor(`namespace ${name}`, async () => Boolean(await connection.operatorService.listSearchAttributes({ namespace: name })));
      return name;
    }
    const keyword = temporal.api.enums.v1.IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD;
    await waitFor(`namespace ${name}`, async () => {
      await connection.operatorService.addSearchAttributes({ namespace: name, searchAttributes: Object.fromEntries(SEARCH_ATTRIBUTES.map((k) => [k.name, keyword])) });
      return true;
    });
  } finally {
    await connection.close();
  }
  return name;
}

/** One tenant → customer mapping, through the product's own statement (hooks.ts: seedCustomers for several). */
export async function addCustomer(db: pg.Pool, tenantId: string, stripeCustomerId: string): Promise<void> {
  await setBillingCustomer(db, { tenantId, stripeCustomerId }, { by: 'test' });
}

/** A config for tests: fast retries, a task queue of its own, and whatever `env` overrides. */
export function testConfig(env: Record<string, string> = {}): Config {
  return loadConfig({
    NODE_ENV: 'test',
    TEMPORAL_ADDRESS: inject('temporalAddress'),
    TEMPORAL_TASK_QUEUE: `test-${randomUUID()}`,
    RETRY_INITIAL_INTERVAL_MS: '50',
    RETRY_BACKOFF_COEFFICIENT: '2',
    RETRY_MAXIMUM_INTERVAL_MS: '200',
    RETRY_MAXIMUM_ATTEMPTS: '4',
    RELAY_COUNT: '1',
    RELAY_POLL_INTERVAL_MS: '200',
    // A lost answer keeps its (customer, meter) closed this long; short, so retries in tests come quickly.
    STRIPE_UNANSWERED_HOLD_MS: '300',
    // Failures spend attempts as the retry policy says, whatever failed before in the same worker;
    // waiting out an outage is tested where it is turned on (outage.test.ts).
    RETRY_MAX_OUTAGE_MS: '0',
    LOG_LEVEL: 'silent',
    ...env,
  });
}

export function workflowBundle(): { code: string } {
  return { code: readFileSync(inject('workflowBundlePath'), 'utf8') };
}

let tracingBundle: Promise<{ code: string }> | undefined;

/**
 * The workflows with Temporal's OpenTelemetry workflow interceptors, as a worker with tracing on
 * runs them; bundled on first use by the one file that traces, not by the global setup for all.
 */
export function tracingWorkflowBundle(): Promise<{ code: string }> {
  const noop = () => undefined;
  const logger = { trace: noop, debug: noop, info: noop, log: noop, warn: noop, error: console.error };
  tracingBundle ??= bundleWorkflowCode({ workflowsPath: WORKFLOWS_PATH, logger, workflowInterceptorModules: [workflowTracingModule()] }).then(({ code }) => ({ code }));
  return tracingBundle;
}

/** A Temporal client whose workflow starts reach the server and whose answers do not reach us. */
export function startsAnswerLost(connection: Client['connection']): Client {
  return new TemporalClient({
    connection,
    interceptors: {
      workflow: [
        {
          async start(input, next) {
            await next(input);
            throw new Error('14 UNAVAILABLE: the connection was reset before the answer arrived');
          },
        },
      ],
    },
  });
}

export async function waitFor<T>(what: string, fn: () => Promise<T | undefined | false>, timeoutMs = 30_000, everyMs = 100): Promise<T> {
  const until = Date.now() + timeoutMs;
  let last: unknown;
  while (Date.now() < until) {
    try {
      const v = await fn();
      if (v !== undefined && v !== false) return v;
    } catch (err) {
      last = err;
    }
    await new Promise((r) => setTimeout(r, everyMs));
  }
  throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}${last ? `: ${String(last)}` : ''}`);
}

/**
 * The BEGIN statements sent through `pool`'s clients from now on, in order: what a code path opens
 * its transactions with (BEGIN_SHORT or not; db-failover.test.ts shows what BEGIN_SHORT does).
 */
export function transactionsBegun(pool: pg.Pool): string[] {
  const begun: string[] = [];
  const watched = new WeakSet<object>();
  pool.on('acquire', (client) => {
    if (watched.has(client)) return;
    watched.add(client);
    const query = client.query.bind(client) as (...args: unknown[]) => unknown;
    (client as { query: unknown }).query = (...args: unknown[]) => {
      const text = typeof args[0] === 'string' ? args[0] : (args[0] as { text?: string }).text;
      if (text?.startsWith('BEGIN')) begun.push(text);
      return query(...args);
    };
  });
  return begun;
}

export async function statusCounts(pool: pg.Pool): Promise<Record<string, number>> {
  const { rows } = await pool.query<{ status: string; n: number }>('SELECT status, count(*)::int AS n FROM outbox GROUP BY status');
  return Object.fromEntries(rows.map((r) => [r.status, r.n]));
}

export interface TestPipeline {
  client: Client;
  connection: NativeConnection;
  /** Workers started with `addWorker` (the first one is started by `startTestPipeline`). */
  workers: RunningWorker[];
  addWorker(): Promise<RunningWorker>;
  /** Ends this task queue's open workflows (dead letters wait forever), stops workers, closes. */
  stop(): Promise<void>;
}

/**
 * A Temporal client on the shared dev server and, unless `worker: false`, one in-process worker for
 * `config`'s task queue, delivering to whatever Stripe `config` names.
 */
export async function startTestPipeline(opts: {
  db: TestDb;
  config: Config;
  metrics?: Metrics;
  worker?: boolean;
  /** Tracing on: the workers run Temporal's OpenTelemetry interceptors, workflow spans to this. */
  tracing?: Tracing;
}): Promise<TestPipeline> {
  const { config, db } = opts;
  const t = await connectTemporal(config.temporal);
  const workers: RunningWorker[] = [];
  const addWorker = async () => {
    const w = await startWorker({
      config,
      databaseUrl: db.url,
      pool: db.pool,
      stripe: createStripeClient(config.stripe),
      connection: t.connection,
      client: t.client,
      metrics: opts.metrics,
      workflowBundle: opts.tracing ? await tracingWorkflowBundle() : workflowBundle(),
      tracing: opts.tracing,
      relayRunForMs: 5_000,
      workerOptions: { shutdownGraceTime: '1 second', shutdownForceTime: '5 seconds' },
    });
    workers.push(w);
    return w;
  };
  if (opts.worker !== false) {
    try {
      await addWorker();
    } catch (err) {
      await t.close();
      throw err;
    }
  }
  return {
    client: t.client,
    connection: t.connection,
    workers,
    addWorker,
    async stop() {
      const running = t.client.workflow.list({ query: `TaskQueue = "${config.temporal.taskQueue}" AND ExecutionStatus = "Running"` });
      for await (const wf of running) {
        await t.client.workflow.getHandle(wf.workflowId).terminate('test finished').catch(() => undefined);
      }
      for (const w of workers.splice(0)) await w.shutdown();
      await t.close();
    },
  };
}

/** Runs the operator CLI in-process against the test database, capturing what it prints. */
export async function runCliWithoutTemporal(argv: string[], config: Config, db: TestDb): Promise<{ code: number; out: string; err: string }> {
  const { runCli } = await import('../src/cli/run.js');
  let out = '';
  let err = '';
  const code = await runCli(argv, {
    config,
    db: async () => db.pool,
    temporal: async () => {
      throw new Error('no Temporal in this test');
    },
    out: { write: (s: string) => (out += s) },
    err: { write: (s: string) => (err += s) },
    user: 'test-operator',
  });
  return { code, out, err };
}

/**
 * The plan PostgreSQL makes for exactly the statement `send` sends (captured, not run: EXPLAIN
 * plans it without running it), as EXPLAIN prints it. SHOW_PLAN=1 prints it to stderr.
 */
export async function planOf(db: Queryable, send: (capture: Queryable) => Promise<unknown>): Promise<string> {
  let sent: { text: string; values: unknown[] } | undefined;
  const capture: Queryable = {
    query: ((text: string, values: unknown[]) => {
      sent = { text, values };
      return Promise.resolve({ rows: [] });
    }) as unknown as Queryable['query'],
  };
  await send(capture);
  const { rows } = await db.query(`EXPLAIN ${sent!.text}`, sent!.values);
  const plan = rows.map((r: Record<string, string>) => r['QUERY PLAN']).join('\n');
  if (process.env.SHOW_PLAN) console.error(plan);
  return plan;
}
