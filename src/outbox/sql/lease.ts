/**
 * The statements of the (customer, meter) lease (src/stripe/meter-lease.ts), run by the delivery
 * activity around each v1 call: take it or queue for it, renew it, hold it after an unanswered
 * call, hand it to the next waiting delivery. The delivery's own end (markSentAndHandOff in
 * ./delivery.ts) hands it on in the same statement that marks the row sent.
 * One named function per statement; values always travel as typed parameters, never as SQL text.
 */
import type { Queryable } from '../../db.js';
import type { Schema } from './schema.js';
import { attemptCustomer } from './customers.js';

/**
 * A lease as a NOTIFY payload and a wait topic: the Stripe customer and the meter event name joined
 * by U+001F, which neither can contain (event names are refused with control characters; customer
 * ids are Stripe's). The schema's `meter_lease_hand_off` builds the same string.
 */
export function leaseId(stripeCustomerId: string, eventName: string): string {
  return `${stripeCustomerId}\u001f${eventName}`;
}

/** What a delivery learns from trying to take the lease of its event's customer and meter. */
export interface LeaseTry {
  /** `no_target`: the event or its tenant's customer mapping does not exist. */
  outcome: 'acquired' | 'busy' | 'no_target';
  /** The lease's id (`leaseId`), to wait for its hand-off; null with `no_target`. */
  lease: string | null;
}

/** A lease given up: its id, and the waiting delivery that holds it now (null: none waited). */
export interface HandOff {
  lease: string;
  nextHolder: string | null;
}

/**
 * Takes (or renews) the lease of the customer and meter of the event `key` for `holder`, if it is
 * free, expired or already the holder's, and no older delivery of the same lease is waiting for it.
 * Otherwise queues the delivery as a waiter (for `waitTtlMs`, renewed by each try).
 */
export async function tryLease(
  db: Queryable,
  schema: Schema,
  opts: { key: string; holder: string; leaseMs: number; waitTtlMs: number },
): Promise<LeaseTry> {
  const { rows } = await db.query<{ customer: string | null; event_name: string | null; acquired: boolean }>({
    // Named: prepared once per connection, parsed and planned once, not on every event.
    name: schema.statementName('try-lease'),
    text: `WITH target AS (
       SELECT * FROM (
         SELECT o.id, ${attemptCustomer(schema, 'o')} AS stripe_customer_id, o.event_name
           FROM ${schema.outbox} o WHERE o.idempotency_key = $1::text) r
        WHERE r.stripe_customer_id IS NOT NULL
     ), ahead AS (
       SELECT 1 FROM ${schema.meterLeaseWaiters} w JOIN target t
           ON w.stripe_customer_id = t.stripe_customer_id AND w.event_name = t.event_name
        WHERE w.outbox_id < t.id AND w.expires_at > clock_timestamp() AND w.holder <> $2::text
        LIMIT 1
     ), taken AS (
       INSERT INTO ${schema.meterLeases} (stripe_customer_id, event_name, holder, expires_at)
       SELECT stripe_customer_id, event_name, $2::text, clock_timestamp() + $3::int * interval '1 millisecond'
         FROM target WHERE NOT EXISTS (SELECT 1 FROM ahead)
       ON CONFLICT (stripe_customer_id, event_name) DO UPDATE
         SET holder = EXCLUDED.holder, expires_at = EXCLUDED.expires_at
         WHERE meter_leases.expires_at < clock_timestamp() OR meter_leases.holder = EXCLUDED.holder
       RETURNING 1
     ), queued AS (
       INSERT INTO ${schema.meterLeaseWaiters} (stripe_customer_id, event_name, outbox_id, holder, expires_at)
       SELECT stripe_customer_id, event_name, id, $2::text, clock_timestamp() + $4::int * interval '1 millisecond'
         FROM target WHERE NOT EXISTS (SELECT 1 FROM taken)
       ON CONFLICT (stripe_customer_id, event_name, outbox_id) DO UPDATE
         SET holder = EXCLUDED.holder, expires_at = EXCLUDED.expires_at
       RETURNING 1
     ), served AS (
       DELETE FROM ${schema.meterLeaseWaiters} w USING target t
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
  if (r.customer === null || r.event_name === null) return { outcome: 'no_target', lease: null };
  return { outcome: r.acquired ? 'acquired' : 'busy', lease: leaseId(r.customer, r.event_name) };
}

/**
 * Extends `holder`'s lease to `ms` from now, only if it still holds it unexpired: false means the
 * lease lapsed (and may be another delivery's by now), so no call may be made under it.
 */
export async function renewLease(db: Queryable, schema: Schema, holder: string, ms: number): Promise<boolean> {
  const { rowCount } = await db.query(
    `UPDATE ${schema.meterLeases} SET expires_at = clock_timestamp() + $2::int * interval '1 millisecond'
      WHERE holder = $1::text AND expires_at > clock_timestamp()`,
    [holder, ms],
  );
  return (rowCount ?? 0) > 0;
}

/**
 * Keeps `holder`'s lease for `ms` more and hands it to nobody (after a call that got no answer:
 * Stripe may still be processing it). The lease then lapses by itself, and the waiting deliveries,
 * which re-check every poll interval, take it.
 */
export async function holdLease(db: Queryable, schema: Schema, holder: string, ms: number): Promise<void> {
  await db.query(
    `UPDATE ${schema.meterLeases} SET expires_at = greatest(expires_at, clock_timestamp() + $2::int * interval '1 millisecond')
      WHERE holder = $1::text`,
    [holder, ms],
  );
}

/**
 * Gives back whatever lease `holder` has, handing each to the oldest delivery still waiting for it
 * (which then holds it for `handOffMs`, and extends it when it begins its call), and leaves any
 * queue it waits in; every lease's waiters are notified at commit (schema.leaseChannel, payload: the
 * lease id, U+001E, the new holder). The statement is the schema's `meter_lease_hand_off`
 * (migrations/001_schema.sql; its result column `lane` is the lease id).
 */
export async function handOffLease(db: Queryable, schema: Schema, holder: string, handOffMs: number): Promise<HandOff[]> {
  const { rows } = await db.query<{ lease: string; next_holder: string | null }>({
    // Named: prepared once per connection, parsed and planned once, not on every event.
    name: schema.statementName('hand-off-lease'),
    text: `SELECT h.lane AS lease, h.next_holder, set_config('synchronous_commit', 'off', true)
             FROM ${schema.meterLeaseHandOff}($1::text, $2::int, $3::text) h`,
    values: [holder, handOffMs, schema.leaseChannel],
  });
  return rows.map((r) => ({ lease: r.lease, nextHolder: r.next_holder }));
}
