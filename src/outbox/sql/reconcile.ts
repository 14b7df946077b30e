/**
 * Our side of a reconciliation against Stripe's meter event summaries (src/ops/reconcile.ts).
 * One named function per statement; values always travel as typed parameters, never as SQL text.
 */
import type { Queryable } from '../../db.js';
import { DELIVERED, UNBILLED, UNSETTLED } from '../statuses.js';
import type { Schema } from './schema.js';


export interface ReconcileWindowRow {
  stripe_customer_id: string;
  event_name: string;
  /** Tenants billed as this customer that have rows in the window. */
  tenant_ids: string[];
  /** Unix seconds of the hour the rows' occurred_at falls in (Stripe's meter-event timestamp). */
  window_start: number;
  /** What Stripe should count: the quantities of delivered rows (`sent` and `accepted`). */
  sent_quantity: number;
  sent_count: number;
  /** Rows Stripe may or may not hold (pending, claimed, dispatched, dead). */
  unsettled_count: number;
  /** Rows Stripe must not count (rejected_async, cancelled). */
  excluded_count: number;
}

/**
 * Our side of a reconciliation: per (Stripe customer, event name, hour of occurred_at), the sum of
 * the delivered (`sent`, `accepted`) quantities, and how many rows of each other kind fall in the hour. Grouped by Stripe
 * customer, not tenant, because Stripe's summaries are per customer: two tenants billed as one
 * customer are compared together. A row's customer is the one its attempt named
 * (`billed_customer_id`: a tenant remapped since keeps its earlier usage with the earlier
 * customer), or, for a row never attempted, the tenant's mapping now. With a tenant, every
 * customer that tenant's rows in the range are billed as, and the one it maps to now.
 *
 * The sent rows are bounded by sent_at as well as occurred_at: a sent row's sent_at is at most 5
 * minutes before its occurred_at (Stripe refuses timestamps further ahead), so
 * `sent_at >= from - 1 hour` (a margin for clock skew) selects the same sent rows and lets
 * PostgreSQL start from `outbox_sent_at_idx` or `outbox_occurred_at_idx`, whichever it finds
 * narrower, instead of reading the whole table; the other rows come from `outbox_unsettled_idx`. At most `limit` windows, in order (null: all).
 */
export async function reconcileWindows(
  db: Queryable,
  schema: Schema,
  opts: { from: Date; to: Date; tenantId?: string | undefined; limit: number | null },
): Promise<ReconcileWindowRow[]> {
  const { rows } = await db.query<ReconcileWindowRow>(
    `WITH r AS (
       SELECT COALESCE(o.billed_customer_id, c.stripe_customer_id) AS stripe_customer_id, o.event_name, o.tenant_id,
              o.occurred_at, o.quantity, o.status
         FROM ${schema.outbox} o
         LEFT JOIN ${schema.billingCustomers} c ON c.tenant_id = o.tenant_id
        WHERE o.occurred_at >= $1::timestamptz AND o.occurred_at < $2::timestamptz
          AND (o.sent_at >= $1::timestamptz - interval '1 hour' OR o.status <> ALL($6::text[]))
     )
     SELECT r.stripe_customer_id, r.event_name, array_agg(DISTINCT r.tenant_id ORDER BY r.tenant_id) AS tenant_ids,
            (floor(extract(epoch FROM r.occurred_at) / 3600) * 3600)::bigint AS window_start,
            COALESCE(sum(r.quantity) FILTER (WHERE r.status = ANY($6::text[])), 0)::bigint AS sent_quantity,
            count(*) FILTER (WHERE r.status = ANY($6::text[])) AS sent_count,
            count(*) FILTER (WHERE r.status = ANY($4::text[])) AS unsettled_count,
            count(*) FILTER (WHERE r.status = ANY($5::text[])) AS excluded_count
       FROM r
      WHERE r.stripe_customer_id IS NOT NULL
        AND ($3::text IS NULL OR r.stripe_customer_id IN (
              SELECT t.stripe_customer_id FROM r t WHERE t.tenant_id = $3::text
              UNION SELECT b.stripe_customer_id FROM ${schema.billingCustomers} b WHERE b.tenant_id = $3::text))
      GROUP BY r.stripe_customer_id, r.event_name, window_start
      ORDER BY r.stripe_customer_id, r.event_name, window_start
      LIMIT $7::int`,
    [opts.from, opts.to, opts.tenantId ?? null, [...UNSETTLED], [...UNBILLED], [...DELIVERED], opts.limit],
  );
  return rows;
}

export interface ReconcileEventRow {
  stripe_customer_id: string;
  event_name: string;
  window_start: number;
  idempotency_key: string;
  /** The identifier Stripe got for the row's current revision (the stored one, or the key). */
  identifier: string;
  identifier_revision: number;
  tenant_id: string;
  quantity: number;
  status: string;
  occurred_at: Date;
  sent_at: Date | null;
  last_error_code: string | null;
  /** Rows of this window in all (the listing stops at `perWindow`). */
  window_rows: number;
}

/**
 * The rows of the given (customer, event name, hour) windows, every status, at most `perWindow`
 * per window (oldest first), so an operator can see which events make up a difference. A window's
 * rows are found through its tenants (reconcileWindows' `tenant_ids`), each row counted with the
 * customer reconcileWindows gave it.
 */
export async function listWindowEvents(
  db: Queryable,
  schema: Schema,
  windows: { stripeCustomerId: string; eventName: string; windowStart: number; tenantIds: string[] }[],
  perWindow: number,
): Promise<ReconcileEventRow[]> {
  const pairs = windows.flatMap((w) => w.tenantIds.map((tenantId) => ({ ...w, tenantId })));
  if (pairs.length === 0) return [];
  const { rows } = await db.query<ReconcileEventRow>(
    `WITH w AS (
       SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[], $4::text[]) AS w(stripe_customer_id, event_name, window_start, tenant_id)
     ), r AS (
       SELECT w.stripe_customer_id, w.event_name, w.window_start, o.idempotency_key,
              COALESCE(o.stripe_identifier, o.idempotency_key) AS identifier, o.identifier_revision, o.tenant_id, o.quantity, o.status,
              o.occurred_at, o.sent_at, o.last_error_code,
              row_number() OVER (PARTITION BY w.stripe_customer_id, w.event_name, w.window_start ORDER BY o.occurred_at, o.id) AS n,
              count(*) OVER (PARTITION BY w.stripe_customer_id, w.event_name, w.window_start) AS window_rows
         FROM w
         JOIN ${schema.outbox} o ON o.tenant_id = w.tenant_id AND o.event_name = w.event_name
          AND o.occurred_at >= to_timestamp(w.window_start) AND o.occurred_at < to_timestamp(w.window_start + 3600)
         LEFT JOIN ${schema.billingCustomers} c ON c.tenant_id = o.tenant_id
        WHERE COALESCE(o.billed_customer_id, c.stripe_customer_id) = w.stripe_customer_id
     )
     SELECT stripe_customer_id, event_name, window_start, idempotency_key, identifier, identifier_revision, tenant_id, quantity, status, occurred_at,
            sent_at, last_error_code, window_rows
       FROM r WHERE n <= $5::int
      ORDER BY stripe_customer_id, event_name, window_start, occurred_at, idempotency_key`,
    [pairs.map((p) => p.stripeCustomerId), pairs.map((p) => p.eventName), pairs.map((p) => p.windowStart), pairs.map((p) => p.tenantId), perWindow],
  );
  return rows;
}
