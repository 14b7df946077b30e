/**
 * Stripe's asynchronous error reports (v1.billing.meter.error_report_triggered) and the rows they reject.
 * One named function per statement; values always travel as typed parameters, never as SQL text.
 */
import type { Queryable } from '../../db.js';
import type { EntryRow } from './enqueue.js';
import type { Schema } from './schema.js';


/**
 * Claims one error-report event for processing. The event id is the primary key, so of two
 * deliveries of the same event (Stripe redelivers, possibly concurrently) only the first inserts;
 * the second waits on the first's uncommitted row and then finds it. Returns false for a redelivery.
 */
export async function insertErrorReport(
  db: Queryable,
  schema: Schema,
  report: { eventId: string; meterId: string | null; errorCount: number; report: unknown },
): Promise<boolean> {
  const result = await db.query(
    `INSERT INTO ${schema.stripeErrorReports} (event_id, meter_id, error_count, report)
     VALUES ($1::text, $2::text, $3::int, $4::jsonb)
     ON CONFLICT (event_id) DO NOTHING`,
    [report.eventId, report.meterId, report.errorCount, JSON.stringify(report.report)],
  );
  return (result.rowCount ?? 0) > 0;
}

export async function finishErrorReport(db: Queryable, schema: Schema, eventId: string, counts: { matched: number; unmatched: number }): Promise<void> {
  await db.query(`UPDATE ${schema.stripeErrorReports} SET matched = $2::int, unmatched = $3::int WHERE event_id = $1::text`, [
    eventId,
    counts.matched,
    counts.unmatched,
  ]);
}

export interface RejectedSample {
  /** The identifier Stripe names (src/outbox/keys.ts `stripeIdentifierFor`: the key, or a namespaced or revised one). */
  identifier: string;
  code: string;
  message: string;
}

export interface RejectedSampleResult {
  identifier: string;
  /** The row's key; null when no outbox row has this identifier (now or before a rebill). */
  key: string | null;
  /** Null when no outbox row has this identifier; `superseded` when it is a rebilled row's earlier identifier. */
  status_before: string | null;
  tenant_id: string | null;
  /** True when the row was sent, accepted, dispatched or dead and is now `rejected_async`. */
  marked: boolean;
}

/** What an error report may move to `rejected_async`: every status an attempt may have reached Stripe from. */
export const REJECTABLE = ['sent', 'accepted', 'dispatched', 'dead'] as const;

/**
 * Marks the rows Stripe named in an error report `rejected_async`, while they are `sent`,
 * `accepted`, `dispatched` (Stripe accepted the call but our `markDelivered` has not run yet; it
 * will leave the rejection alone) or `dead` (an attempt reached Stripe but its answer was lost, and
 * the later ones failed: without this a retry would be told "already exists" and mark it sent,
 * never billed). Cancelled or already rejected rows are left alone. Says for every sample what its
 * row was.
 *
 * A sample names an identifier, not a key: the row's stored `stripe_identifier`, or its key when
 * none is stored (unique index each) and the row was attempted. A row never attempted has sent
 * Stripe nothing to reject: a sample with its key is another deployment's event (one without
 * `STRIPE_IDENTIFIER_NAMESPACE` in the same Stripe account), unknown here. An identifier a rebill
 * has replaced finds its row by key only to say `superseded`: Stripe's verdict on the old
 * identifier says nothing of the new one.
 * One statement: the outer SELECT reads the rows as they were before the UPDATE (a data-modifying
 * CTE's effects are invisible to the rest of its statement).
 */
export async function markRejectedAsync(db: Queryable, schema: Schema, samples: RejectedSample[]): Promise<RejectedSampleResult[]> {
  if (samples.length === 0) return [];
  const { rows } = await db.query<RejectedSampleResult>(
    `WITH s AS (
       SELECT * FROM unnest($1::text[], $2::text[], $3::text[]) AS s(identifier, code, message)
     ), found AS (
       SELECT s.*,
              COALESCE((SELECT o.id FROM ${schema.outbox} o WHERE o.stripe_identifier = s.identifier),
                       (SELECT o.id FROM ${schema.outbox} o WHERE o.idempotency_key = s.identifier AND o.stripe_identifier IS NULL
                           AND o.first_attempted_at IS NOT NULL)) AS row_id,
              (SELECT o.id FROM ${schema.outbox} o WHERE o.idempotency_key = s.identifier AND o.identifier_revision > 0) AS key_id
         FROM s
     ), marked AS (
       UPDATE ${schema.outbox} o
          SET status = 'rejected_async', rejected_at = now(), last_error_code = f.code,
              last_error_message = f.message, claim_id = NULL, processing_deadline = NULL, updated_at = now()
         FROM found f
        WHERE o.id = f.row_id AND o.status = ANY($4::text[])
       RETURNING o.id
     )
     SELECT f.identifier, o.idempotency_key AS key,
            CASE WHEN f.row_id IS NULL AND o.id IS NOT NULL THEN 'superseded' ELSE o.status END AS status_before,
            o.tenant_id, (m.id IS NOT NULL) AS marked
       FROM found f
       LEFT JOIN ${schema.outbox} o ON o.id = COALESCE(f.row_id, f.key_id)
       LEFT JOIN marked m ON m.id = f.row_id`,
    [samples.map((s) => s.identifier), samples.map((s) => s.code), samples.map((s) => s.message.slice(0, 1000)), [...REJECTABLE]],
  );
  return rows;
}

export interface ErrorReportTotals {
  reports: number;
  error_count: number;
  matched: number;
  unmatched: number;
  last_received_at: Date | null;
}

export async function errorReportTotals(db: Queryable, schema: Schema): Promise<ErrorReportTotals> {
  const { rows } = await db.query<ErrorReportTotals>(
    `SELECT count(*) AS reports, COALESCE(sum(error_count), 0)::bigint AS error_count,
            COALESCE(sum(matched), 0)::bigint AS matched, COALESCE(sum(unmatched), 0)::bigint AS unmatched,
            max(received_at) AS last_received_at
       FROM ${schema.stripeErrorReports}`,
  );
  return rows[0]!;
}

export interface RejectedRow extends Omit<EntryRow, 'status'> {
  sent_at: Date | null;
  rejected_at: Date | null;
  last_error_code: string | null;
  last_error_message: string | null;
}

/** Rows Stripe accepted and then rejected, oldest rejection first. */
export async function listRejectedAsync(db: Queryable, schema: Schema, opts: { tenantId?: string | undefined; limit: number }): Promise<RejectedRow[]> {
  const { rows } = await db.query<RejectedRow>(
    `SELECT id, idempotency_key, tenant_id, event_name, quantity, occurred_at, sent_at, rejected_at, last_error_code, last_error_message
       FROM ${schema.outbox}
      WHERE status = 'rejected_async' AND ($1::text IS NULL OR tenant_id = $1::text)
      ORDER BY rejected_at, id
      LIMIT $2::int`,
    [opts.tenantId ?? null, opts.limit],
  );
  return rows;
}

export async function countRejectedAsync(db: Queryable, schema: Schema, opts: { tenantId?: string | undefined }): Promise<number> {
  const { rows } = await db.query<{ count: number }>(
    `SELECT count(*) AS count FROM ${schema.outbox} WHERE status = 'rejected_async' AND ($1::text IS NULL OR tenant_id = $1::text)`,
    [opts.tenantId ?? null],
  );
  return rows[0]!.count;
}

/** Whether an error-report event was already processed (a redelivery needs no call to Stripe). */
export async function errorReportExists(db: Queryable, schema: Schema, eventId: string): Promise<boolean> {
  const { rows } = await db.query(`SELECT 1 FROM ${schema.stripeErrorReports} WHERE event_id = $1::text`, [eventId]);
  return rows.length > 0;
}
