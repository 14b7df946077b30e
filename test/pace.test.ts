/**
 * The account rate limiter's reservation (reserveSlots) under concurrency: reservations from several
 * connections at once each get a slot of their own. Without the row lock on the read, two
 * reservations read the same next_slot and both take it, and the account limit is exceeded.
 */
import { afterAll, beforeAll, expect, it } from 'vitest';
import type pg from 'pg';
import { createPool } from '../src/db.js';
import { reserveSlots } from '../src/outbox/sql/pace.js';
import { useDatabase, waitFor } from './hooks.js';

const t = useDatabase();
let pool: pg.Pool;
// A pool of its own (the product's, default search_path): eight racers and the holder, each on a connection.
beforeAll(() => void (pool = createPool(t.db.url, 12)));
afterAll(() => pool?.end());

it('gives concurrent reservations from eight connections eight distinct slots', async () => {
  const perSecond = 10; // one slot every 100 ms
  const racers = 8;
  // Far enough ahead that clock_timestamp() never overtakes it during the test.
  const start = (await t.pool.query<{ t: Date }>(`UPDATE rate_limits SET next_slot = now() + interval '60 seconds' WHERE bucket = 'dispatch' RETURNING next_slot AS t`)).rows[0]!.t;

  // Hold the bucket's row until every racer is waiting, so that all of them start from the same
  // committed state: the moment at which a read without the row lock would see a stale slot.
  const holder = await pool.connect();
  await holder.query('BEGIN');
  await holder.query(`SELECT 1 FROM ${t.schema.rateLimits} WHERE bucket = 'dispatch' FOR UPDATE`);
  const reservations = Array.from({ length: racers }, () => reserveSlots(pool, t.schema, { bucket: 'dispatch', count: 1, perSecond }));
  await waitFor(
    'every racer blocked on the bucket row',
    async () => {
      const { rows } = await pool.query<{ n: number }>(
        `SELECT count(*)::int AS n FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%rate_limits%'`,
      );
      return rows[0]!.n === racers;
    },
    10_000,
    20,
  );
  await holder.query('COMMIT');
  holder.release();
  const granted = await Promise.all(reservations);

  expect(granted.map((r) => r.granted)).toEqual(Array(racers).fill(1));
  const end = (await t.pool.query<{ t: Date }>(`SELECT next_slot AS t FROM rate_limits WHERE bucket = 'dispatch'`)).rows[0]!.t;
  // Eight slots taken, one interval each: the bucket moved on by exactly eight intervals.
  expect(end.getTime() - start.getTime()).toBe(racers * 100);
});

it("PostgreSQL's clock stepped back two hours: the queue the bucket held is kept, not the step (every tenant's calls would wait it out)", async () => {
  // As written while the clock was two hours ahead: a queue of 300 ms then.
  await t.pool.query(
    `UPDATE rate_limits SET written_at = now() + interval '2 hours', next_slot = now() + interval '2 hours' + interval '300 milliseconds' WHERE bucket = 'stripe_calls'`,
  );
  const first = await reserveSlots(pool, t.schema, { bucket: 'stripe_calls', count: 1, perSecond: 10, maxWaitMs: 1_000 });
  expect(first.granted).toBe(1);
  expect(first.waitMs).toBeGreaterThan(200);
  expect(first.waitMs).toBeLessThanOrEqual(300);
  // Written again on today's clock: the next one queues behind it, one interval later.
  const next = await reserveSlots(pool, t.schema, { bucket: 'stripe_calls', count: 1, perSecond: 10, maxWaitMs: 1_000 });
  expect(next.granted).toBe(1);
  expect(next.waitMs).toBeGreaterThan(first.waitMs);
  expect(next.waitMs).toBeLessThanOrEqual(first.waitMs + 100);
});
