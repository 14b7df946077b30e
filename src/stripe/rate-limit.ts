/**
 * The account-wide rate limit on Stripe calls (Stripe: 1,000 calls/s live, 25 operations/s in
 * test mode), shared by every worker through PostgreSQL.
 *
 * Design: virtual scheduling (GCRA). A bucket's row holds the time of its next free slot. A caller
 * reserves `count` slots starting at `max(next_slot, now)`, one interval (1 s / rate) apart, and
 * moves `next_slot` past them, in one statement under the row lock; it then waits until its slot.
 * Work is spaced evenly, so a backlog drains at the limit instead of bursting into 429s.
 * With `maxWaitMs`, only slots within that horizon are granted, and a caller granted none is told
 * how long the queue is, so it can wait elsewhere (a workflow timer) without holding a worker slot.
 *
 * Two buckets (migrations/004): `stripe_calls` paces each meter-event call; `dispatch` paces the
 * relays, so that a backlog after an outage stays in the outbox instead of becoming thousands of
 * workflows all waiting for a call slot.
 *
 * Rejected: Temporal's `maxTaskQueueActivitiesPerSecond` on a dedicated task queue (measured here
 * with a 5,000-event backlog: bursts over the limit at the start of each window, 22 of 97 calls
 * refused by a 10/s Stripe with the limit set at 8/s); a token bucket per worker (N workers, N
 * times the rate).
 */
import type { Queryable } from '../db.js';

export type Bucket = 'stripe_calls' | 'dispatch';

export interface Reservation {
  /** Slots reserved (≤ count). */
  granted: number;
  /** Until the first slot: the caller's own wait when it asked for one slot. */
  waitMs: number;
  /** Until the end of the reserved span (the first slot after the granted ones). */
  spanEndMs: number;
}

export async function reserveSlots(
  db: Queryable,
  opts: { bucket: Bucket; count: number; perSecond: number; maxWaitMs?: number },
): Promise<Reservation> {
  const intervalUs = Math.max(1, Math.round(1_000_000 / opts.perSecond));
  const { rows } = await db.query<{ granted: number; wait_ms: number; span_end_ms: number }>({
    // Named: prepared once per connection, parsed and planned once, not on every event.
    name: 'billing-outbox/reserve-slots',
    text: `WITH cur AS (
       SELECT GREATEST(next_slot, clock_timestamp()) AS slot, clock_timestamp() AS now
         FROM rate_limits WHERE bucket = $1::text FOR UPDATE
     ), grant_ AS (
       SELECT slot, now,
              CASE WHEN $4::int IS NULL THEN $2::int
                   ELSE LEAST($2::int, GREATEST(0,
                          floor(extract(epoch FROM now + $4::int * interval '1 millisecond' - slot) * 1000000 / $3::int)::int + 1))
              END AS granted
         FROM cur
     ), moved AS (
       UPDATE rate_limits r SET next_slot = g.slot + g.granted * $3::int * interval '1 microsecond'
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

/**
 * One process's side of the shared limiter: the deliveries of a worker that want a call slot at
 * about the same moment are reserved together, in one statement (`count` = how many asked), and
 * each gets its own slot of the span, one interval apart. At most one reservation per bucket is in
 * flight per process; whoever asks meanwhile goes in the next. Without it every delivery queued on
 * the bucket's row lock: measured here, 7 ms per reservation at 60 events/s, most of it waiting.
 */
export class SlotPacer {
  private waiting: { resolve: (r: { granted: boolean; waitMs: number }) => void; reject: (e: unknown) => void }[] = [];
  private inFlight = false;

  constructor(
    private readonly db: Queryable,
    private readonly opts: { bucket: Bucket; perSecond: number; maxWaitMs: number },
  ) {}

  /** A slot for one call: granted with how long to wait for it, or not granted and how long the queue is. */
  take(): Promise<{ granted: boolean; waitMs: number }> {
    return new Promise((resolve, reject) => {
      this.waiting.push({ resolve, reject });
      if (!this.inFlight) void this.flush();
    });
  }

  /** Waits for a slot however long the queue is (a stream request, carrying many events, is not put off). */
  async waitForSlot(): Promise<void> {
    for (;;) {
      const slot = await this.take();
      const waitMs = slot.granted ? slot.waitMs : Math.min(slot.waitMs, this.opts.maxWaitMs);
      if (waitMs > 0) await new Promise((resolve) => setTimeout(resolve, waitMs));
      if (slot.granted) return;
    }
  }

  private async flush(): Promise<void> {
    this.inFlight = true;
    try {
      while (this.waiting.length > 0) {
        const batch = this.waiting.splice(0);
        const intervalMs = 1_000 / this.opts.perSecond;
        try {
          const r = await reserveSlots(this.db, { bucket: this.opts.bucket, count: batch.length, perSecond: this.opts.perSecond, maxWaitMs: this.opts.maxWaitMs });
          batch.forEach((w, i) => w.resolve(i < r.granted ? { granted: true, waitMs: r.waitMs + i * intervalMs } : { granted: false, waitMs: r.spanEndMs }));
        } catch (err) {
          for (const w of batch) w.reject(err);
        }
      }
    } finally {
      this.inFlight = false;
    }
  }
}
