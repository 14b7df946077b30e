/**
 * STRIPE_METER_API=v2 on the real pipeline: events go out in batches on the meter event stream,
 * end `accepted` (Stripe validates them later), once each, a lane held to the stream's default
 * limit (a whole request's worth in flight, not v1's one call's), a
 * session that expires is replaced without losing an event, and one event that makes every request
 * it is in fail does not take its batch-mates with it.
 */
import { randomUUID } from 'node:crypto';
import { beforeAll, expect, it } from 'vitest';
import { CALL_LANE_MAX_IN_FLIGHT, STREAM_LANE_MAX_IN_FLIGHT } from '../src/config.js';
import { idempotencyKeyFor } from '../src/outbox/keys.js';
import { usePipeline, waitFor } from './hooks.js';

const t = usePipeline({
  customers: { one: 'cus_one', two: 'cus_two' },
  stripe: { meters: ['api_requests'] },
  env: {
    STRIPE_METER_API: 'v2',
    STRIPE_RATE_LIMIT_PER_SECOND: '50',
    RELAY_BATCH_SIZE: '500',
  },
});
const { backlog } = t;

beforeAll(() => t.stripe.setLatency(20));

const recorded = (keys: string[]) => {
  t.stripe.flushStream();
  return t.stripe.events().filter((e) => keys.includes(e.identifier));
};

it('delivers a hot customer through the stream in batches: accepted, once each, within the stream\'s lane limit and past v1\'s', async () => {
  const keys = await backlog('one', 300);
  let maxInFlight = 0;
  await waitFor(
    'every event accepted',
    async () => {
      const { rows } = await t.pool.query<{ status: string; n: number }>(
        `SELECT status, count(*)::int AS n FROM outbox WHERE idempotency_key = ANY($1) GROUP BY status`,
        [keys],
      );
      const by = Object.fromEntries(rows.map((r) => [r.status, r.n]));
      maxInFlight = Math.max(maxInFlight, (by.claimed ?? 0) + (by.dispatched ?? 0));
      return by.accepted === keys.length;
    },
    60_000,
    50,
  );
  const events = recorded(keys);
  expect(events).toHaveLength(keys.length);
  expect(new Set(events.map((e) => e.identifier)).size).toBe(keys.length);
  // Each event under its own value, the customer the tenant is billed as.
  expect(events.every((e) => e.customer === 'cus_one')).toBe(true);
  expect(events.reduce((s, e) => s + e.value, 0)).toBe((300 * 301) / 2);
  // One customer's events in flight: more than v1's lane allows (one Stripe call's worth), never
  // more than the stream's (the rest of the backlog waited in the outbox).
  expect(maxInFlight).toBeGreaterThan(CALL_LANE_MAX_IN_FLIGHT);
  expect(maxInFlight).toBeLessThanOrEqual(STREAM_LANE_MAX_IN_FLIGHT);
  // Batched: far fewer requests than events.
  const requests = t.stripe.streamRequests().filter((r) => r.status === 200);
  expect(requests.length).toBeLessThan(keys.length / 3);
  expect(Math.max(...requests.map((r) => r.eventCount))).toBeLessThanOrEqual(100);
}, 90_000);

it('replaces a session that Stripe says has expired, and loses nothing', async () => {
  // Stripe's clock runs 16 minutes ahead: the worker's session is over there.
  t.stripe.advanceClock(16 * 60_000);
  const keys = await backlog('two', 40);
  await waitFor('every event accepted', async () => {
    const { rows } = await t.pool.query<{ n: number }>(`SELECT count(*)::int AS n FROM outbox WHERE idempotency_key = ANY($1) AND status = 'accepted'`, [keys]);
    return rows[0]!.n === keys.length;
  }, 60_000);
  expect(recorded(keys)).toHaveLength(keys.length);
  expect(t.stripe.streamRequests().some((r) => r.status === 401)).toBe(true);
}, 90_000);

it('one event that makes every stream request it is in fail (500): the others are accepted, it dies alone with its own reason', async () => {
  const prefix = `one-${randomUUID().slice(0, 8)}-`;
  const poison = idempotencyKeyFor('one', `${prefix}11`);
  t.stripe.failStreamRequestsWith(poison, 500);
  try {
    const keys = await backlog('one', 21, { prefix });
    expect(keys).toContain(poison);
    const rows = await waitFor(
      'the 20 accepted and the poison dead',
      async () => {
        const { rows } = await t.pool.query<{ idempotency_key: string; status: string; attempt_count: number; last_error_code: string | null }>(
          `SELECT idempotency_key, status, attempt_count, last_error_code FROM outbox WHERE idempotency_key = ANY($1)`,
          [keys],
        );
        const settled = rows.every((r) => r.status === 'accepted' || r.status === 'dead');
        return settled && rows.length === keys.length ? rows : undefined;
      },
      60_000,
    );
    const others = rows.filter((r) => r.idempotency_key !== poison);
    expect(others.map((r) => r.status)).toEqual(Array(20).fill('accepted'));
    expect(recorded(keys.filter((k) => k !== poison))).toHaveLength(20);
    // Its own reason and its own retry schedule: every attempt spent on it, the 500 on the row.
    expect(rows.find((r) => r.idempotency_key === poison)).toMatchObject({ status: 'dead', attempt_count: t.config.retry.maximumAttempts, last_error_code: 'http_500' });
    expect(recorded([poison])).toEqual([]);
    // Every request that carried it failed; the others went through in requests without it.
    const carrying = t.stripe.streamRequests().filter((r) => r.identifiers.includes(poison));
    expect(carrying.length).toBeGreaterThanOrEqual(t.config.retry.maximumAttempts);
    expect(carrying.every((r) => r.status === 500)).toBe(true);
  } finally {
    t.stripe.heal();
  }
}, 90_000);
