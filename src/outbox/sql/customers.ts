/**
 * Tenants and the Stripe customers they are billed as.
 * One named function per statement; values always travel as typed parameters, never as SQL text.
 */
import type { Queryable } from '../../db.js';
import type { Schema } from './schema.js';

export interface BillingCustomerRow {
  tenant_id: string;
  stripe_customer_id: string;
  created_at: Date;
  updated_at: Date;
}

/** Maps a tenant to its Stripe customer (insert or replace); also returns the customer it replaced. */
export async function upsertBillingCustomer(
  db: Queryable,
  schema: Schema,
  tenantId: string,
  stripeCustomerId: string,
): Promise<BillingCustomerRow & { previous_customer_id: string | null }> {
  const { rows } = await db.query<BillingCustomerRow & { previous_customer_id: string | null }>(
    `WITH prev AS (SELECT stripe_customer_id FROM ${schema.billingCustomers} WHERE tenant_id = $1::text)
     INSERT INTO ${schema.billingCustomers} (tenant_id, stripe_customer_id) VALUES ($1::text, $2::text)
     ON CONFLICT (tenant_id) DO UPDATE SET stripe_customer_id = EXCLUDED.stripe_customer_id, updated_at = now()
     RETURNING tenant_id, stripe_customer_id, created_at, updated_at, (SELECT stripe_customer_id FROM prev) AS previous_customer_id`,
    [tenantId, stripeCustomerId],
  );
  return rows[0]!;
}

/**
 * Maps a tenant to a Stripe customer unless it is mapped already (an operator's own mapping is
 * kept); returns whether it inserted.
 */
export async function insertBillingCustomerIfAbsent(db: Queryable, schema: Schema, tenantId: string, stripeCustomerId: string): Promise<boolean> {
  const result = await db.query(
    `INSERT INTO ${schema.billingCustomers} (tenant_id, stripe_customer_id) VALUES ($1::text, $2::text) ON CONFLICT (tenant_id) DO NOTHING`,
    [tenantId, stripeCustomerId],
  );
  return (result.rowCount ?? 0) > 0;
}

/** The other tenants billed as `stripeCustomerId`. */
export async function tenantsBilledAs(db: Queryable, schema: Schema, stripeCustomerId: string, exceptTenantId: string): Promise<string[]> {
  const { rows } = await db.query<{ tenant_id: string }>(
    `SELECT tenant_id FROM ${schema.billingCustomers} WHERE stripe_customer_id = $1::text AND tenant_id <> $2::text ORDER BY tenant_id`,
    [stripeCustomerId, exceptTenantId],
  );
  return rows.map((r) => r.tenant_id);
}

export async function listBillingCustomers(db: Queryable, schema: Schema): Promise<BillingCustomerRow[]> {
  const { rows } = await db.query<BillingCustomerRow>(
    `SELECT tenant_id, stripe_customer_id, created_at, updated_at FROM ${schema.billingCustomers} ORDER BY tenant_id`,
  );
  return rows;
}
