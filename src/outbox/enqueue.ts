/**
 * The only thing billing-outbox does on the application's request path: record a usage and queue
 * its meter event, in the caller's own transaction, with no network call.
 */
import { InvalidUsageError, refuseOutsideTransaction, UnknownTenantError, UsageConflictError, UsageError, type OutboxEntry } from './errors.js';
import { activeTraceParent } from '../tracing.js';
import { idempotencyKeyFor } from './keys.js';
import { findEntryByKey, findRecordedUsages, insertUsage, type CallerEntryRow, type RecordedUsage, type TransactionClient } from './sql/enqueue.js';
import { schemaFor } from './sql/schema.js';
import { tooOldProblem, validateUsage, type UsageInput, type ValidUsage } from './validate.js';

/**
 * The meter event name of a usage that names none, unless the caller passes `defaultEventName`.
 * STRIPE_METER_EVENT_NAME has the same default, so an application and the HTTP API that configure
 * nothing agree; the library itself never reads the variable (it runs in the application's
 * process: its environment is the application's business).
 */
export const DEFAULT_EVENT_NAME = 'api_requests';

export interface RecordUsageOptions {
  /**
   * The meter event name for a usage without `eventName` (default DEFAULT_EVENT_NAME). To follow a
   * deployment's STRIPE_METER_EVENT_NAME, read it in the application and pass it here, as the HTTP
   * API does with its own configuration.
   */
  defaultEventName?: string | undefined;
  /** The PostgreSQL schema billing-outbox's tables are in (DEFAULT_SCHEMA unless you migrated another). */
  schema?: string | undefined;
}

export interface RecordUsageResult {
  entry: OutboxEntry;
  /** False when this usage was already recorded (the existing entry is returned, nothing added). */
  created: boolean;
}

/** An entry row as the caller's driver returned it, as an OutboxEntry (also the bulk import's). */
export function toEntry(row: CallerEntryRow): OutboxEntry {
  return {
    id: Number(row.id),
    idempotencyKey: row.key,
    tenantId: row.tenant,
    usageId: row.usage,
    eventName: row.event,
    quantity: Number(row.quantity),
    occurredAt: new Date(row.occurred),
    status: row.status,
  };
}

/**
 * Records one usage and queues its meter event inside the caller's open transaction.
 *
 * - Pass a client on which you have run BEGIN; the rows commit or roll back with your work. A
 *   node-postgres client works as it is; Kysely, Drizzle and Knex transactions through
 *   `billing-outbox/kysely`, `/drizzle` and `/knex`; anything else that runs a statement with
 *   positional parameters ($1…) and returns its rows through a `TransactionClient` of your own.
 * - A usage without `eventName` goes to `options.defaultEventName`, else DEFAULT_EVENT_NAME
 *   (`api_requests`); no environment variable is read.
 * - A usage is identified by (tenantId, usageId): recording it again returns the existing entry
 *   with `created: false`; other tenants' ids are never seen.
 * - Throws a `UsageError` (and writes nothing) for invalid input, an unknown tenant, or a usage id
 *   reused with different values. Makes no network call besides the database queries, and no
 *   input makes a query fail inside your transaction.
 * - Called inside an OpenTelemetry span (your HTTP server's, or one of your own), the row keeps
 *   that span's trace context, and the event's delivery joins its trace (README: Tracing).
 * - `schema`: the PostgreSQL schema billing-outbox was migrated into (default `billing_outbox`; the
 *   workers' DATABASE_SCHEMA must be the same). Every statement names its tables in it; your
 *   connection's search_path is neither read nor changed.
 */
export async function recordUsage(
  client: TransactionClient,
  input: UsageInput,
  options: RecordUsageOptions = {},
): Promise<RecordUsageResult> {
  refuseOutsideTransaction(client);
  const schema = schemaFor(options.schema);
  const usage = validateUsage(input, options.defaultEventName ?? DEFAULT_EVENT_NAME);
  const key = idempotencyKeyFor(usage.tenantId, usage.usageId);
  // A usage too old for Stripe is refused, unless it is one recorded while it was not: a retry after
  // an answer that was lost, which hears what the first call heard.
  const tooOld = tooOldProblem(usage.occurredAt);
  if (tooOld === undefined) {
    // The caller's active span, if any, goes with the row: the relay continues that trace.
    const inserted = await insertUsage(client, schema, { ...usage, key, traceParent: activeTraceParent() });
    if (!inserted.tenantKnown) throw new UnknownTenantError(usage.tenantId);
    if (inserted.row) return { entry: toEntry(inserted.row), created: true };
  }

  // Already recorded (possibly by a concurrent transaction that has just committed).
  const found = await findEntryByKey(client, schema, usage.tenantId, key);
  if (!found) {
    // No outbox row: the usage's was delivered and pruned (OUTBOX_RETENTION_DAYS), by then too old
    // for Stripe, so it is told apart from a new usage that is too old by its usage row.
    const [recorded] = await findRecordedUsages(client, schema, [usage]);
    if (!recorded && tooOld !== undefined) throw new InvalidUsageError('occurredAt', tooOld);
    throw prunedUsageError(usage, recorded);
  }
  const entry = toEntry(found);
  if (!sameUsage(entry, usage)) throw new UsageConflictError(usage.usageId, entry, differences(entry, usage));
  return { entry, created: false };
}

/**
 * Whether a usage recorded again is the one already there (then nothing is added) rather than a
 * reused id with other values (refused). A usage without a time takes the transaction's, so any
 * recorded time matches it.
 */
export function sameUsage(entry: OutboxEntry, usage: ValidUsage): boolean {
  return differences(entry, usage).length === 0;
}

/**
 * A usage recorded before whose outbox entry is gone: delivered and pruned after
 * OUTBOX_RETENTION_DAYS (its usage row, `recorded`, says with which values), or not visible to a
 * repeatable-read snapshot taken before the transaction that wrote it (`recorded` undefined).
 */
export function prunedUsageError(usage: ValidUsage, recorded: RecordedUsage | undefined): UsageError {
  const id = JSON.stringify(usage.usageId);
  if (!recorded) {
    return new UsageError('usage_conflict', `usage ${id} was recorded before; its outbox entry is gone (delivered and pruned after OUTBOX_RETENTION_DAYS) or not visible to this transaction`, 'usageId');
  }
  const differ = differences(recorded, usage);
  // The same values: a replay of work done long ago, which the caller may take as done
  // (`already_recorded`); other values: a reused id (`usage_conflict`).
  return new UsageError(
    differ.length > 0 ? 'usage_conflict' : 'already_recorded',
    `usage ${id} was recorded before${differ.length > 0 ? ` with different values: ${differ.join(', ')}` : ', with these values'}; ` +
      'its outbox entry was delivered and pruned after OUTBOX_RETENTION_DAYS: nothing was added',
    'usageId',
  );
}

/** What differs between a recorded usage and the one given again under its id, field by field. */
export function differences(entry: Pick<OutboxEntry, 'quantity' | 'eventName' | 'occurredAt'>, usage: ValidUsage): string[] {
  const found: string[] = [];
  if (entry.quantity !== usage.quantity) found.push(`quantity (recorded ${entry.quantity}, given ${usage.quantity})`);
  if (entry.eventName !== usage.eventName) found.push(`eventName (recorded ${JSON.stringify(entry.eventName)}, given ${JSON.stringify(usage.eventName)})`);
  if (usage.occurredAt !== null && entry.occurredAt.getTime() !== usage.occurredAt.getTime()) {
    found.push(`occurredAt (recorded ${entry.occurredAt.toISOString()}, given ${usage.occurredAt.toISOString()})`);
  }
  return found;
}

export type { UsageInput } from './validate.js';
export type { TransactionClient } from './sql/enqueue.js';
