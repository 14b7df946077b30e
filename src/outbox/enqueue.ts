/**
 * The only thing billing-outbox does on the application's request path: record a usage and queue
 * its meter event, in the caller's own transaction, with no network call.
 */
import type { Queryable } from '../db.js';
import { findEntryByKey, insertUsage, type EntryRow } from './sql/enqueue.js';

/** Stripe rejects meter event values with more than 15 significant digits. */
export const MAX_QUANTITY = 999_999_999_999_999;
/** Stripe's `identifier` allows 100 characters; the key is `usage_log:` + the usage id. */
export const KEY_PREFIX = 'usage_log:';
export const MAX_USAGE_ID_LENGTH = 100 - KEY_PREFIX.length;
export const MAX_EVENT_NAME_LENGTH = 100;
export const MAX_TENANT_ID_LENGTH = 200;
/** Stripe accepts meter events stamped up to 5 minutes in the future. */
const MAX_FUTURE_SKEW_MS = 5 * 60_000;

export interface UsageInput {
  /** The application's id for this unit of work; enqueueing the same id again is a no-op. */
  usageId: string;
  tenantId: string;
  quantity: number;
  /** Defaults to the configured STRIPE_METER_EVENT_NAME. */
  eventName?: string | undefined;
  /** When the usage happened; defaults to the transaction's time. */
  occurredAt?: Date | undefined;
}

export interface OutboxEntry {
  id: number;
  idempotencyKey: string;
  tenantId: string;
  eventName: string;
  quantity: number;
  occurredAt: Date;
  status: string;
}

export interface RecordUsageResult {
  entry: OutboxEntry;
  /** False when this usage was already recorded (the existing entry is returned, nothing added). */
  created: boolean;
}

/** Base class of every error recordUsage throws for bad input. Nothing is written when it throws. */
export class UsageError extends Error {
  constructor(
    readonly code: string,
    message: string,
    readonly field?: string,
  ) {
    super(message);
    this.name = 'UsageError';
  }
}

export class InvalidUsageError extends UsageError {
  constructor(field: string, message: string) {
    super('invalid_usage', `${field}: ${message}`, field);
    this.name = 'InvalidUsageError';
  }
}

export class UnknownTenantError extends UsageError {
  constructor(readonly tenantId: string) {
    super('unknown_tenant', `tenant ${JSON.stringify(tenantId)} has no billing customer; add one first`, 'tenantId');
    this.name = 'UnknownTenantError';
  }
}

/** The same usage id was recorded before with different content: refusing beats silently diverging. */
export class UsageConflictError extends UsageError {
  constructor(
    readonly usageId: string,
    readonly existing: OutboxEntry,
  ) {
    super('usage_conflict', `usage ${JSON.stringify(usageId)} was already recorded with different values`, 'usageId');
    this.name = 'UsageConflictError';
  }
}

export function idempotencyKeyFor(usageId: string): string {
  return `${KEY_PREFIX}${usageId}`;
}

// Printable text without control characters: these strings end up in Stripe, URLs and log lines.
const PRINTABLE = /^[^\p{Cc}]+$/u;

function checkText(field: string, value: unknown, max: number): string {
  if (typeof value !== 'string') throw new InvalidUsageError(field, 'must be a string');
  if (value.length === 0 || value.trim() !== value) {
    throw new InvalidUsageError(field, 'must be non-empty, without leading or trailing spaces');
  }
  if (value.length > max) throw new InvalidUsageError(field, `must be at most ${max} characters`);
  if (!PRINTABLE.test(value)) throw new InvalidUsageError(field, 'must not contain control characters');
  return value;
}

interface ValidUsage {
  usageId: string;
  tenantId: string;
  quantity: number;
  eventName: string;
  occurredAt: Date | null;
}

export function validateUsage(input: UsageInput, defaultEventName: string): ValidUsage {
  if (typeof input !== 'object' || input === null) throw new InvalidUsageError('input', 'must be an object');
  const usageId = checkText('usageId', input.usageId, MAX_USAGE_ID_LENGTH);
  const tenantId = checkText('tenantId', input.tenantId, MAX_TENANT_ID_LENGTH);
  const eventName = checkText('eventName', input.eventName ?? defaultEventName, MAX_EVENT_NAME_LENGTH);
  const { quantity } = input;
  if (typeof quantity !== 'number' || !Number.isInteger(quantity) || quantity < 1) {
    throw new InvalidUsageError('quantity', 'must be a positive integer');
  }
  if (quantity > MAX_QUANTITY) {
    throw new InvalidUsageError('quantity', `must be at most ${MAX_QUANTITY} (Stripe accepts 15 digits)`);
  }
  let occurredAt: Date | null = null;
  if (input.occurredAt !== undefined) {
    if (!(input.occurredAt instanceof Date) || Number.isNaN(input.occurredAt.getTime())) {
      throw new InvalidUsageError('occurredAt', 'must be a valid Date');
    }
    // Stripe takes usage stamped at most 5 minutes ahead; later than that it could never be
    // reported from here. (Old usage is accepted: it is recorded, and dead-lettered with its reason
    // if it is past Stripe's 35-day window by the time it is sent.)
    if (input.occurredAt.getTime() > Date.now() + MAX_FUTURE_SKEW_MS) {
      throw new InvalidUsageError('occurredAt', 'must not be more than 5 minutes in the future');
    }
    occurredAt = input.occurredAt;
  }
  return { usageId, tenantId, quantity, eventName, occurredAt };
}

/**
 * Records one usage and queues its meter event inside the caller's open transaction.
 *
 * - Pass a client on which you have run BEGIN; the rows commit or roll back with your work.
 * - Recording the same `usageId` again returns the existing entry with `created: false`.
 * - Throws a `UsageError` (and writes nothing) for invalid input, an unknown tenant, or a usage id
 *   reused with different values. Makes no network call besides the database query.
 */
function toEntry(row: EntryRow): OutboxEntry {
  return {
    id: row.id,
    idempotencyKey: row.idempotency_key,
    tenantId: row.tenant_id,
    eventName: row.event_name,
    quantity: row.quantity,
    occurredAt: row.occurred_at,
    status: row.status,
  };
}

export async function recordUsage(
  client: Queryable,
  input: UsageInput,
  options: { defaultEventName?: string } = {},
): Promise<RecordUsageResult> {
  const usage = validateUsage(input, options.defaultEventName ?? 'api_requests');
  const key = idempotencyKeyFor(usage.usageId);
  const inserted = await insertUsage(client, { ...usage, key });
  if (!inserted.tenantKnown) throw new UnknownTenantError(usage.tenantId);
  if (inserted.row) return { entry: toEntry(inserted.row), created: true };

  // Already recorded (possibly by a concurrent transaction that has just committed).
  const found = await findEntryByKey(client, key);
  if (!found) {
    // The usage row exists without an outbox row: impossible through this function, and a
    // repeatable-read snapshot taken before the other transaction committed can also land here.
    throw new UsageError('usage_conflict', `usage ${JSON.stringify(usage.usageId)} exists but its outbox entry is not visible`, 'usageId');
  }
  const entry = toEntry(found);
  const same =
    entry.tenantId === usage.tenantId &&
    entry.eventName === usage.eventName &&
    entry.quantity === usage.quantity &&
    (usage.occurredAt === null || entry.occurredAt.getTime() === usage.occurredAt.getTime());
  if (!same) throw new UsageConflictError(usage.usageId, entry);
  return { entry, created: false };
}
