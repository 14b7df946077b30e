/**
 * STRIPE_METER_API=v2 against a Stripe whose sessions are short and whose clock is far from the
 * workers': the case where each worker used to replace every session on arrival, forever (two
 * workers, 45-second sessions: 362,747 session requests in six minutes, nothing delivered).
 */
import { randomUUID } from 'node:crypto';
import { Registry } from 'prom-client';
import { afterAll, beforeAll, expect, it } from 'vitest';
import { LocalStripe } from '../src/embedded/stripe/server.js';
import { createMetrics, type Metrics } from '../src/metrics.js';
import { createTestDb, startTestPipeline, testConfig, waitFor, type TestDb, type TestPipeline } from './helpers.js';

const SKEW_MS = 14 * 60_000;

let db: TestDb;
let stripe: LocalStripe;
let pipeline: TestPipeline;
let metrics: Metrics;

beforeAll(async () => {
  db = await createTestDb();
  // Stripe's clock 14 minutes behind the workers', and sessions of 45 seconds.
  stripe = await LocalStripe.start({ meters: ['api_requests'], customers: ['cus_one'], now: () => Date.now() - SKEW_MS, sessionLifetimeMs: 45_000 });
  await db.pool.query(`INSERT INTO billing_customers VALUES ('one', 'cus_one')`);
  metrics = createMetrics(new Registry());
  const config = testConfig({
    STRIPE_API_BASE: stripe.url,
    STRIPE_API_KEY: 'sk_test_stream_sessions',
    STRIPE_METER_API: 'v2',
    STRIPE_RATE_LIMIT_PER_SECOND: '50',
    RELAY_BATCH_SIZE: '500',
  });
  pipeline = await startTestPipeline({ db, config, metrics });
});

afterAll(async () => {
  await pipeline?.stop();
  await stripe?.close();
  await db?.drop();
});

it('45-second sessions, a Stripe clock 14 minutes behind: delivered with a handful of session requests, the skew on the gauge', async () => {
  const prefix = `s-${randomUUID().slice(0, 8)}-`;
  // Stamped well inside Stripe's window by its own clock too.
  const { rows } = await db.pool.query<{ idempotency_key: string }>(
    `INSERT INTO outbox (tenant_id, usage_id, event_name, quantity, occurred_at, idempotency_key)
     SELECT 'one', $1 || g, 'api_requests', 1, now() - interval '30 minutes', 'u:one:' || $1 || g FROM generate_series(1, 200) g
     RETURNING idempotency_key`,
    [prefix],
  );
  const keys = rows.map((r) => r.idempotency_key);

  await waitFor(
    'every event accepted',
    async () => {
      const { rows: done } = await db.pool.query<{ n: number }>(`SELECT count(*)::int AS n FROM outbox WHERE idempotency_key = ANY($1) AND status = 'accepted'`, [keys]);
      return done[0]!.n === keys.length;
    },
    60_000,
  );
  stripe.flushStream();
  expect(new Set(stripe.events().map((e) => e.identifier))).toEqual(new Set(keys));
  // One session, and one more if the run outlived three quarters of one (33.75 s).
  expect(stripe.sessionsIssued()).toBeLessThanOrEqual(2);
  expect(stripe.streamRequests().every((r) => r.status === 200)).toBe(true);
  const skew = (await metrics.stripeClockSkew.get()).values[0]?.value;
  expect(Math.abs(skew! + SKEW_MS / 1000)).toBeLessThan(5);
}, 90_000);
