/**
 * billing-outbox for applications: what you call inside your own transaction. A worker in your
 * own process comes from billing-outbox/worker, the ingestion route for your Fastify server from
 * billing-outbox/fastify; or run them as processes (`billing-outbox worker`, `api`: src/bin/).
 *
 *   import { recordUsage, migrate } from 'billing-outbox';
 */
export { DEFAULT_EVENT_NAME, recordUsage, type RecordUsageOptions, type RecordUsageResult, type UsageInput } from './outbox/enqueue.js';
export { InvalidUsageError, NotATransactionError, UnknownTenantError, UnreadableRowsError, UsageConflictError, UsageError, type OutboxEntry } from './outbox/errors.js';
export { idempotencyKeyFor } from './outbox/keys.js';
export { InvalidMappingError, setBillingCustomer, type BillingCustomer, type SetBillingCustomerOptions, type SetBillingCustomerResult } from './outbox/customers.js';
export { importUsage, type ImportFormat, type ImportRefusal, type ImportSummary, type ImportUsageOptions } from './ops/import.js';
export { withoutPreparedStatements } from './outbox/adapters/unprepared.js';
export { MAX_QUANTITY, MAX_TENANT_ID_LENGTH, MAX_USAGE_ID_LENGTH } from './outbox/validate.js';
export { OUTBOX_STATUSES, type OutboxStatus } from './outbox/statuses.js';
export { migrate, RolledBackError, withTransaction } from './db.js';
export type { TransactionClient } from './outbox/sql/enqueue.js';
// The schema of our tables when none is given to recordUsage, migrate or DATABASE_SCHEMA.
export { DEFAULT_SCHEMA } from './outbox/sql/schema.js';
