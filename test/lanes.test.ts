/**
 * Lanes on the real pipeline: a hot (tenant, meter) waits in PostgreSQL, not as workflows, while
 * other lanes flow; within a lane the oldest go first; one call at a time per customer and meter.
 */
import { afterAll, beforeAll, expect, it } from 'vitest';
import type { Config } from '../src/config.js';
import { LocalStripe } from '../src/embedded/stripe/server.js';
import { createTestDb, startTestPipeline, testConfig, waitFor, type TestDb, type TestPipeline } from './helpers.js';
import { enqueueBacklog, seedCustomers } from './hooks.js';

let db: TestDb;
let stripe: LocalStripe;
let config: Config;
let pipeline: TestPipeline;
const LANE_MAX = 2;

beforeAll(async () => {
  db = await createTestDb();
  stripe = await LocalStripe.start({ meters: ['api_requests'], customers: ['cus_hot', 'cus_cold'] });
  // Every call takes a while: if the lane let more than one call through, Stripe would see it.
  stripe.setLatency(40);
  await seedCustomers(db.pool, { hot: 'cus_hot', cold: 'cus_cold' });
  config = testConfig({
    STRIPE_API_BASE: stripe.url,
    STRIPE_API_KEY: 'sk_test_lanes',
    STRIPE_RATE_LIMIT_PER_SECOND: '1000',
    LANE_MAX_IN_FLIGHT: String(LANE_MAX),
    RELAY_COUNT: '2',
  });
  pipeline = await startTestPipeline({ db, config });
});

afterAll(async () => {
  await pipeline?.stop();
  await stripe?.close();
  await db?.drop();
});

/** Commits `n` usages of one tenant at once, as after an outage; returns their keys in commit order. */
const backlog = (tenant: string, n: number): Promise<string[]> => enqueueBacklog(db.pool, tenant, n);

it('keeps a hot lane to LANE_MAX_IN_FLIGHT, lets another lane through, and drains the hot one oldest first', async () => {
  const hot = await backlog('hot', 60);
  // Sample what the hot lane has handed to Temporal while it drains.
  let maxInFlight = 0;
  let sampling = true;
  const sampler = (async () => {
    while (sampling) {
      const { rows } = await db.pool.query<{ n: number }>(
        `SELECT count(*)::int AS n FROM outbox WHERE tenant_id = 'hot' AND status IN ('claimed', 'dispatched')`,
      );
      maxInFlight = Math.max(maxInFlight, rows[0]!.n);
      // Sampling interval of the in-flight count.
      await new Promise((r) => setTimeout(r, 20));
    }
  })();

  // The cold lane's single event, committed behind the hot backlog, does not wait for it.
  await waitFor('the hot lane to start', async () => stripe.events().some((e) => hot.includes(e.identifier)));
  const [cold] = await backlog('cold', 1);
  await waitFor('the cold event', async () => stripe.events().some((e) => e.identifier === cold));
  const hotSentBeforeCold = stripe.events().filter((e) => hot.includes(e.identifier)).length;
  expect(hotSentBeforeCold).toBeLessThan(hot.length);

  await waitFor('the hot lane to drain', async () => stripe.events().filter((e) => hot.includes(e.identifier)).length === hot.length, 60_000);
  sampling = false;
  await sampler;

  expect(maxInFlight).toBeGreaterThan(0);
  expect(maxInFlight).toBeLessThanOrEqual(LANE_MAX);
  expect(stripe.maxConcurrencySeen('cus_hot', 'api_requests')).toBe(1);
  expect(stripe.requests().filter((r) => r.status === 429)).toEqual([]);
  // Oldest first: claimed in commit order, at most LANE_MAX in flight, and those take the lane's one
  // call in no fixed order (whoever gets the lease; an event may lose that race a few times in a
  // row): every event reaches Stripe within a few lane-widths of its place in the backlog.
  const order = stripe.events().filter((e) => hot.includes(e.identifier)).map((e) => hot.indexOf(e.identifier));
  expect(new Set(order).size).toBe(hot.length);
  for (const [i, rank] of order.entries()) expect(Math.abs(rank - i), `event ${rank} sent ${i}th`).toBeLessThanOrEqual(4 * LANE_MAX);
}, 90_000);

it('keeps a (customer, meter) closed after a call that got no answer: no second call while Stripe may still be on the first', async () => {
  // Stripe answers after 1.5 s; the client gives up after 0.5 s, while Stripe is still at work.
  const slow = await LocalStripe.start({ meters: ['api_requests'], customers: ['cus_slow'] });
  slow.setLatency(1_500);
  await db.pool.query(`INSERT INTO billing_customers VALUES ('slow', 'cus_slow') ON CONFLICT DO NOTHING`);
  const slowConfig = testConfig({
    STRIPE_API_BASE: slow.url,
    STRIPE_API_KEY: 'sk_test_lanes',
    STRIPE_TIMEOUT_MS: '500',
    STRIPE_UNANSWERED_HOLD_MS: '2000',
    RETRY_MAXIMUM_ATTEMPTS: '20',
  });
  await pipeline.stop();
  pipeline = await startTestPipeline({ db, config: slowConfig });
  try {
    const keys = await backlog('slow', 3);
    // Every call goes unanswered at first; the events still arrive (Stripe had them: duplicates).
    await new Promise((r) => setTimeout(r, 6_000));
    slow.setLatency(0);
    await waitFor('all three sent', async () => {
      const { rows } = await db.pool.query<{ n: number }>(`SELECT count(*)::int AS n FROM outbox WHERE idempotency_key = ANY($1) AND status = 'sent'`, [keys]);
      return rows[0]!.n === 3;
    }, 60_000);
    // Stripe never saw two calls for the pair at once, nor had to refuse one as concurrent.
    expect(slow.maxConcurrencySeen('cus_slow', 'api_requests')).toBe(1);
    expect(slow.requests().filter((r) => r.status === 429)).toEqual([]);
    for (const key of keys) expect(slow.events().filter((e) => e.identifier === key)).toHaveLength(1);
  } finally {
    await slow.close();
  }
}, 120_000);

it("an event's next try after an unanswered first try waits out the hold: the first try's lease is not its own", async () => {
  // One event alone in its lane, so nothing else orders the turns. Its first try (a local activity
  // in the workflow task) gets no answer in time; the next (a regular activity, also attempt 1)
  // comes 50 ms later (RETRY_INITIAL_INTERVAL_MS) while Stripe is still on the first call.
  const slow = await LocalStripe.start({ meters: ['api_requests'], customers: ['cus_alone'] });
  slow.setLatency(1_500);
  await db.pool.query(`INSERT INTO billing_customers VALUES ('alone', 'cus_alone') ON CONFLICT DO NOTHING`);
  await pipeline.stop();
  pipeline = await startTestPipeline({
    db,
    config: testConfig({ STRIPE_API_BASE: slow.url, STRIPE_API_KEY: 'sk_test_lanes', STRIPE_TIMEOUT_MS: '500', STRIPE_UNANSWERED_HOLD_MS: '2000', RETRY_MAXIMUM_ATTEMPTS: '20' }),
  });
  try {
    const [key] = await backlog('alone', 1);
    await waitFor('the first call to go unanswered', async () => slow.requests().some((r) => r.identifier === key), 30_000, 20);
    slow.setLatency(0);
    await waitFor('the event sent', async () => (await db.pool.query(`SELECT 1 FROM outbox WHERE idempotency_key = $1 AND status = 'sent'`, [key])).rowCount === 1, 60_000);
    expect(slow.maxConcurrencySeen('cus_alone', 'api_requests')).toBe(1);
    expect(slow.requests().filter((r) => r.status === 429)).toEqual([]);
    expect(slow.events().filter((e) => e.identifier === key)).toHaveLength(1);
  } finally {
    await slow.close();
  }
}, 120_000);

it("gives a worker's regular activities as many slots as its deliveries: the tries waiting for one customer's lease, which many tenants may share (4 each in flight), leave slots for the relays and the other tenants' retries", () => {
  const tuner = pipeline.workers[0]!.worker.options.tuner as unknown as Record<string, { type: string; numSlots: number }>;
  expect(tuner.activityTaskSlotSupplier).toEqual({ type: 'fixed-size', numSlots: config.worker.maxConcurrentDeliveries });
  expect(config.worker.maxConcurrentDeliveries).toBeGreaterThan(100);
});
