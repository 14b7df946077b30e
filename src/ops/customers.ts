/**
 * Which Stripe customer a tenant is billed as. Usage already queued is sent to the customer mapped
 * when it is first called, so a remap also redirects the backlog (reconcile compares per customer);
 * an event already called keeps its customer (src/outbox/sql/customers.ts `attemptCustomer`).
 */
import type pg from 'pg';
import Stripe from 'stripe';
import { withTransaction, type Queryable } from '../db.js';
import { setBillingCustomer } from '../outbox/customers.js';
import { insertBillingCustomerIfAbsent, listBillingCustomers, tenantsBilledAs } from '../outbox/sql/customers.js';
import { scrub } from '../log.js';
import type { Schema } from '../outbox/sql/schema.js';

/**
 * Why Stripe's account (the key's, in its mode) cannot bill `stripeCustomerId`, if it cannot: no
 * such customer, or a deleted one. Stripe takes meter events for an unknown customer and refuses
 * them later, reporting only a sample: a mistyped id would leave the tenant's usage looking billed.
 * Undefined when Stripe has it.
 */
export async function stripeCustomerProblem(stripe: Pick<Stripe, 'customers'>, stripeCustomerId: string): Promise<string | undefined> {
  let customer: Stripe.Customer | Stripe.DeletedCustomer;
  try {
    customer = await stripe.customers.retrieve(stripeCustomerId);
  } catch (err) {
    if (err instanceof Stripe.errors.StripeInvalidRequestError && err.statusCode === 404) {
      return (
        `Stripe has no customer ${stripeCustomerId} (in the account and mode of STRIPE_API_KEY): usage billed to it would be ` +
        'refused later (meter_event_customer_not_found), and only a sample of those refusals reported. Check the id, or map it anyway with --no-stripe-check'
      );
    }
    return `could not ask Stripe whether customer ${stripeCustomerId} exists (${scrub((err as Error).message)}): try again, or map it without asking with --no-stripe-check`;
  }
  if ('deleted' in customer && customer.deleted === true) {
    return `Stripe's customer ${stripeCustomerId} is deleted: usage billed to it would be refused later (meter_event_customer_not_found); map the tenant to a live customer`;
  }
  return undefined;
}

export interface MappingResult {
  tenantId: string;
  stripeCustomerId: string;
  previousStripeCustomerId: string | null;
  created: boolean;
  /**
   * Other tenants already billed as this customer: their usage and this tenant's now land on one
   * invoice. Allowed (one company, several workspaces), but never by accident: the CLI says so.
   */
  sharedWith: string[];
}

/** Maps (or remaps) a tenant, records who did it, and says who else is billed as its customer, in one transaction. Validate with mappingProblem first. */
export async function mapTenant(pool: pg.Pool, schema: Schema, tenantId: string, stripeCustomerId: string, actor: string): Promise<MappingResult> {
  return withTransaction(pool, async (db) => {
    const set = await setBillingCustomer(db, { tenantId, stripeCustomerId }, { schema: schema.name, by: actor });
    const sharedWith = await tenantsBilledAs(db, schema, stripeCustomerId, tenantId);
    return { tenantId, stripeCustomerId, previousStripeCustomerId: set.previousStripeCustomerId, created: set.created, sharedWith };
  });
}

/**
 * Maps each tenant that has no mapping yet (the local stack's demo tenants); a tenant an operator
 * mapped already keeps its customer. Not an operator action: nothing is recorded.
 */
export async function seedTenants(db: Queryable, schema: Schema, customers: Readonly<Record<string, string>>): Promise<void> {
  for (const [tenantId, stripeCustomerId] of Object.entries(customers)) {
    await insertBillingCustomerIfAbsent(db, schema, tenantId, stripeCustomerId);
  }
}

export interface TenantMapping {
  tenantId: string;
  stripeCustomerId: string;
  createdAt: string;
  updatedAt: string;
}

/** Every tenant's mapping, by tenant. */
export async function listMappings(db: Queryable, schema: Schema): Promise<TenantMapping[]> {
  const rows = await listBillingCustomers(db, schema);
  return rows.map((r) => ({
    tenantId: r.tenant_id,
    stripeCustomerId: r.stripe_customer_id,
    createdAt: r.created_at.toISOString(),
    updatedAt: r.updated_at.toISOString(),
  }));
}

/** Whether the tenant is billed as some Stripe customer. */
export async function isMapped(db: Queryable, schema: Schema, tenantId: string): Promise<boolean> {
  return (await listBillingCustomers(db, schema)).some((c) => c.tenant_id === tenantId);
}
