/**
 * The statement of the account-wide pace (src/stripe/rate-limit.ts, GCRA: a bucket's row holds the
 * time of its next free slot), run by the delivery's pacer (bucket `stripe_calls`, per call or per
 * v2 request) and by the relay (bucket `dispatch`, per claimed batch).
 * One named function per statement; values always travel as typed parameters, never as SQL text.
 */
import type { Queryable } from '../../db.js';
import type { Schema } from './schema.js';

/** The buckets migrations/001_schema.sql creates: `stripe_calls` paces Stripe calls, `dispatch` paces the relays. */
export type Bucket = 'stripe_calls' | 'dispatch';

export interface Reservation {
  /** Slots reserved (≤ count). */
  granted: number;
  /** Until the first slot: the caller's own wait when it asked for one slot. */
  waitMs: number;
  /** Until the end of the reserved span (the first slot after the granted ones). */
  spanEndMs: number;
}

/**
 * Reserves `count` slots of `bucket`, one interval (1 s / perSecond) apart, from its next free
 * slot; with `maxWaitMs`, only the slots within that horizon.
 */
export async function reserveSlots(
  db: Queryable,
  schema: Schema,
  opts: { bucket: Bucket; count: number; perSecond: number; maxWaitMs?: number },
): Promise<Reservation> {
  const intervalUs = Math.max(1, Math.round(1_000_000 / opts.perSecond));
  const { rows } = await db.query<{ granted: number; wait_ms: number; span_end_ms: number }>({
    // Named: prepared once per connection, parsed and planned once, not on every event.
    name: schema.statementName('reserve-slots'),
    // A next_slot written on a clock since stepped back keeps only the queue it had then
    // (next_slot − written_at), from now: otherwise every reservation of every tenant would wait the step out.
    text: `WITH cur AS (
       SELECT GREATEST(next_slot - GREATEST(written_at - clock_timestamp(), interval '0'), clock_timestamp()) AS slot, clock_timestamp() AS now
         FROM ${schema.rateLimits} WHERE bucket = $1::text FOR UPDATE
     ), grant_ AS (
       SELECT slot, now,
              CASE WHEN $4::int IS NULL THEN $2::int
                   ELSE LEAST($2::int, GREATEST(0,
                          floor(extract(epoch FROM now + $4::int * interval '1 millisecond' - slot) * 1000000 / $3::int)::int + 1))
              END AS granted
         FROM cur
     ), moved AS (
       UPDATE ${schema.rateLimits} r SET next_slot = g.slot + g.granted * $3::int * interval '1 microsecond', written_at = g.now
         FROM grant_ g WHERE r.bucket = $1::text
       RETURNING r.next_slot
     )
     SELECT g.granted,
            -- Commits without waiting for the WAL flush: a reservation lost in a crash of
            -- PostgreSQL costs a slot, nothing more, and the row lock is held that much shorter
            -- (every reservation queues on it).
            set_config('synchronous_commit', 'off', true) AS async_commit,
            GREATEST(0, extract(epoch FROM g.slot - g.now) * 1000)::float8 AS wait_ms,
            GREATEST(0, extract(epoch FROM (SELECT next_slot FROM moved) - g.now) * 1000)::float8 AS span_end_ms
       FROM grant_ g`,
    values: [opts.bucket, opts.count, intervalUs, opts.maxWaitMs ?? null],
  });
  const r = rows[0];
  if (!r) throw new Error(`rate limit bucket ${opts.bucket} is missing: run the migrations`);
  return { granted: r.granted, waitMs: Math.ceil(r.wait_ms), spanEndMs: Math.ceil(r.span_end_ms) };
}

