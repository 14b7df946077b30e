/**
 * What the outbox holds, for the metrics scrape and `billing-outbox status`.
 * One named function per statement; values always travel as typed parameters, never as SQL text.
 */
import type { Queryable } from '../../db.js';
import { AWAITING_RELAY, DELIVERED, OUTBOX_STATUSES, type OutboxStatus } from '../statuses.js';
import type { Schema } from './schema.js';

export interface StatusSummary {
  /** Rows per status; when `sentEstimated`, `sent` is the planner's estimate of sent and accepted rows together. */
  counts: Record<OutboxStatus, number>;
  sentEstimated: boolean;
  /** Age of the oldest row still waiting for a relay (pending or claimed); 0 when there is none. */
  oldestPendingAgeSeconds: number;
  /**
   * The dispatched row untouched longest (no attempt begun, failed or marked since): how long, and
   * its key; null when none is in flight. A run at work touches its row at every attempt.
   */
  longestIdleInFlight: { key: string; idleSeconds: number } | null;
}

/**
 * Outbox health for the metrics scrape and `status`, in one statement, without touching the sent
 * rows.
 *
 * - Rows in every status but the delivered ones (`sent`, `accepted`) are counted exactly,
 *   grouped, in one pass over the partial index `outbox_unsettled_idx`: its size follows the
 *   backlog, the dead letters and the rows Stripe rejected or we cancelled, not the table.
 * - Delivered rows are nearly the whole table and grow without bound; counting them exactly is a
 *   full scan on every scrape (seconds with tens of millions of rows). Once the table's estimated
 *   size reaches `exactCountBelow` rows, `sent` = estimated table rows − the other rows (`accepted`
 *   included in it, reported 0; `sentEstimated` says so), where the estimate is the planner's own:
 *   pg_class.reltuples (refreshed by autovacuum/ANALYZE) scaled by the table's current size in
 *   pages, so it follows growth between analyses. Below that size (or when the table was never
 *   analysed: reltuples = -1) both are counted exactly. The exact counts sit in a CASE branch, so
 *   PostgreSQL never runs them when the estimate is used.
 * - The dispatched row untouched longest: read from the dispatched rows alone (the partial index of
 *   unsettled rows), bounded by the lanes' in-flight limits.
 * - The oldest waiting row is the oldest of the lanes' first rows (ids follow commit order closely
 *   enough for an age), found as the claim finds them: a skip scan over `outbox_lane_idx`, one probe
 *   per lane with a backlog, not a sort of the backlog.
 */
export async function statusSummary(db: Queryable, schema: Schema, opts: { exactCountBelow?: number } = {}): Promise<StatusSummary> {
  const { rows } = await db.query<{ unsent: Record<string, number> | null; sent: number; accepted: number; sent_estimated: boolean; oldest: number; idle: { key: string; seconds: number } | null }>(
    `WITH RECURSIVE lanes AS (
       (SELECT o.tenant_id, o.event_name FROM ${schema.outbox} o
         WHERE o.status = ANY($2::text[]) ORDER BY o.tenant_id, o.event_name LIMIT 1)
       UNION ALL
       SELECT nxt.tenant_id, nxt.event_name
         FROM lanes l, LATERAL (
           SELECT o.tenant_id, o.event_name FROM ${schema.outbox} o
            WHERE o.status = ANY($2::text[]) AND (o.tenant_id, o.event_name) > (l.tenant_id, l.event_name)
            ORDER BY o.tenant_id, o.event_name LIMIT 1) nxt
     ), heads AS (
       SELECT h.id, h.created_at FROM lanes l, LATERAL (
         SELECT o.id, o.created_at FROM ${schema.outbox} o
          WHERE o.tenant_id = l.tenant_id AND o.event_name = l.event_name AND o.status = ANY($2::text[])
          ORDER BY o.tenant_id, o.event_name, o.id LIMIT 1) h
     ), unsent AS (
       SELECT status, count(*) AS n FROM ${schema.outbox} WHERE status <> ALL($3::text[]) GROUP BY status
     ), size AS (
       SELECT CASE WHEN c.reltuples < 0 THEN -1
                   WHEN c.relpages = 0 THEN c.reltuples
                   ELSE c.reltuples / c.relpages * (pg_relation_size(c.oid) / current_setting('block_size')::float8)
              END AS estimate
         FROM pg_class c WHERE c.oid = $4::text::regclass
     )
     SELECT (SELECT jsonb_object_agg(status, n) FROM unsent) AS unsent,
            CASE WHEN s.estimate < $1::float8
                 THEN (SELECT count(*) FROM ${schema.outbox} WHERE status = 'sent')
                 ELSE greatest(0, round(s.estimate) - (SELECT COALESCE(sum(n), 0) FROM unsent))::bigint
            END AS sent,
            CASE WHEN s.estimate < $1::float8 THEN (SELECT count(*) FROM ${schema.outbox} WHERE status = 'accepted') ELSE 0 END AS accepted,
            s.estimate >= $1::float8 AS sent_estimated,
            COALESCE((SELECT extract(epoch FROM now() - h.created_at)::float8 FROM heads h ORDER BY h.id LIMIT 1), 0) AS oldest,
            (SELECT jsonb_build_object('key', o.idempotency_key, 'seconds', greatest(0, extract(epoch FROM now() - o.updated_at))::float8)
               FROM ${schema.outbox} o WHERE o.status = 'dispatched' ORDER BY o.updated_at LIMIT 1) AS idle
       FROM size s`,
    [opts.exactCountBelow ?? 100_000, [...AWAITING_RELAY], [...DELIVERED], schema.outbox],
  );
  const r = rows[0]!;
  const counts = Object.fromEntries(OUTBOX_STATUSES.map((status) => [status, Number(r.unsent?.[status] ?? 0)])) as Record<OutboxStatus, number>;
  counts.sent = r.sent;
  counts.accepted = r.accepted;
  return { counts, sentEstimated: r.sent_estimated, oldestPendingAgeSeconds: r.oldest, longestIdleInFlight: r.idle && { key: r.idle.key, idleSeconds: Number(r.idle.seconds) } };
}

export interface RecentlySent {
  last_minute: number;
  last_hour: number;
}

/**
 * Events sent in the last minute and hour, from `outbox_sent_at_idx`, by PostgreSQL's clock (the
 * one that stamped `sent_at`; an operator's machine running fast would count none): `now()`, the
 * statement's own time here, which PostgreSQL can compare with the index (clock_timestamp() it
 * cannot: every row kept would be read). Counts, age and backlog come from `statusSummary`.
 */
export async function countRecentlySent(db: Queryable, schema: Schema): Promise<RecentlySent> {
  const { rows } = await db.query<RecentlySent>(
    `SELECT count(*) FILTER (WHERE sent_at > now() - interval '1 minute') AS last_minute,
            count(*) AS last_hour
       FROM ${schema.outbox} WHERE sent_at > now() - interval '1 hour'`,
  );
  return rows[0]!;
}

/**
 * Rows in one status grouped by their last error code, most first: dead letters and Stripe's later
 * rejections by why; events in flight (`dispatched`) by what their last attempt met.
 */
export async function countByErrorCode(db: Queryable, schema: Schema, status: Extract<OutboxStatus, 'dead' | 'rejected_async' | 'dispatched'>): Promise<{ code: string | null; count: number }[]> {
  const { rows } = await db.query<{ code: string | null; count: number }>(
    `SELECT last_error_code AS code, count(*) AS count FROM ${schema.outbox} WHERE status = $1::text
      GROUP BY last_error_code ORDER BY count(*) DESC, last_error_code`,
    [status],
  );
  return rows;
}

/**
 * Rows waiting for a relay whose last workflow start failed for a reason that may pass (code
 * `startFailing`, written by the relay, cleared by a successful start): never silent, even while
 * they are tried again. Read from the lanes' partial index (pending and claimed rows only).
 */
export async function countStartFailing(db: Queryable, schema: Schema, code: string): Promise<number> {
  const { rows } = await db.query<{ n: number }>(
    `SELECT count(*)::int AS n FROM ${schema.outbox} WHERE status = ANY($1::text[]) AND last_error_code = $2::text`,
    [[...AWAITING_RELAY], code],
  );
  return rows[0]!.n;
}
