/**
 * The (customer, meter) lease: Stripe allows one concurrent meter-event call per customer per meter
 * (v1), and this lease enforces it across every worker process on every machine. A row per (Stripe
 * customer, meter event name) in PostgreSQL, taken before the call and handed off after it. No
 * connection is held while waiting or calling, and a crashed holder's lease simply expires.
 *
 * Waiting is a hand-off, not polling: a delivery that finds the lease taken queues as a waiter
 * (`meter_lease_waiters`) and sleeps until the holder hands the lease off, which NOTIFYs the
 * lease's waiters on the schema's lease channel naming the new holder (and wakes waiters in the
 * same process at once). The oldest waiting delivery goes next: a delivery may take a free lease only when no older
 * delivery of the same lease is waiting. A waiter's place expires by itself if its worker dies.
 *
 * The holder is one execution of the delivery activity:
 * `<workflowId>/<runId>/<activity attempt>/<random UUID>` (see `leaseHolder`).
 *
 * Its SQL: src/outbox/sql/lease.ts.
 */
import { randomUUID } from 'node:crypto';
import type { DeliveryTimings } from '../config.js';
import type { Queryable } from '../db.js';
import type { OutboxNotifier } from '../outbox/notifier.js';
import { handOffLease, holdLease, renewLease, tryLease, type HandOff } from '../outbox/sql/lease.js';
import type { Schema } from '../outbox/sql/schema.js';

export { leaseId, type HandOff } from '../outbox/sql/lease.js';

/**
 * A new holder for one execution of the delivery activity, never reused: a later execution for
 * the same event (the regular activity after the first try in the workflow task, both attempt 1)
 * must not inherit, and so renew at once, the lease an unanswered call of an earlier one holds.
 */
export function leaseHolder(run: { workflowId: string; runId: string; attempt: number }): string {
  return `${run.workflowId}/${run.runId}/${run.attempt}/${randomUUID()}`;
}

/** What the waiting activity lends the lease: its cancellation, sleep and heartbeat. */
export interface WaitContext {
  cancellationSignal: AbortSignal;
  sleep(ms: number): Promise<void>;
  heartbeat(): void;
}

/**
 * `acquired`: the holder has the lease. `no_target`: the event or its customer mapping is missing
 * (the attempt then fails with the reason). `gave_up`: waited `leaseWaitMs`, or the worker is
 * shutting down; the workflow comes back after a short timer.
 */
export type LeaseWait = 'acquired' | 'no_target' | 'gave_up';

/** The lease as the delivery activity uses it (a fake in the activity's unit tests). */
export interface Lease {
  /** `maxWaitMs`: `leaseWaitMs` unless the attempt runs in the workflow task (`inTaskLeaseWaitMs`). */
  wait(key: string, holder: string, ctx: WaitContext, maxWaitMs?: number): Promise<LeaseWait>;
  /** Extends the holder's lease to `leaseMs` from now if it is still the holder's; false: it lapsed. */
  renew(holder: string): Promise<boolean>;
  /** After an attempt: hands the lease (or the holder's place in its queue) to the next waiter. */
  handOff(holder: string): Promise<void>;
  /** After a call that got no answer: keeps the lease `unansweredHoldMs`, handed to nobody. */
  hold(holder: string): Promise<void>;
  /** Hand-offs made by another statement (the row's own update): tells this process's waiters. */
  handedOff(handOffs: HandOff[]): void;
}

export type LeaseTimings = Pick<DeliveryTimings, 'leaseMs' | 'leaseWaitMs' | 'leasePollMs' | 'waiterTtlMs' | 'handOffMs' | 'unansweredHoldMs'>;

/** One worker's side of the leases: PostgreSQL for the truth, the notifier for the hand-offs. */
export class MeterLease implements Lease {
  private readonly db: Queryable;
  private readonly schema: Schema;
  private readonly timings: LeaseTimings;
  /** Wakes a waiting delivery when the holder hands the lease off (without it: polling). */
  private readonly notifier?: Pick<OutboxNotifier, 'mark' | 'wait' | 'handOff' | 'handedTo'>;
  /** Aborted when this worker is shutting down: waiting deliveries step aside at once. */
  private readonly stopping?: AbortSignal;
  constructor(
    db: Queryable,
    schema: Schema,
    timings: LeaseTimings,
    notifier?: Pick<OutboxNotifier, 'mark' | 'wait' | 'handOff' | 'handedTo'>,
    stopping?: AbortSignal,
  ) {
    this.db = db;
    this.schema = schema;
    this.timings = timings;
    this.notifier = notifier;
    this.stopping = stopping;
  }

  /**
   * Waits, inside the activity, for the lease of `key`'s customer and meter: woken by the holder's
   * hand-off (or every `leasePollMs`, to notice an expired lease), heartbeating. Gives up after
   * `leaseWaitMs`, or at once when the worker is shutting down, so that a waiting delivery neither
   * holds a shutting-down worker nor runs into its attempt timeout.
   */
  async wait(key: string, holder: string, ctx: WaitContext, maxWaitMs = this.timings.leaseWaitMs): Promise<LeaseWait> {
    const { db, schema, notifier, timings } = this;
    // On the monotonic clock: a wall clock stepped back would stretch the wait past the attempt's time.
    const until = performance.now() + maxWaitMs;
    const stop = this.stopping ? AbortSignal.any([ctx.cancellationSignal, this.stopping]) : ctx.cancellationSignal;
    const opts = { key, holder, leaseMs: timings.leaseMs, waitTtlMs: timings.waiterTtlMs };
    // The lease is known after the first try; from then on each try is preceded by the mark of the
    // wait that follows it, so a hand-off between the try and the wait still wakes the wait.
    let lease: string | undefined;
    let mark: number | undefined;
    for (;;) {
      // Takes the lease if it is free (and nobody older waits), or joins (refreshes our place in) its queue.
      const got = await tryLease(db, schema, opts);
      if (got.outcome !== 'busy') return got.outcome;
      if (lease === undefined) {
        lease = got.lease!;
        mark = notifier?.mark(lease);
        continue;
      }
      // Waits to be handed the lease by its holder (no query: the hand-off names us), at most until
      // our place needs refreshing or a lapsed lease may need taking.
      const pollAt = performance.now() + timings.leasePollMs;
      for (;;) {
        if (stop.aborted || performance.now() >= until) return 'gave_up';
        const left = Math.min(pollAt, until) - performance.now();
        if (left <= 0) break;
        if (notifier) await notifier.wait(left, stop, mark, lease);
        else await ctx.sleep(left);
        // Only a hand-off heard during this wait: one heard before it (handed to us, lapsed before
        // our attempt began, the lease another's since) would be taken for ours on every wake, each
        // a wasted attempt until the attempt's time ran out.
        if (notifier && mark !== undefined && notifier.handedTo(lease, mark) === holder) return 'acquired';
        mark = notifier?.mark(lease);
      }
      ctx.heartbeat();
    }
  }

  renew(holder: string): Promise<boolean> {
    return renewLease(this.db, this.schema, holder, this.timings.leaseMs);
  }

  async handOff(holder: string): Promise<void> {
    this.handedOff(await handOffLease(this.db, this.schema, holder, this.timings.handOffMs));
  }

  async hold(holder: string): Promise<void> {
    await holdLease(this.db, this.schema, holder, this.timings.unansweredHoldMs);
  }

  handedOff(handOffs: HandOff[]): void {
    for (const h of handOffs) this.notifier?.handOff(h.lease, h.nextHolder ?? undefined);
  }
}
