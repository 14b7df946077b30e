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
 * Its statement: src/outbox/sql/pace.ts. Two buckets (migrations/001_schema.sql): `stripe_calls` paces each
 * meter-event call (and each v2 stream request); `dispatch` paces the relays, so that a backlog after an outage stays in the outbox instead of becoming thousands of
 * workflows all waiting for a call slot.
 *
 * Rejected: Temporal's `maxTaskQueueActivitiesPerSecond` on a dedicated task queue (measured here
 * with a 5,000-event backlog: bursts over the limit at the start of each window, 22 of 97 calls
 * refused by a 10/s Stripe with the limit set at 8/s); a token bucket per worker (N workers, N
 * times the rate).
 */
import type { Queryable } from '../db.js';
import { reserveSlots, type Bucket } from '../outbox/sql/pace.js';
import type { Schema } from '../outbox/sql/schema.js';

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

  private readonly db: Queryable;
  private readonly schema: Schema;
  private readonly opts: { bucket: Bucket; perSecond: number; maxWaitMs: number };
  constructor(
    db: Queryable,
    schema: Schema,
    opts: { bucket: Bucket; perSecond: number; maxWaitMs: number },
  ) {
    this.db = db;
    this.schema = schema;
    this.opts = opts;
  }

  /** A slot for one call: granted with how long to wait for it, or not granted and how long the queue is. */
  take(): Promise<{ granted: boolean; waitMs: number }> {
    return new Promise((resolve, reject) => {
      this.waiting.push({ resolve, reject });
      if (!this.inFlight) void this.flush();
    });
  }

  /**
   * A call whose database work ran late (a stalled query, a starved process) would reach Stripe
   * bunched with others that were late too: a burst over the account limit although every slot was
   * paced. Past `toleranceMs` (at least one interval) late, it takes a new place in the pace instead
   * and waits for it. A little lateness bunches a few calls, well within the headroom under Stripe's limit.
   * `slotAt` is on the monotonic clock (`performance.now()`).
   */
  async keepPace(slotAt: number, toleranceMs: number, sleep: (ms: number) => Promise<void>): Promise<void> {
    if (performance.now() - slotAt <= Math.max(1_000 / this.opts.perSecond, toleranceMs)) return;
    const again = await reserveSlots(this.db, this.schema, { bucket: this.opts.bucket, count: 1, perSecond: this.opts.perSecond });
    if (again.waitMs > 0) await sleep(again.waitMs);
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
          const r = await reserveSlots(this.db, this.schema, { bucket: this.opts.bucket, count: batch.length, perSecond: this.opts.perSecond, maxWaitMs: this.opts.maxWaitMs });
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
