/**
 * The schema (DATABASE_SCHEMA; recordUsage's and migrate's `schema`): billing-outbox's tables live
 * in a PostgreSQL schema of their own and every statement names it, so that an application's own
 * tables of the same names, its connections' search_path, and a second deployment in another
 * schema of the same database are never touched.
 *
 * The connections here are the product's and an application's, with the default search_path
 * (`"$user", public`): none of the fixture's, whose search_path finds billing-outbox's tables.
 */
import { randomUUID } from 'node:crypto';
import pg from 'pg';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { Config } from '../src/config.js';
import { createPool, migrate, withTransaction } from '../src/db.js';
import { LocalStripe } from '../src/embedded/stripe/server.js';
import { recordUsage } from '../src/outbox/enqueue.js';
import { setBillingCustomer } from '../src/outbox/customers.js';
import { schemaFor } from '../src/outbox/sql/schema.js';
import { createTestDb, startTestPipeline, temporalNamespace, testConfig, waitFor, type TestDb, type TestPipeline } from './helpers.js';

/** An application's own tables, in `public`: Rails' migration table, an outbox of its own, its jobs. */
const APPLICATION_TABLES = `
  CREATE TABLE schema_migrations (version varchar PRIMARY KEY);
  INSERT INTO schema_migrations VALUES ('20240101000000'), ('20240202000000');
  CREATE TABLE outbox (id bigserial PRIMARY KEY, topic text NOT NULL, payload jsonb NOT NULL);
  INSERT INTO outbox (topic, payload) VALUES ('user.created', '{"id": 1}');
  CREATE TABLE jobs (id text PRIMARY KEY)`;

const occurredAt = () => new Date(Date.now() - 60_000);

/** The row of `key` in `schema`'s outbox, read through a plain connection (qualified). */
async function rowIn(db: pg.Pool, schema: string, key: string) {
  const { rows } = await db.query(`SELECT * FROM ${schemaFor(schema).outbox} WHERE idempotency_key = $1`, [key]);
  return rows[0] as { status: string; quantity: number } | undefined;
}

const waitSent = (db: pg.Pool, schema: string, key: string) =>
  waitFor(`${key} to be sent in ${schema}`, async () => ((await rowIn(db, schema, key))?.status === 'sent' ? true : undefined));

describe('beside an application with tables of the same names', () => {
  let db: TestDb;
  let app: pg.Pool;
  let product: pg.Pool;
  let stripe: LocalStripe;
  let pipeline: TestPipeline | undefined;

  beforeAll(async () => {
    db = await createTestDb({ migrate: false });
    // The application's pool, as it makes it: node-postgres's defaults, its own search_path.
    app = new pg.Pool({ connectionString: db.url, max: 2 });
    product = createPool(db.url, 10);
    stripe = await LocalStripe.start({ meters: ['api_requests'], customers: ['cus_app'] });
    await app.query(APPLICATION_TABLES);
  });

  afterAll(async () => {
    await pipeline?.stop();
    await stripe?.close();
    await product?.end();
    await app?.end();
    await db?.drop();
  });

  it("migrates, records in the application's transaction and delivers, leaving its tables and search_path as they were", async () => {
    // A Rails-style schema_migrations(version) in public is not ours: migrate uses its own.
    expect(await migrate(db.url)).toContain('001_schema.sql');
    await setBillingCustomer(product, { tenantId: 'acme', stripeCustomerId: 'cus_app' }, { by: 'test' });

    const client = await app.connect();
    let key: string;
    try {
      const searchPath = (await client.query<{ search_path: string }>('SHOW search_path')).rows[0]!.search_path;
      await client.query('BEGIN');
      await client.query('INSERT INTO jobs (id) VALUES ($1)', ['job-1']);
      const recorded = await recordUsage(client, { tenantId: 'acme', usageId: 'job-1', quantity: 4, occurredAt: occurredAt() });
      await client.query(`INSERT INTO outbox (topic, payload) VALUES ('job.done', '{"id": "job-1"}')`);
      await client.query('COMMIT');
      expect(recorded.created).toBe(true);
      key = recorded.entry.idempotencyKey;
      expect((await client.query<{ search_path: string }>('SHOW search_path')).rows[0]!.search_path).toBe(searchPath);
    } finally {
      client.release();
    }

    // The worker on a pool with the default search_path, which finds the application's outbox first.
    const config = testConfig({ STRIPE_API_BASE: stripe.url, STRIPE_API_KEY: 'sk_test_schema_app' });
    pipeline = await startTestPipeline({ db: { ...db, pool: product }, config });
    await waitSent(product, 'billing_outbox', key);
    expect(stripe.events().filter((e) => e.identifier === key)).toEqual([expect.objectContaining({ value: 4, customer: 'cus_app' })]);

    expect((await app.query('SELECT version FROM schema_migrations ORDER BY version')).rows).toEqual([
      { version: '20240101000000' },
      { version: '20240202000000' },
    ]);
    expect((await app.query('SELECT topic FROM outbox ORDER BY id')).rows).toEqual([{ topic: 'user.created' }, { topic: 'job.done' }]);
    expect((await app.query('SELECT id FROM jobs')).rows).toEqual([{ id: 'job-1' }]);
    // Nothing of ours in public; all of it in billing_outbox.
    const tables = await app.query<{ schema: string; name: string }>(
      `SELECT table_schema AS schema, table_name AS name FROM information_schema.tables
        WHERE table_schema IN ('public', 'billing_outbox') ORDER BY 1, 2`,
    );
    expect(tables.rows.filter((t) => t.schema === 'public').map((t) => t.name)).toEqual(['jobs', 'outbox', 'schema_migrations']);
    expect(tables.rows.filter((t) => t.schema === 'billing_outbox').map((t) => t.name)).toEqual(
      expect.arrayContaining(['billing_customers', 'outbox', 'schema_migrations', 'usage_logs', 'meter_leases', 'rate_limits']),
    );
  });

  it('refuses a schema name that is not a plain identifier, before any statement', async () => {
    const client = await app.connect();
    try {
      await client.query('BEGIN');
      await expect(recordUsage(client, { tenantId: 'acme', usageId: 'u-bad', quantity: 1 }, { schema: 'public"; DROP TABLE jobs; --' })).rejects.toThrow(
        /plain lowercase identifier/,
      );
      // The transaction is intact (nothing was sent): the application goes on.
      expect((await client.query('SELECT count(*)::int AS n FROM jobs')).rows[0]).toEqual({ n: 1 });
      await client.query('ROLLBACK');
    } finally {
      client.release();
    }
    await expect(migrate(db.url, { schema: 'Billing' })).rejects.toThrow(/plain lowercase identifier/);
  });
});

describe('two deployments in two schemas of one database', () => {
  interface Deployment {
    schema: string;
    stripe: LocalStripe;
    config: Config;
    pipeline: TestPipeline;
  }
  let db: TestDb;
  let product: pg.Pool;
  const deployments: Deployment[] = [];

  beforeAll(async () => {
    db = await createTestDb({ migrate: false });
    product = createPool(db.url, 10);
    // Each its own Stripe account and Temporal namespace: the same tenant and usage ids make the
    // same keys, hence the same workflow ids and meter-event identifiers.
    const namespaces = ['default', await temporalNamespace()];
    for (const [i, schema] of ['bo_east', 'bo_west'].entries()) {
      await migrate(db.url, { schema });
      const customer = `cus_${schema}`;
      await setBillingCustomer(product, { tenantId: 'acme', stripeCustomerId: customer }, { schema, by: 'test' });
      const stripe = await LocalStripe.start({ meters: ['api_requests'], customers: [customer] });
      const config = testConfig({
        DATABASE_SCHEMA: schema,
        TEMPORAL_NAMESPACE: namespaces[i]!,
        STRIPE_API_BASE: stripe.url,
        STRIPE_API_KEY: `sk_test_${schema}`,
      });
      deployments.push({ schema, stripe, config, pipeline: await startTestPipeline({ db: { ...db, pool: product }, config }) });
    }
  });

  afterAll(async () => {
    for (const d of deployments) {
      await d.pipeline.stop();
      await d.stripe.close();
    }
    await product?.end();
    await db?.drop();
  });

  it('record and deliver the same tenant and usage id each once, under its own schema', async () => {
    const [east, west] = deployments as [Deployment, Deployment];
    const usageId = `shared-${randomUUID()}`;
    const at = occurredAt();
    const record = (d: Deployment, quantity: number) =>
      withTransaction(product, (c) => recordUsage(c, { tenantId: 'acme', usageId, quantity, occurredAt: at }, { schema: d.schema }));
    const a = await record(east, 3);
    const b = await record(west, 5);
    // Neither sees the other's usage: both are new, with the same key.
    expect([a.created, b.created]).toEqual([true, true]);
    expect(a.entry.idempotencyKey).toBe(b.entry.idempotencyKey);
    const key = a.entry.idempotencyKey;

    await waitSent(product, east.schema, key);
    await waitSent(product, west.schema, key);
    expect(east.stripe.events().filter((e) => e.identifier === key)).toEqual([expect.objectContaining({ value: 3, customer: 'cus_bo_east' })]);
    expect(west.stripe.events().filter((e) => e.identifier === key)).toEqual([expect.objectContaining({ value: 5, customer: 'cus_bo_west' })]);
    // Recording again in one schema finds its own entry only.
    expect((await record(west, 5)).created).toBe(false);
    expect((await rowIn(product, east.schema, key))?.quantity).toBe(3);
  });

  it("wake only their own relays: a row committed in one schema notifies that schema's channel", async () => {
    const [east, west] = deployments as [Deployment, Deployment];
    const listener = new pg.Client({ connectionString: db.url });
    await listener.connect();
    try {
      const heard: string[] = [];
      listener.on('notification', (n) => heard.push(n.channel));
      await listener.query(`LISTEN "${schemaFor(east.schema).outboxChannel}"`);
      await listener.query(`LISTEN "${schemaFor(west.schema).outboxChannel}"`);
      await withTransaction(product, (c) => recordUsage(c, { tenantId: 'acme', usageId: `east-only-${randomUUID()}`, quantity: 1 }, { schema: east.schema }));
      await waitFor('the notification', async () => (heard.length > 0 ? true : undefined));
      // A round trip after it: any notification committed with it has arrived by now.
      await listener.query('SELECT 1');
      expect(heard.every((channel) => channel === 'bo_east:outbox')).toBe(true);
    } finally {
      await listener.end();
    }
  });
});
