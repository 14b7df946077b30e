/**
 * The one fixture the test files share (pg-boss's test/hooks.ts is the model). A file asks for what
 * it needs at its top level and gets accessors back; the fixture registers its own beforeAll and
 * afterAll, so setup and teardown are written once:
 *
 *   const t = useDatabase({ customers: { acme: 'cus_acme' } });          // a migrated database
 *   const t = useStripe({ customers: { acme: 'cus_acme' } });            // + the local Stripe, a config for it
 *   const t = usePipeline({ customers: { acme: 'cus_acme' }, env: {…} }); // + relay and worker on Temporal
 *
 * (`perTest: true`: a fresh set for every test, with beforeEach/afterEach.)
 *
 *   const key = await t.enqueue('acme', 3);     // recordUsage, the product's own door
 *   const sent = await t.waitStatus(key, 'sent');
 *   expect(t.eventsFor(key)).toHaveLength(1);
 *
 * Data is seeded through the product's own functions (recordUsage, idempotencyKeyFor,
 * setBillingCustomer), never by re-deriving one of its rules here. The low-level parts the
 * fixture is built from (a database of its own, a test config, a worker on the shared Temporal dev
 * server, waitFor) live in ./helpers.ts.
 */
import { randomUUID } from 'node:crypto';
import type pg from 'pg';
import type { Client } from '@temporalio/client';
import { afterAll, afterEach, beforeAll, beforeEach } from 'vitest';
import type { Config } from '../src/config.js';
import { withTransaction, type Queryable } from '../src/db.js';
import { LocalStripe, type LocalStripeOptions } from '../src/embedded/stripe/server.js';
import type { Metrics } from '../src/metrics.js';
import { recordUsage } from '../src/outbox/enqueue.js';
import { idempotencyKeyFor } from '../src/outbox/keys.js';
import { setBillingCustomer } from '../src/outbox/customers.js';
import { schemaFor, type Schema } from '../src/outbox/sql/schema.js';
import type { OutboxStatus } from '../src/outbox/statuses.js';
import type { Tracing } from '../src/tracing.js';
import { createTestDb, startTestPipeline, testConfig, waitFor, type TestDb, type TestPipeline } from './helpers.js';

export { idempotencyKeyFor };
export { databaseUrlFor, runCliWithoutTemporal, statusCounts, testConfig, tracingWorkflowBundle, transactionsBegun, waitFor, workflowBundle } from './helpers.js';
export type { TestDb, TestPipeline } from './helpers.js';

/** Tenant → the Stripe customer it is billed as. */
export type Customers = Record<string, string>;

export interface UsageOptions {
  /** Default: a random UUID. */
  usageId?: string;
  /** Default: a minute ago (recordUsage refuses the future, Stripe the too-old). */
  occurredAt?: Date;
  /** Default: recordUsage's own default meter. */
  eventName?: string;
  /**
   * Runs in recordUsage's transaction, before it commits: to leave the row as a crash or a long
   * wait would (claimed by a relay that died, aged past Stripe's window), which no relay may see
   * in between.
   */
  beforeCommit?: (c: pg.PoolClient, key: string) => Promise<unknown>;
}

// ---------------------------------------------------------------------------------------------
// Seeding and reading, on any pool (also for files that run a database of their own).

/** Maps each tenant to its Stripe customer, as `billing-outbox customers set` does (without the audit row). */
export async function seedCustomers(db: Queryable, customers: Customers): Promise<void> {
  for (const [tenantId, stripeCustomerId] of Object.entries(customers)) await setBillingCustomer(db, { tenantId, stripeCustomerId }, { by: 'test' });
}

/** Records one usage through recordUsage in a transaction of its own; returns its idempotency key. */
/**
 * A local Stripe that refuses every meter-event call for `customer` with a 400 no retry mends
 * (`stripe: { refuseCustomers: { [customer]: refusedForGood(customer) } }`): its events die at once.
 */
export function refusedForGood(customer: string): { status: number; code: string; message: string } {
  return { status: 400, code: 'resource_missing', message: `Injected refusal of every call for ${customer}.` };
}

export async function enqueueUsage(pool: pg.Pool, tenantId: string, quantity = 1, opts: UsageOptions = {}): Promise<string> {
  return withTransaction(pool, async (c) => {
    const r = await recordUsage(c, {
      usageId: opts.usageId ?? randomUUID(),
      tenantId,
      quantity,
      occurredAt: opts.occurredAt ?? new Date(Date.now() - 60_000),
      ...(opts.eventName === undefined ? {} : { eventName: opts.eventName }),
    });
    await opts.beforeCommit?.(c, r.entry.idempotencyKey);
    return r.entry.idempotencyKey;
  });
}

/**
 * Commits `n` usages of one tenant in one transaction, as a backlog after an outage; their
 * quantities are 1…n and their usage ids `<prefix>1`…`<prefix>n`. Returns the keys in commit order.
 */
export async function enqueueBacklog(
  pool: pg.Pool,
  tenantId: string,
  n: number,
  opts: { prefix?: string; occurredAt?: Date } = {},
): Promise<string[]> {
  const prefix = opts.prefix ?? `${tenantId}-${randomUUID().slice(0, 8)}-`;
  const occurredAt = opts.occurredAt ?? new Date(Date.now() - 60_000);
  return withTransaction(pool, async (c) => {
    const keys: string[] = [];
    for (let g = 1; g <= n; g++) {
      const r = await recordUsage(c, { usageId: `${prefix}${g}`, tenantId, quantity: g, occurredAt });
      keys.push(r.entry.idempotencyKey);
    }
    return keys;
  });
}

export async function outboxRow(pool: Queryable, key: string) {
  const { rows } = await pool.query('SELECT * FROM outbox WHERE idempotency_key = $1', [key]);
  return rows[0];
}

/** Waits until the row of `key` has `status`; returns the row as it was then. */
export function waitForStatus(pool: Queryable, key: string, status: OutboxStatus, timeoutMs = 30_000) {
  return waitFor(
    `${key} to be ${status}`,
    async () => {
      const r = await outboxRow(pool, key);
      return r?.status === status ? r : undefined;
    },
    timeoutMs,
  );
}

// ---------------------------------------------------------------------------------------------
// The fixtures.

export interface DatabaseFixture {
  /** The file's own migrated database (URL, pool). */
  readonly db: TestDb;
  /** Its pool, whose search_path is `schema` (for the test's own statements; see TestDb). */
  readonly pool: pg.Pool;
  /** The schema billing-outbox was migrated into (the default), for the product's functions. */
  readonly schema: Schema;
  addCustomers(customers: Customers): Promise<void>;
  enqueue(tenantId: string, quantity?: number, opts?: UsageOptions): Promise<string>;
  backlog(tenantId: string, n: number, opts?: { prefix?: string; occurredAt?: Date }): Promise<string[]>;
  row(key: string): ReturnType<typeof outboxRow>;
  waitStatus(key: string, status: OutboxStatus, timeoutMs?: number): ReturnType<typeof waitForStatus>;
}

function required<T>(value: T | undefined, what: string): T {
  if (value === undefined) throw new Error(`${what} is not ready: use it inside a test or hook, after the fixture's beforeAll`);
  return value;
}

function databaseAccessors(get: () => TestDb): DatabaseFixture {
  return {
    get db() {
      return get();
    },
    get pool() {
      return get().pool;
    },
    schema: schemaFor(),
    addCustomers: (customers) => seedCustomers(get().pool, customers),
    enqueue: (tenantId, quantity, opts) => enqueueUsage(get().pool, tenantId, quantity, opts),
    backlog: (tenantId, n, opts) => enqueueBacklog(get().pool, tenantId, n, opts),
    row: (key) => outboxRow(get().pool, key),
    waitStatus: (key, status, timeoutMs) => waitForStatus(get().pool, key, status, timeoutMs),
  };
}

export interface DatabaseOptions {
  customers?: Customers;
  /** A fresh set for every test (beforeEach/afterEach) instead of one for the file. */
  perTest?: boolean;
}

const hooksFor = (opts: DatabaseOptions) => (opts.perTest ? { setUp: beforeEach, tearDown: afterEach } : { setUp: beforeAll, tearDown: afterAll });

/** A migrated database of the file's own, with `customers` mapped; dropped after the file. */
export function useDatabase(opts: DatabaseOptions = {}): DatabaseFixture {
  const { setUp, tearDown } = hooksFor(opts);
  let db: TestDb | undefined;
  setUp(async () => {
    db = await createTestDb();
    await seedCustomers(db.pool, opts.customers ?? {});
  });
  tearDown(async () => {
    await db?.drop();
    db = undefined;
  });
  return databaseAccessors(() => required(db, 'the database'));
}

export interface StripeOptions extends DatabaseOptions {
  /** The local Stripe's options. `customers` defaults to every customer in `customers` above. */
  stripe?: LocalStripeOptions;
  /** Config variables over testConfig's (which already points at the local Stripe). */
  env?: Record<string, string>;
}

export interface StripeFixture extends DatabaseFixture {
  readonly stripe: LocalStripe;
  /** testConfig pointing at the local Stripe, with `env` over it; a task queue of its own. */
  readonly config: Config;
  /** The meter events the local Stripe recorded under `key`. */
  eventsFor(key: string): ReturnType<LocalStripe['events']>;
  /** Every request the local Stripe received for `key`, in order. */
  requestsFor(key: string): ReturnType<LocalStripe['requests']>;
  /** Another config for the same Stripe: `env` over the file's own (and a task queue of its own). */
  configWith(env?: Record<string, string>): Config;
  /** A pipeline on this database and Stripe; stopped after the file, if the test did not stop it. */
  startPipeline(config: Config, opts?: { worker?: boolean; metrics?: Metrics }): Promise<TestPipeline>;
}

export interface PipelineOptions extends StripeOptions {
  /** False: a Temporal client only; start workers with `pipeline.addWorker()`. */
  worker?: boolean;
  /** Called once the database exists, for a pipeline that records metrics. */
  metrics?: (pool: pg.Pool) => Metrics;
  /** Tracing on, into this span processor (the file registers its own tracer provider). */
  tracing?: Tracing;
}

export interface PipelineFixture extends StripeFixture {
  readonly pipeline: TestPipeline;
  /** The pipeline's Temporal client. */
  readonly client: Client;
  readonly metrics: Metrics | undefined;
}

/** A database and a local Stripe-compatible server, with a config that points at it; no Temporal. */
export function useStripe(opts: StripeOptions = {}): StripeFixture {
  return useServices(opts, false);
}

/**
 * A database, a local Stripe-compatible server and a pipeline (relay and worker on the shared
 * Temporal dev server, a task queue of the file's own) delivering from one to the other.
 */
export function usePipeline(opts: PipelineOptions = {}): PipelineFixture {
  return useServices(opts, true);
}

function useServices(opts: PipelineOptions, withPipeline: boolean): PipelineFixture {
  let db: TestDb | undefined;
  let stripe: LocalStripe | undefined;
  let config: Config | undefined;
  let pipeline: TestPipeline | undefined;
  let metrics: Metrics | undefined;
  const started: TestPipeline[] = [];
  const customers = opts.customers ?? {};
  const configWith = (env: Record<string, string> = {}) =>
    testConfig({ STRIPE_API_BASE: required(stripe, 'the local Stripe').url, STRIPE_API_KEY: 'sk_test_fixture', ...opts.env, ...env });

  const { setUp, tearDown } = hooksFor(opts);
  setUp(async () => {
    db = await createTestDb();
    await seedCustomers(db.pool, customers);
    stripe = await LocalStripe.start({ customers: Object.values(customers), ...opts.stripe });
    config = configWith();
    metrics = opts.metrics?.(db.pool);
    if (withPipeline) pipeline = await startTestPipeline({ db, config, metrics, worker: opts.worker, tracing: opts.tracing });
  });
  tearDown(async () => {
    for (const p of started.splice(0)) await p.stop();
    await pipeline?.stop();
    await stripe?.close();
    await db?.drop();
    [db, stripe, config, pipeline, metrics] = [undefined, undefined, undefined, undefined, undefined];
  });

  const getStripe = () => required(stripe, 'the local Stripe');
  const fixture: Omit<PipelineFixture, keyof DatabaseFixture> = {
    get stripe() {
      return getStripe();
    },
    get config() {
      return required(config, 'the config');
    },
    get pipeline() {
      return required(pipeline, 'the pipeline');
    },
    get client() {
      return required(pipeline, 'the pipeline').client;
    },
    get metrics() {
      return metrics;
    },
    eventsFor: (key) => getStripe().events().filter((e) => e.identifier === key),
    requestsFor: (key) => getStripe().requests().filter((r) => r.identifier === key),
    configWith,
    async startPipeline(config, o = {}) {
      const p = await startTestPipeline({ db: required(db, 'the database'), config, ...o });
      // Stopped once: by the test, or after the file.
      const stop = p.stop.bind(p);
      let stopped: Promise<void> | undefined;
      p.stop = () => (stopped ??= stop());
      started.push(p);
      return p;
    },
  };
  // Copied as accessors: spreading would read them now, before beforeAll has run.
  return Object.defineProperties(fixture, Object.getOwnPropertyDescriptors(databaseAccessors(() => required(db, 'the database')))) as PipelineFixture;
}
