/**
 * What operators read about events that did not get billed: the dead letters (attempts ran out,
 * or Stripe refused them), and the events Stripe accepted and rejected later (`rejected_async`).
 * Read by `billing-outbox dead` and `billing-outbox retry --all-dead`.
 */
import type { Queryable } from '../db.js';
import { ageSeconds, iso } from '../duration.js';
import { countRejectedAsync, listRejectedAsync } from '../outbox/sql/error-reports.js';
import { countDeadLetters, listDeadLetters, type DeadLetterFilter, type OperatorRow } from '../outbox/sql/operator.js';
import { withinResendWindow } from './retry.js';
import type { Schema } from '../outbox/sql/schema.js';

export type { DeadLetterFilter } from '../outbox/sql/operator.js';

export interface DeadLetterItem {
  key: string;
  tenantId: string;
  attempts: number;
  lastErrorCode: string | null;
  lastErrorMessage: string | null;
  createdAt: string;
  firstAttemptedAt: string | null;
  deadAt: string | null;
  ageSeconds: number;
  sinceFirstAttemptSeconds: number | null;
  /** False once the first attempt is older than the safe resend window: retrying needs --force. */
  safeToResend: boolean;
}

export interface RejectedItem {
  key: string;
  tenantId: string;
  eventName: string;
  quantity: number;
  occurredAt: string;
  sentAt: string | null;
  rejectedAt: string | null;
  errorCode: string | null;
  errorMessage: string | null;
}

/** A page of a listing, with how many match in all. */
export interface Listing<T> {
  total: number;
  items: T[];
}

function toItem(row: OperatorRow, now: number): DeadLetterItem {
  return {
    key: row.idempotency_key,
    tenantId: row.tenant_id,
    attempts: row.attempt_count,
    lastErrorCode: row.last_error_code,
    lastErrorMessage: row.last_error_message,
    createdAt: row.created_at.toISOString(),
    firstAttemptedAt: iso(row.first_attempted_at),
    deadAt: iso(row.dead_at),
    ageSeconds: ageSeconds(row.created_at, now)!,
    sinceFirstAttemptSeconds: ageSeconds(row.first_attempted_at, now),
    safeToResend: withinResendWindow(row, now),
  };
}

/** How many dead letters match `filter` (a bulk retry's confirmation and progress). */
export async function countDead(db: Queryable, schema: Schema, filter: DeadLetterFilter): Promise<number> {
  return countDeadLetters(db, schema, filter);
}

/** The first `limit` dead letters (of one tenant, if given), oldest first; ages are measured from `now`. */
export async function listDead(
  db: Queryable,
  schema: Schema,
  opts: { tenantId?: string | undefined; limit: number; now: number },
): Promise<Listing<DeadLetterItem>> {
  const filter = { tenantId: opts.tenantId };
  const [total, rows] = await Promise.all([countDeadLetters(db, schema, filter), listDeadLetters(db, schema, { ...filter, afterId: 0, limit: opts.limit })]);
  return { total, items: rows.map((r) => toItem(r, opts.now)) };
}

/** The first `limit` events Stripe rejected after answering 200 (of one tenant, if given), oldest rejection first. */
export async function listRejected(db: Queryable, schema: Schema, opts: { tenantId?: string | undefined; limit: number }): Promise<Listing<RejectedItem>> {
  const [total, rows] = await Promise.all([countRejectedAsync(db, schema, opts), listRejectedAsync(db, schema, opts)]);
  const items = rows.map((r) => ({
    key: r.idempotency_key,
    tenantId: r.tenant_id,
    eventName: r.event_name,
    quantity: r.quantity,
    occurredAt: r.occurred_at.toISOString(),
    sentAt: iso(r.sent_at),
    rejectedAt: iso(r.rejected_at),
    errorCode: r.last_error_code,
    errorMessage: r.last_error_message,
  }));
  return { total, items };
}
