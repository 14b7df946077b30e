/**
 * The errors `recordUsage` throws. Each UsageError means the usage was not recorded and nothing was
 * written; the caller's transaction is still usable. UnreadableRowsError means the opposite.
 */
import type { OutboxStatus } from './statuses.js';

/** An outbox entry as recordUsage returns it. */
export interface OutboxEntry {
  id: number;
  idempotencyKey: string;
  tenantId: string;
  usageId: string;
  eventName: string;
  quantity: number;
  occurredAt: Date;
  status: OutboxStatus;
}

/** Base class of every error recordUsage throws. `field` names the input field at fault, if one is. */
export class UsageError extends Error {
  readonly code: string;
  readonly field?: string;
  constructor(
    code: string,
    message: string,
    field?: string,
  ) {
    super(message);
    this.code = code;
    this.field = field;
    this.name = 'UsageError';
  }
}

/** A field that can never be recorded as it is; `reason` says why, without the field's name. */
export class InvalidUsageError extends UsageError {
  readonly reason: string;
  constructor(
    field: string,
    reason: string,
  ) {
    super('invalid_usage', `${field}: ${reason}`, field);
    this.reason = reason;
    this.name = 'InvalidUsageError';
  }
}

export class UnknownTenantError extends UsageError {
  readonly tenantId: string;
  constructor(tenantId: string) {
    super('unknown_tenant', `tenant ${JSON.stringify(tenantId)} has no billing customer; map it first (setBillingCustomer, or billing-outbox customers set)`, 'tenantId');
    this.tenantId = tenantId;
    this.name = 'UnknownTenantError';
  }
}

/** The same usage id was recorded before, for this tenant, with different values: refusing beats silently diverging. */
export class UsageConflictError extends UsageError {
  readonly usageId: string;
  readonly existing: OutboxEntry;
  /** `differences`: each field that differs, as "quantity (recorded 3, given 4)". */
  constructor(usageId: string, existing: OutboxEntry, differences: readonly string[] = []) {
    super(
      'usage_conflict',
      `usage ${JSON.stringify(usageId)} was already recorded with different values${differences.length > 0 ? `: ${differences.join(', ')}` : ''}`,
      'usageId',
    );
    this.usageId = usageId;
    this.existing = existing;
    this.name = 'UsageConflictError';
  }
}

/**
 * The caller's driver answered rows without the columns the statement returns: a plugin of its ORM
 * renamed or dropped them. Not a UsageError: the statement has run, its rows may be written, and the
 * transaction must be rolled back.
 */
export class UnreadableRowsError extends Error {
  /** `answer`: the answer as the driver gave it, or its first row when the rows were read. */
  constructor(answer: unknown, kind: 'row' | 'rows alone' = 'row') {
    const columns = answer && typeof answer === 'object' ? Object.keys(answer).join(', ') : String(answer);
    super(
      kind === 'rows alone'
        ? `recordUsage could not read the database's answer: the client answered the rows alone (first row's columns: ${columns}), where node-postgres answers { rows }: roll this transaction back and pass an object whose query(statement) answers { rows } (e.g. { query: async (s) => ({ rows: await t.query(s.text, s.values) }) })`
        : `recordUsage could not read the database's answer (columns: ${columns}); a plugin of your ORM renames or converts result rows: roll this transaction back and pass recordUsage a transaction without that plugin`,
    );
    this.name = 'UnreadableRowsError';
  }
}

/**
 * recordUsage, or an adapter, was handed something that is not an open transaction: a pool, an
 * ORM's root instance. Each statement on it would commit by itself, so a usage would be billed for
 * work the application then rolls back. Thrown before any statement is sent.
 */
export class NotATransactionError extends TypeError {
  constructor(given: string, instead: string) {
    super(`recordUsage needs the application's open transaction, and was given ${given}: its statements would commit on their own, outside your transaction; pass ${instead}`);
    this.name = 'NotATransactionError';
  }
}

/**
 * Throws NotATransactionError for what cannot be the caller's open transaction, where each statement
 * commits by itself: a node-postgres Pool (or one shaped like it), or a node-postgres client that is
 * outside a transaction (no BEGIN yet, or its COMMIT or ROLLBACK already done). The client's state is
 * the one its server last reported, so it is read only while nothing is queued on it: a BEGIN sent
 * but not awaited is still on its way (node-postgres 8.21 and later report it: the peer range asks
 * for them). pg-native and other clients are taken at their word.
 */
export function refuseOutsideTransaction(client: object): void {
  const pool = client as { totalCount?: unknown; idleCount?: unknown; connect?: unknown };
  if (typeof pool.totalCount === 'number' && typeof pool.idleCount === 'number' && typeof pool.connect === 'function') {
    throw new NotATransactionError('a pg.Pool', 'pool.connect(), BEGIN, then this client (or withTransaction(pool, …))');
  }
  const pgClient = client as { getTransactionStatus?: unknown; readyForQuery?: unknown };
  if (typeof pgClient.getTransactionStatus === 'function' && pgClient.readyForQuery === true && pgClient.getTransactionStatus() === 'I') {
    throw new NotATransactionError('a client outside a transaction (no BEGIN, or after its COMMIT or ROLLBACK)', 'the client after BEGIN (or withTransaction(pool, …))');
  }
}
