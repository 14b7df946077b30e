/**
 * STRIPE_METER_API=v2 on a worker whose clock is 70 minutes behind Stripe's and the recording
 * machine's: the stream's correction by Stripe's clock has to be measured before the first event is
 * judged. Judged on the worker's own clock, each event looked more than an hour ahead and was dead
 * at once as `timestamp_in_future`, no session was ever opened, and so the skew was never measured.
 */
import { randomUUID } from 'node:crypto';
import { Registry } from 'prom-client';
import { afterAll, beforeAll, expect, it } from 'vitest';
import { LocalStripe } from '../src/embedded/stripe/server.js';
import { createMetrics, type Metrics } from '../src/metrics.js';
import { createTestDb, startTestPipeline, testConfig, waitFor, type TestDb, type TestPipeline } from './helpers.js';

const BEHIND_MS = 70 * 60_000;

let db: TestDb;
let stripe: LocalStripe;
let pipeline: TestPipeline;
let metrics: Metrics;

beforeAll(async () => {
  db = await createTestDb();
  stripe = await LocalStripe.start({ meters: ['api_requests'], customers: ['cus_one'], now: () => Date.now() + BEHIND_MS });
  await db.pool.query(`INSERT INTO billing_customers VALUES ('one', 'cus_one')`);
  metrics = createMetrics(new Registry());
  const config = testConfig({ STRIPE_API_BASE: stripe.url, STRIPE_API_KEY: 'sk_test_stream_clock', STRIPE_METER_API: 'v2' });
  pipeline = await startTestPipeline({ db, config, metrics });
});

afterAll(async () => {
  await pipeline?.stop();
  await stripe?.close();
  await db?.drop();
});

it("a worker 70 minutes behind Stripe: events stamped by Stripe's clock are judged by it from the first, and accepted", async () => {
  const prefix = `c-${randomUUID().slice(0, 8)}-`;
  // Stamped a minute ago by a recording machine whose clock agrees with Stripe's: 69 minutes ahead of the worker's.
  const { rows } = await db.pool.query<{ idempotency_key: string }>(
    `INSERT INTO outbox (tenant_id, usage_id, event_name, quantity, occurred_at, idempotency_key)
     SELECT 'one', $1 || g, 'api_requests', 1, now() + interval '69 minutes', 'u:one:' || $1 || g FROM generate_series(1, 20) g
     RETURNING idempotency_key`,
    [prefix],
  );
  const keys = rows.map((r) => r.idempotency_key);

  await waitFor(
    'every event accepted',
    async () => {
      const { rows: done } = await db.pool.query<{ n: number; dead: number }>(
        `SELECT count(*) FILTER (WHERE status = 'accepted')::int AS n, count(*) FILTER (WHERE status = 'dead')::int AS dead FROM outbox WHERE idempotency_key = ANY($1)`,
        [keys],
      );
      if (done[0]!.dead > 0) throw new Error(`${done[0]!.dead} dead: judged on the worker's own clock`);
      return done[0]!.n === keys.length;
    },
    30_000,
  );
  // Stripe's later validation, by its own clock, takes them all.
  await stripe.flushAsyncErrors();
  expect(new Set(stripe.events().map((e) => e.identifier))).toEqual(new Set(keys));
  expect(stripe.snapshot().errorReports).toEqual([]);
  const skew = (await metrics.stripeClockSkew.get()).values[0]?.value;
  expect(Math.abs(skew! - BEHIND_MS / 1000)).toBeLessThan(5);
}, 60_000);
