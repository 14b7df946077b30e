/**
 * Servers restarted under a running pipeline: PostgreSQL and the Temporal server each go away and
 * come back while events are queued and in flight. This file runs its own PostgreSQL and Temporal
 * (the shared ones serve the other files), and every committed event must still be billed once.
 */
import { randomUUID } from 'node:crypto';
import { chmod, mkdtemp, rm } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { afterAll, beforeAll, expect, it } from 'vitest';
import type { Config } from '../src/config.js';
import { createPool, migrate, withTransaction } from '../src/db.js';
import { startEmbeddedPostgres, type EmbeddedPg } from '../src/embedded/postgres.js';
import { startTemporalDevServer, type DevServer } from '../src/embedded/temporal.js';
import { recordUsage } from '../src/outbox/enqueue.js';
import { LocalStripe } from '../src/embedded/stripe/server.js';
import { startTestPipeline, withSearchPath } from './helpers.js';
import { schemaFor } from '../src/outbox/sql/schema.js';
// This file runs its own PostgreSQL and Temporal: it uses the fixture's parts, not the fixture.
import { seedCustomers, testConfig, waitFor, type TestDb, type TestPipeline } from './hooks.js';

let tmp: string;
let pg: EmbeddedPg;
let temporal: DevServer;
let stripe: LocalStripe;
let db: TestDb;
let config: Config;
let pipeline: TestPipeline;

beforeAll(async () => {
  tmp = await mkdtemp(path.join(os.tmpdir(), 'billing-outbox-restarts-'));
  await chmod(tmp, 0o755);
  pg = await startEmbeddedPostgres({ dataDir: path.join(tmp, 'pg'), database: 'restarts' });
  await migrate(pg.url);
  const pool = createPool(withSearchPath(pg.url, schemaFor().name), 20);
  db = { url: pg.url, pool, drop: () => pool.end() };
  await seedCustomers(pool, { a: 'cus_a', b: 'cus_b', c: 'cus_c' });
  temporal = await startTemporalDevServer({ dbFile: path.join(tmp, 'temporal.db') });
  stripe = await LocalStripe.start({ meters: ['api_requests'], customers: ['cus_a', 'cus_b', 'cus_c'] });
  config = testConfig({
    TEMPORAL_ADDRESS: temporal.address,
    STRIPE_API_BASE: stripe.url,
    STRIPE_API_KEY: 'sk_test_restarts',
    RETRY_MAXIMUM_ATTEMPTS: '100',
    RETRY_MAXIMUM_INTERVAL_MS: '1000',
  });
  pipeline = await startTestPipeline({ db, config });
}, 120_000);

afterAll(async () => {
  await pipeline?.stop().catch(() => undefined);
  await stripe?.close();
  await db?.drop().catch(() => undefined);
  await temporal?.stop();
  await pg?.stop();
  if (tmp) await rm(tmp, { recursive: true, force: true });
}, 60_000);

async function enqueue(n: number, prefix: string): Promise<string[]> {
  const keys: string[] = [];
  for (let i = 0; i < n; i++) {
    const r = await withTransaction(db.pool, (c) => recordUsage(c, { usageId: `${prefix}-${i}`, tenantId: 'abc'[i % 3]!, quantity: i + 1 }));
    keys.push(r.entry.idempotencyKey);
  }
  return keys;
}

async function allSent(keys: string[]): Promise<boolean> {
  const { rows } = await db.pool.query(`SELECT count(*)::int AS n FROM outbox WHERE idempotency_key = ANY($1) AND status = 'sent'`, [keys]);
  return rows[0].n === keys.length;
}

function expectBilledOnce(keys: string[]): void {
  for (const key of keys) expect(stripe.events().filter((e) => e.identifier === key), key).toHaveLength(1);
}

it('PostgreSQL restarted while events are in flight: all delivered once after it is back', async () => {
  stripe.setLatency(300);
  const keys = await enqueue(30, `pg-${randomUUID()}`);
  await waitFor('deliveries under way', async () => stripe.events().length >= 2, 30_000, 20);
  // A fast shutdown cuts every connection: the pool's, the LISTEN connection, activities mid-query.
  await pg.stop();
  // The outage itself: three seconds with PostgreSQL down.
  await new Promise((r) => setTimeout(r, 3_000));
  pg = await startEmbeddedPostgres({ dataDir: path.join(tmp, 'pg'), database: 'restarts', port: pg.port });
  stripe.setLatency(0);
  await waitFor('every event sent', () => allSent(keys), 120_000, 250);
  expectBilledOnce(keys);
  // New usage after the restart is picked up too (the relay's LISTEN connection came back or it polls).
  const after = await enqueue(3, `pg-after-${randomUUID()}`);
  await waitFor('events after the restart', () => allSent(after), 60_000, 250);
  expectBilledOnce(after);
}, 240_000);

it('PostgreSQL away for longer than the whole delivery retry budget: nothing is dead-lettered, all delivered once', async () => {
  // A pipeline whose retry policy gives up after about half a second of failures.
  await pipeline.stop();
  const short = testConfig({
    TEMPORAL_ADDRESS: temporal.address,
    STRIPE_API_BASE: stripe.url,
    STRIPE_API_KEY: 'sk_test_restarts',
    RETRY_MAXIMUM_ATTEMPTS: '3',
    RETRY_INITIAL_INTERVAL_MS: '50',
    RETRY_MAXIMUM_INTERVAL_MS: '200',
  });
  pipeline = await startTestPipeline({ db, config: short });
  stripe.setLatency(300);
  const keys = await enqueue(12, `long-${randomUUID()}`);
  await waitFor('deliveries under way', async () => stripe.events().some((e) => e.identifier.includes('long-')), 30_000, 20);
  await pg.stop();
  // Ten times the retry budget.
  await new Promise((r) => setTimeout(r, 5_000));
  pg = await startEmbeddedPostgres({ dataDir: path.join(tmp, 'pg'), database: 'restarts', port: pg.port });
  stripe.setLatency(0);
  // A dead letter would stay dead (nobody retries it here): every row sent means none was.
  await waitFor('every event sent', () => allSent(keys), 120_000, 250);
  expectBilledOnce(keys);
}, 240_000);

it('Temporal restarted with events queued and in flight: all delivered once after it is back', async () => {
  stripe.setLatency(300);
  const keys = await enqueue(30, `tp-${randomUUID()}`);
  await waitFor('deliveries under way', async () => stripe.events().filter((e) => e.identifier.includes('tp-')).length >= 2, 30_000, 20);
  const port = Number(temporal.address.split(':')[1]);
  await temporal.stop();
  // The outage itself: three seconds with Temporal down.
  await new Promise((r) => setTimeout(r, 3_000));
  temporal = await startTemporalDevServer({ dbFile: path.join(tmp, 'temporal.db'), port });
  stripe.setLatency(0);
  await waitFor('every event sent', () => allSent(keys), 180_000, 500);
  expectBilledOnce(keys);
}, 300_000);
