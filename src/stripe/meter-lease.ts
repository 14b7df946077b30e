/**
 * Stripe allows one concurrent meter-event call per customer per meter. This lease enforces it
 * across every worker process on every machine: a row per (Stripe customer, meter event name) in
 * PostgreSQL, taken before the call and given back after it. No connection is held while waiting or
 * calling, and a crashed holder's lease simply expires.
 *
 * Waiting is a hand-off, not polling: a delivery that finds the lease taken queues in
 * `meter_lease_waiters` and sleeps until the holder gives the lease back, which NOTIFYs the pair's
 * waiters on LANE_CHANNEL (and wakes waiters in the same process at once). The oldest waiting
 * delivery goes next: a delivery may take a free lease only when no older delivery of the same pair
 * is waiting. A waiter's row expires by itself if its worker dies, so it never blocks the queue.
 *
 * The holder is one delivery attempt (`<workflowId>/<runId>/<attempt>`). Workflows started before
 * lanes took the lease themselves (a local activity) and pass it as `leaseHolder`.
 */
import type { Queryable } from '../db.js';

/** Channel of lease hand-offs; the payload is the pair's lane id (`laneId`). */
export const LANE_CHANNEL = 'billing_lane';

export type LeaseOutcome = 'acquired' | 'busy' | 'no_target';

/** What a delivery learns from trying to take its pair's lease. */
export interface TurnResult {
  outcome: LeaseOutcome;
  /** The pair as a notification payload, to wait for its hand-off; null with `no_target`. */
  lane: string | null;
}

/**
 * A (customer, meter) pair as a NOTIFY payload and a wait topic: the two joined by U+001F, which
 * neither can contain (event names are refused with control characters; customer ids are Stripe's).
 * The SQL below builds the same string.
 */
export function laneId(stripeCustomerId: string, eventName: string): string {
  return `${stripeCustomerId}\u001f${eventName}`;
}

/**
 * Takes (or renews) the lease of the customer and meter of the event `key` for `holder`, if it is
 * free, expired or already the holder's, and no older delivery of the pair is waiting for it.
 * Otherwise queues the delivery as waiting (for `waitTtlMs`, renewed by each try). `no_target`
 * when the event or its customer mapping does not exist (the delivery then fails with the reason).
 */
export async function takeTurn(
  db: Queryable,
  opts: { key: string; holder: string; leaseMs: number; waitTtlMs: number },
): Promise<TurnResult> {
  const { rows } = await db.query<{ customer: string | null; event_name: string | null; acquired: boolean }>({
    // Named: prepared once per connection, parsed and planned once, not on every event.
    name: 'billing-outbox/take-turn',
    text: `WITH target AS (
       SELECT o.id, c.stripe_customer_id, o.event_name
         FROM outbox o JOIN billing_customers c ON c.tenant_id = o.tenant_id
        WHERE o.idempotency_key = $1::text
     ), ahead AS (
       SELECT 1 FROM meter_lease_waiters w JOIN target t
           ON w.stripe_customer_id = t.stripe_customer_id AND w.event_name = t.event_name
        WHERE w.outbox_id < t.id AND w.expires_at > clock_timestamp() AND w.holder <> $2::text
        LIMIT 1
     ), taken AS (
       INSERT INTO meter_leases (stripe_customer_id, event_name, holder, expires_at)
       SELECT stripe_customer_id, event_name, $2::text, clock_timestamp() + $3::int * interval '1 millisecond'
         FROM target WHERE NOT EXISTS (SELECT 1 FROM ahead)
       ON CONFLICT (stripe_customer_id, event_name) DO UPDATE
         SET holder = EXCLUDED.holder, expires_at = EXCLUDED.expires_at
         WHERE meter_leases.expires_at < clock_timestamp() OR meter_leases.holder = EXCLUDED.holder
       RETURNING 1
     ), queued AS (
       INSERT INTO meter_lease_waiters (stripe_customer_id, event_name, outbox_id, holder, expires_at)
       SELECT stripe_customer_id, event_name, id, $2::text, clock_timestamp() + $4::int * interval '1 millisecond'
         FROM target WHERE NOT EXISTS (SELECT 1 FROM taken)
       ON CONFLICT (stripe_customer_id, event_name, outbox_id) DO UPDATE
         SET holder = EXCLUDED.holder, expires_at = EXCLUDED.expires_at
       RETURNING 1
     ), served AS (
       DELETE FROM meter_lease_waiters w USING target t
        WHERE EXISTS (SELECT 1 FROM taken)
          AND w.stripe_customer_id = t.stripe_customer_id AND w.event_name = t.event_name AND w.outbox_id = t.id
       RETURNING 1
     )
     SELECT t.stripe_customer_id AS customer, t.event_name, EXISTS (SELECT 1 FROM taken) AS acquired,
            -- Leases and places in the queue expire by themselves: losing one in a crash of
            -- PostgreSQL is harmless, so the commit does not wait for the WAL flush.
            set_config('synchronous_commit', 'off', true) AS async_commit
       FROM (SELECT 1) AS one LEFT JOIN target t ON true`,
    values: [opts.key, opts.holder, opts.leaseMs, opts.waitTtlMs],
  });
  const r = rows[0]!;
  if (r.customer === null || r.event_name === null) return { outcome: 'no_target', lane: null };
  return { outcome: r.acquired ? 'acquired' : 'busy', lane: laneId(r.customer, r.event_name) };
}

/**
 * Extends `holder`'s lease to `ms` from now, only if it still holds it unexpired: false means the
 * lease lapsed (and may be another delivery's by now), so no call may be made under it.
 */
export async function renewTurn(db: Queryable, holder: string, ms: number): Promise<boolean> {
  const { rowCount } = await db.query(
    `UPDATE meter_leases SET expires_at = clock_timestamp() + $2::int * interval '1 millisecond'
      WHERE holder = $1::text AND expires_at > clock_timestamp()`,
    [holder, ms],
  );
  return (rowCount ?? 0) > 0;
}

/**
 * Keeps `holder`'s lease for `ms` more and hands it to nobody: after a call whose outcome is
 * unknown (the client gave up waiting, the connection dropped), Stripe may still be processing it,
 * and a second call for the pair must not start meanwhile. The lease then lapses by itself, and
 * the waiting deliveries (which re-check every second) take it.
 */
export async function holdTurn(db: Queryable, holder: string, ms: number): Promise<void> {
  await db.query(
    `UPDATE meter_leases SET expires_at = greatest(expires_at, clock_timestamp() + $2::int * interval '1 millisecond')
      WHERE holder = $1::text`,
    [holder, ms],
  );
}

/** A pair given up: its lane id, and the waiting delivery that holds its lease now (null: none waited). */
export interface HandOff {
  lane: string;
  nextHolder: string | null;
}

/**
 * Gives back whatever lease `holder` has, handing each to the oldest delivery still waiting for it
 * (which then holds it for `handOffMs`, and extends it when it calls), and leaves any queue it
 * waits in; every pair's waiters are notified at commit (LANE_CHANNEL, payload: the lane id, U+001E,
 * the new holder). The statement is migrations/006's `meter_lease_hand_off`, shared with the end
 * of a successful delivery (markSentAndHandOff).
 */
export async function releaseTurn(db: Queryable, holder: string, handOffMs: number): Promise<HandOff[]> {
  const { rows } = await db.query<{ lane: string; next_holder: string | null }>({
    // Named: prepared once per connection, parsed and planned once, not on every event.
    name: 'billing-outbox/release-turn',
    text: `SELECT h.lane, h.next_holder, set_config('synchronous_commit', 'off', true)
             FROM meter_lease_hand_off($1::text, $2::int, $3::text) h`,
    values: [holder, handOffMs, LANE_CHANNEL],
  });
  return rows.map((r) => ({ lane: r.lane, nextHolder: r.next_holder }));
}
