/**
 * Stripe allows one concurrent meter-event call per customer per meter. This lease enforces it across
 * every worker process on every machine: a row per (Stripe customer, meter event name) in PostgreSQL,
 * taken before the call and given back after it. No connection is held while waiting or calling,
 * and a crashed holder's lease simply expires.
 *
 * The holder is one usage workflow run (`<workflowId>/<runId>`): it takes the lease in a local
 * activity before scheduling its Stripe call (so waiting costs no call slot), the delivery
 * activity renews it for the length of the call, and gives it back when the call is over.
 */
import type { Queryable } from '../db.js';

export type LeaseOutcome = 'acquired' | 'busy' | 'no_target';

/**
 * Takes (or renews) the lease of the customer and meter of the event `key` for `holder`, if it is
 * free, expired, or already the holder's. `no_target` when the event or its customer mapping does
 * not exist (the delivery activity then fails with the precise reason).
 */
export async function acquireMeterLease(db: Queryable, key: string, holder: string, leaseMs: number): Promise<LeaseOutcome> {
  const { rows } = await db.query<{ found: boolean; acquired: boolean }>(
    `WITH target AS (
       SELECT c.stripe_customer_id, o.event_name
         FROM outbox o JOIN billing_customers c ON c.tenant_id = o.tenant_id
        WHERE o.idempotency_key = $1::text
     ), taken AS (
       INSERT INTO meter_leases (stripe_customer_id, event_name, holder, expires_at)
       SELECT stripe_customer_id, event_name, $2::text, clock_timestamp() + $3::int * interval '1 millisecond' FROM target
       ON CONFLICT (stripe_customer_id, event_name) DO UPDATE
         SET holder = EXCLUDED.holder, expires_at = EXCLUDED.expires_at
         WHERE meter_leases.expires_at < clock_timestamp() OR meter_leases.holder = EXCLUDED.holder
       RETURNING 1
     )
     SELECT EXISTS (SELECT 1 FROM target) AS found, EXISTS (SELECT 1 FROM taken) AS acquired`,
    [key, holder, leaseMs],
  );
  const r = rows[0]!;
  return !r.found ? 'no_target' : r.acquired ? 'acquired' : 'busy';
}

/** Gives back whatever lease `holder` has. */
export async function releaseMeterLease(db: Queryable, holder: string): Promise<void> {
  await db.query(`DELETE FROM meter_leases WHERE holder = $1::text`, [holder]);
}
