/**
 * Stripe allows one concurrent meter-event call per customer per meter. This lease enforces it across
 * every worker process on every machine: a row per (customer, meter) in PostgreSQL, taken before
 * the call and given back after it. No connection is held during the call, and a crashed holder's
 * lease simply expires (its length is the Stripe timeout plus a margin, so it cannot expire while
 * its call is still running).
 */
import type { Queryable } from './db.js';

export interface LeaseKey {
  stripeCustomerId: string;
  eventName: string;
}

/** Takes the lease if it is free or expired. Returns false when another call holds it. */
export async function acquireMeterLease(db: Queryable, key: LeaseKey, holder: string, leaseMs: number): Promise<boolean> {
  const { rowCount } = await db.query(
    `INSERT INTO meter_leases (stripe_customer_id, event_name, holder, expires_at)
     VALUES ($1::text, $2::text, $3::text, clock_timestamp() + $4::int * interval '1 millisecond')
     ON CONFLICT (stripe_customer_id, event_name) DO UPDATE
       SET holder = EXCLUDED.holder, expires_at = EXCLUDED.expires_at
       WHERE meter_leases.expires_at < clock_timestamp() OR meter_leases.holder = EXCLUDED.holder`,
    [key.stripeCustomerId, key.eventName, holder, leaseMs],
  );
  return rowCount === 1;
}

export async function releaseMeterLease(db: Queryable, key: LeaseKey, holder: string): Promise<void> {
  await db.query(
    `DELETE FROM meter_leases WHERE stripe_customer_id = $1::text AND event_name = $2::text AND holder = $3::text`,
    [key.stripeCustomerId, key.eventName, holder],
  );
}
