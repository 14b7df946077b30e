/**
 * Which Stripe customer a tenant is billed as, set by the application: a signup flow maps its new
 * tenant in the transaction that creates it, as `billing-outbox customers set` does for operators.
 * Usage already queued goes to the customer mapped when it is first called; an event already called
 * keeps its customer (./sql/customers.ts `attemptCustomer`).
 */
import { callerRows, type TransactionClient } from './sql/enqueue.js';
import { setBillingCustomerStatement } from './sql/customers.js';
import { schemaFor } from './sql/schema.js';
import { tenantProblem } from './validate.js';

// Stripe's ids are `cus_` and letters, digits or underscores (test-mode and local ids have underscores).
const CUSTOMER_ID = /^cus_[A-Za-z0-9_]{1,251}$/;

/** Why this mapping cannot be stored, if it cannot: the tenant by recordUsage's rule, the id by Stripe's. */
export function mappingProblem(tenantId: unknown, stripeCustomerId: unknown): string | undefined {
  const tenant = tenantProblem(tenantId);
  if (tenant) return `tenant ${tenant}`;
  if (typeof stripeCustomerId !== 'string' || !CUSTOMER_ID.test(stripeCustomerId)) {
    return `stripe_customer_id must look like cus_… (letters, digits and underscores), got ${JSON.stringify(stripeCustomerId)}`;
  }
  return undefined;
}

/** A mapping that can never be stored as it is (a tenant id recordUsage would refuse, an id that is not a customer's). Nothing was written. */
export class InvalidMappingError extends Error {
  readonly code = 'invalid_mapping';
  constructor(message: string) {
    super(message);
    this.name = 'InvalidMappingError';
  }
}

export interface BillingCustomer {
  tenantId: string;
  /** The Stripe customer's id (`cus_…`). Not checked with Stripe here: the application has just created it, or `customers set` asks Stripe. */
  stripeCustomerId: string;
}

export interface SetBillingCustomerOptions {
  /** The PostgreSQL schema billing-outbox was migrated into (default `billing_outbox`). */
  schema?: string;
  /** Who maps it, for operator_actions (default `application`). */
  by?: string;
}

export interface SetBillingCustomerResult {
  /** False when the tenant was mapped already (to another customer, or to this one). */
  created: boolean;
  /** The customer it was mapped to before; null when it had none. */
  previousStripeCustomerId: string | null;
}

/**
 * Maps (or remaps) a tenant to its Stripe customer, recorded in operator_actions, in one statement
 * on `db`: a node-postgres pool or client, or the application's transaction (its rows commit with
 * it; Kysely, Drizzle and Knex through `billing-outbox/kysely`, `/drizzle`, `/knex`). Throws
 * InvalidMappingError, writing nothing, for a mapping that can never be stored.
 */
export async function setBillingCustomer(db: TransactionClient, mapping: BillingCustomer, options: SetBillingCustomerOptions = {}): Promise<SetBillingCustomerResult> {
  const problem = typeof mapping === 'object' && mapping !== null ? mappingProblem(mapping.tenantId, mapping.stripeCustomerId) : 'a mapping is { tenantId, stripeCustomerId }';
  if (problem) throw new InvalidMappingError(problem);
  const by = options.by ?? 'application';
  if (typeof by !== 'string' || by.length === 0 || by.length > 200) throw new InvalidMappingError(`by must be 1 to 200 characters, got ${JSON.stringify(by)}`);
  const [row] = await callerRows<{ previous_customer_id: string | null }>(db, setBillingCustomerStatement(schemaFor(options.schema), mapping.tenantId, mapping.stripeCustomerId, by));
  const previous = row?.previous_customer_id ?? null;
  return { created: previous === null, previousStripeCustomerId: previous };
}
