/**
 * Tenants and the Stripe customers they are billed as.
 * One named function per statement; values always travel as typed parameters, never as SQL text.
 */
import type { Queryable } from '../../db.js';
import type { Schema } from './schema.js';

/**
 * The Stripe customer an attempt of outbox row `row` (an alias in the statement) names: the one an
 * earlier attempt of its identifier named, when there was one (`billed_customer_id` while
 * `first_attempted_at` is set): Stripe may hold the event under that customer already, its answer
 * lost, and a call naming another customer with the same identifier would be answered "already
 * exists" (v1) or dropped (v2), the row then naming a customer that was never billed. Otherwise the
 * customer its tenant is mapped to now (NULL if none): a remap redirects every event not yet
 * attempted. A rebill (a new identifier) clears `first_attempted_at`, and a refusal for good
 * (delivery.ts `recordAttemptError`'s `refused`) clears `billed_customer_id`: nothing of the event
 * is at Stripe then.
 * The lease (lease.ts) and the attempt (delivery.ts `beginAttempt`) read it alike: a call is made
 * only under the lease of the customer it names.
 */
export function attemptCustomer(schema: Schema, row: string): string {
  return `COALESCE(CASE WHEN ${row}.first_attempted_at IS NOT NULL THEN ${row}.billed_customer_id END,
    (SELECT bc.stripe_customer_id FROM ${schema.billingCustomers} bc WHERE bc.tenant_id = ${row}.tenant_id))`;
}

export interface BillingCustomerRow {
  tenant_id: string;
  stripe_customer_id: string;
  created_at: Date;
  updated_at: Date;
}

/**
 * Maps a tenant to its Stripe customer (insert or replace) and records who did it in
 * operator_actions, in one statement; answers the customer it replaced (null: none). A statement,
 * not a query run here: the application runs it on its own transaction (setBillingCustomer).
 */
export function setBillingCustomerStatement(schema: Schema, tenantId: string, stripeCustomerId: string, actor: string): { text: string; values: unknown[] } {
  return {
    // prev locks the row as the update below would (FOR NO KEY UPDATE: the tenant's recordUsage, whose
    // foreign key takes FOR KEY SHARE, neither waits nor blocks), so of two remaps at once the second
    // reads the first's customer, not the one before both.
    text: `WITH prev AS (SELECT stripe_customer_id AS customer FROM ${schema.billingCustomers} WHERE tenant_id = $1::text FOR NO KEY UPDATE),
     mapped AS (
       INSERT INTO ${schema.billingCustomers} (tenant_id, stripe_customer_id) VALUES ($1::text, $2::text)
       ON CONFLICT (tenant_id) DO UPDATE SET stripe_customer_id = EXCLUDED.stripe_customer_id, updated_at = now()
       RETURNING 1
     ), audit AS (
       INSERT INTO ${schema.operatorActions} (actor, action, tenant_id, forced, outcome, detail)
       SELECT $3::text, 'customers.set', $1::text, false,
              CASE WHEN p.customer IS NULL THEN 'created' WHEN p.customer = $2::text THEN 'unchanged' ELSE 'updated' END,
              CASE WHEN p.customer IS NULL OR p.customer = $2::text THEN '→ ' || $2::text ELSE p.customer || ' → ' || $2::text END
         FROM (SELECT (SELECT customer FROM prev) AS customer) p
       RETURNING 1
     )
     SELECT (SELECT customer FROM prev) AS previous_customer_id FROM audit, mapped`,
    values: [tenantId, stripeCustomerId, actor.slice(0, 200)],
  };
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
