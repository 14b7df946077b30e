/**
 * Every statement on the outbox, one named function each (the pg-boss way): the relay's claim, the
 * workflow's bookkeeping, the enqueue. Values always travel as typed parameters, never as SQL text.
 */
import type { Queryable } from './db.js';

export interface ClaimedRow {
  id: number;
  idempotency_key: string;
  tenant_id: string;
}

/**
 * Claims up to `limit` rows, oldest first, for one relay.
 *
 * Design: a CTE that picks candidates with `FOR UPDATE SKIP LOCKED` (concurrent claimers never see
 * each other's candidates and never wait on each other), then an `UPDATE … RETURNING` guarded by
 * the same "still claimable" condition, so a row is only ever taken while it is pending or its
 * previous lease has lapsed. One round trip per batch.
 * Rejected: a plain `UPDATE … WHERE id IN (SELECT … LIMIT n)` without SKIP LOCKED (claimers queue
 * behind each other's row locks and then find nothing: measured throughput collapses with 8
 * claimers); advisory locks per row (one lock call per row, and the locks outlive a crashed
 * session only until its connection drops, which hides nothing the lease does not already cover).
 * The partial index `outbox_claimable_idx` keeps the scan proportional to claimable rows, not to
 * the millions of sent ones (test/claim.test.ts checks the plan).
 */
export async function claimBatch(
  db: Queryable,
  opts: { limit: number; claimedBy: string; claimId: string; leaseMs: number },
): Promise<ClaimedRow[]> {
  const { rows } = await db.query<ClaimedRow>(
    `WITH candidates AS (
       SELECT id FROM outbox
       WHERE status IN ('pending', 'claimed') AND (status = 'pending' OR processing_deadline < now())
       ORDER BY id
       LIMIT $1::int
       FOR UPDATE SKIP LOCKED
     )
     UPDATE outbox o
        SET status = 'claimed', claimed_by = $2::text, claim_id = $3::uuid,
            processing_deadline = clock_timestamp() + $4::int * interval '1 millisecond', updated_at = now()
       FROM candidates c
      WHERE o.id = c.id
        AND (o.status = 'pending' OR (o.status = 'claimed' AND o.processing_deadline < now()))
     RETURNING o.id, o.idempotency_key, o.tenant_id`,
    [opts.limit, opts.claimedBy, opts.claimId, opts.leaseMs],
  );
  return rows;
}

/** Marks rows dispatched, only while they are still held by this claim. Returns how many were. */
export async function markDispatched(db: Queryable, ids: number[], claimId: string): Promise<number> {
  if (ids.length === 0) return 0;
  const result = await db.query(
    `UPDATE outbox
        SET status = 'dispatched', dispatched_at = now(), workflow_id = idempotency_key,
            claim_id = NULL, processing_deadline = NULL, updated_at = now()
      WHERE id = ANY($1::bigint[]) AND status = 'claimed' AND claim_id = $2::uuid`,
    [ids, claimId],
  );
  return result.rowCount ?? 0;
}

export interface AttemptRow {
  status: string;
  attempt_count: number;
  event_name: string;
  quantity: number;
  occurred_at: Date;
  first_attempted_at: Date;
  stripe_customer_id: string | null;
  /** When the row was committed: the start of the commit-to-acknowledgement latency. */
  created_at: Date;
}

/**
 * Starts one delivery attempt: counts it (unless the row is already sent), stamps the first
 * attempt time, and reads what to send, in one statement. Takes nothing (returns undefined) when
 * the row is missing or when its first attempt is older than `safeWindowMs` and `force` is off:
 * resending then could be billed twice, so it is not even counted as an attempt.
 */
export async function beginAttempt(
  db: Queryable,
  key: string,
  opts: { workflowId: string; safeWindowMs: number; force: boolean },
): Promise<AttemptRow | undefined> {
  const { rows } = await db.query<AttemptRow>(
    `UPDATE outbox o
        SET attempt_count = o.attempt_count + CASE WHEN o.status IN ('sent', 'rejected_async', 'cancelled') THEN 0 ELSE 1 END,
            first_attempted_at = COALESCE(o.first_attempted_at, now()),
            workflow_id = COALESCE(o.workflow_id, $2::text),
            updated_at = now()
      WHERE o.idempotency_key = $1::text
        AND (o.status IN ('sent', 'rejected_async', 'cancelled') OR $4::boolean OR o.first_attempted_at IS NULL
             OR o.first_attempted_at > now() - $3::bigint * interval '1 millisecond')
      RETURNING o.status, o.attempt_count, o.event_name, o.quantity, o.occurred_at, o.first_attempted_at, o.created_at,
                (SELECT c.stripe_customer_id FROM billing_customers c WHERE c.tenant_id = o.tenant_id) AS stripe_customer_id`,
    [key, opts.workflowId, opts.safeWindowMs, opts.force],
  );
  return rows[0];
}

export interface OutboxRow extends EntryRow {
  attempt_count: number;
  last_error_code: string | null;
  last_error_message: string | null;
  claimed_by: string | null;
  processing_deadline: Date | null;
  workflow_id: string | null;
  first_attempted_at: Date | null;
  created_at: Date;
  dispatched_at: Date | null;
  sent_at: Date | null;
  dead_at: Date | null;
}

export async function findRowByKey(db: Queryable, key: string): Promise<OutboxRow | undefined> {
  const { rows } = await db.query<OutboxRow>('SELECT * FROM outbox WHERE idempotency_key = $1::text', [key]);
  return rows[0];
}

/** Stores the error of a failed attempt on the row, so listings show why it is retrying. */
export async function recordAttemptError(db: Queryable, key: string, code: string, message: string): Promise<void> {
  await db.query(
    `UPDATE outbox SET last_error_code = $2::text, last_error_message = $3::text, updated_at = now()
      WHERE idempotency_key = $1::text AND status NOT IN ('sent', 'rejected_async', 'cancelled')`,
    [key, code, message.slice(0, 1000)],
  );
}

export async function markSent(db: Queryable, key: string): Promise<number> {
  const { rows } = await db.query<{ attempt_count: number }>(
    `UPDATE outbox
        SET status = 'sent', sent_at = COALESCE(sent_at, now()), last_error_code = NULL, last_error_message = NULL,
            claim_id = NULL, processing_deadline = NULL, dead_at = NULL, updated_at = now()
      WHERE idempotency_key = $1::text AND status NOT IN ('rejected_async', 'cancelled')
      RETURNING attempt_count`,
    [key],
  );
  return rows[0]?.attempt_count ?? 0;
}

/** The row becomes a dead letter carrying its final error. A sent row is never made dead. */
export async function markDead(db: Queryable, key: string, code: string, message: string): Promise<number> {
  const { rows } = await db.query<{ attempt_count: number }>(
    `UPDATE outbox
        SET status = 'dead', dead_at = now(), last_error_code = $2::text, last_error_message = $3::text,
            claim_id = NULL, processing_deadline = NULL, updated_at = now()
      WHERE idempotency_key = $1::text AND status NOT IN ('sent', 'rejected_async', 'cancelled')
      RETURNING attempt_count`,
    [key, code, message.slice(0, 1000)],
  );
  return rows[0]?.attempt_count ?? 0;
}

/** An operator asked for another try: the dead letter is back in flight. */
export async function markRetrying(db: Queryable, key: string): Promise<void> {
  await db.query(
    `UPDATE outbox SET status = 'dispatched', dead_at = NULL, updated_at = now()
      WHERE idempotency_key = $1::text AND status = 'dead'`,
    [key],
  );
}

export interface EntryRow {
  id: number;
  idempotency_key: string;
  tenant_id: string;
  event_name: string;
  quantity: number;
  occurred_at: Date;
  status: string;
}

const ENTRY_COLUMNS = 'id, idempotency_key, tenant_id, event_name, quantity, occurred_at, status';

/**
 * Writes the usage row and its outbox row, in one round trip, inside the caller's transaction.
 * Written so that no input can raise an error inside that transaction (which would abort it): an
 * unknown tenant inserts nothing, a duplicate hits ON CONFLICT DO NOTHING, and the result says
 * which happened.
 */
export async function insertUsage(
  db: Queryable,
  usage: { usageId: string; tenantId: string; eventName: string; quantity: number; occurredAt: Date | null; key: string },
): Promise<{ tenantKnown: boolean; row: EntryRow | undefined }> {
  const { rows } = await db.query<Partial<EntryRow> & { tenant_known: boolean }>(
    `WITH tenant AS (
       SELECT tenant_id FROM billing_customers WHERE tenant_id = $2::text
     ), usage AS (
       INSERT INTO usage_logs (id, tenant_id, event_name, quantity, occurred_at)
       SELECT $1::text, tenant_id, $3::text, $4::bigint, COALESCE($5::timestamptz, now()) FROM tenant
       ON CONFLICT (id) DO NOTHING
       RETURNING id, tenant_id, event_name, quantity, occurred_at
     ), queued AS (
       INSERT INTO outbox (tenant_id, event_name, quantity, occurred_at, idempotency_key)
       SELECT tenant_id, event_name, quantity, occurred_at, $6::text FROM usage
       ON CONFLICT (idempotency_key) DO NOTHING
       RETURNING ${ENTRY_COLUMNS}
     )
     SELECT EXISTS (SELECT 1 FROM tenant) AS tenant_known, q.*
     FROM (SELECT 1) AS one LEFT JOIN queued q ON true`,
    [usage.usageId, usage.tenantId, usage.eventName, usage.quantity, usage.occurredAt, usage.key],
  );
  const row = rows[0]!;
  return { tenantKnown: row.tenant_known, row: row.id == null ? undefined : (row as EntryRow) };
}

export async function findEntryByKey(db: Queryable, key: string): Promise<EntryRow | undefined> {
  const { rows } = await db.query<EntryRow>(`SELECT ${ENTRY_COLUMNS} FROM outbox WHERE idempotency_key = $1::text`, [key]);
  return rows[0];
}

export interface StatusSummary {
  pending: number;
  claimed: number;
  dispatched: number;
  dead: number;
  sent: number;
  /** True when `sent` is the planner's estimate rather than a count. */
  sent_estimated: boolean;
  /** Age of the oldest row still waiting for a relay (pending or claimed); 0 when there is none. */
  oldest_pending_age_seconds: number;
}

/**
 * Outbox health for the metrics scrape, in one statement, without touching the sent rows.
 *
 * - Unsent rows (pending, claimed, dispatched, dead) are counted exactly, in one pass over the
 *   partial index `outbox_status_idx` (status <> 'sent'): its size follows the backlog and the dead
 *   letters, not the table.
 * - Sent rows are nearly the whole table and grow without bound; counting them exactly is a full
 *   scan on every scrape (seconds with tens of millions of rows). Once the table's estimated size
 *   reaches `exactCountBelow` rows, `sent` = estimated table rows − unsent rows, where the estimate
 *   is the planner's own: pg_class.reltuples (refreshed by autovacuum/ANALYZE) scaled by the
 *   table's current size in pages, so it follows growth between analyses. Below that size (or
 *   when the table was never analysed: reltuples = -1) they are counted exactly. The exact count
 *   sits in a CASE branch, so PostgreSQL never runs it when the estimate is used.
 * - The oldest waiting row is the first entry of `outbox_claimable_idx` (ids follow commit order
 *   closely enough for an age): one index probe, not a sort.
 */
export async function statusSummary(db: Queryable, opts: { exactCountBelow?: number } = {}): Promise<StatusSummary> {
  const { rows } = await db.query<StatusSummary>(
    `WITH unsent AS (
       SELECT count(*) FILTER (WHERE status = 'pending')    AS pending,
              count(*) FILTER (WHERE status = 'claimed')    AS claimed,
              count(*) FILTER (WHERE status = 'dispatched') AS dispatched,
              count(*) FILTER (WHERE status = 'dead')       AS dead,
              count(*)                                      AS total
         FROM outbox WHERE status <> 'sent'
     ), size AS (
       SELECT CASE WHEN c.reltuples < 0 THEN -1
                   WHEN c.relpages = 0 THEN c.reltuples
                   ELSE c.reltuples / c.relpages * (pg_relation_size(c.oid) / current_setting('block_size')::float8)
              END AS estimate
         FROM pg_class c WHERE c.oid = 'outbox'::regclass
     )
     SELECT u.pending, u.claimed, u.dispatched, u.dead,
            CASE WHEN s.estimate < $1::float8
                 THEN (SELECT count(*) FROM outbox WHERE status = 'sent')
                 ELSE greatest(0, round(s.estimate) - u.total)::bigint
            END AS sent,
            s.estimate >= $1::float8 AS sent_estimated,
            COALESCE((SELECT extract(epoch FROM now() - o.created_at)::float8
                        FROM outbox o WHERE o.status IN ('pending', 'claimed') ORDER BY o.id LIMIT 1), 0) AS oldest_pending_age_seconds
       FROM unsent u, size s`,
    [opts.exactCountBelow ?? 100_000],
  );
  return rows[0]!;
}

// ---- Operator CLI (src/cli/) ----------------------------------------------------------------------

export interface RecentlySent {
  last_minute: number;
  last_hour: number;
}

/**
 * Events sent in the minute and the hour before `at`. Scans the rows sent in the last hour: there
 * is no index on sent_at (the hot path pays for every index; an operator command can afford this).
 * Counts, age and backlog come from `statusSummary`.
 */
export async function countRecentlySent(db: Queryable, at: Date): Promise<RecentlySent> {
  const { rows } = await db.query<RecentlySent>(
    `SELECT count(*) FILTER (WHERE sent_at > $1::timestamptz - interval '1 minute') AS last_minute,
            count(*) AS last_hour
       FROM outbox WHERE sent_at > $1::timestamptz - interval '1 hour'`,
    [at],
  );
  return rows[0]!;
}

/** Rows in one status (`dead`, `rejected_async`) grouped by their last error code, most first. */
export async function countByErrorCode(db: Queryable, status: 'dead' | 'rejected_async'): Promise<{ code: string | null; count: number }[]> {
  const { rows } = await db.query<{ code: string | null; count: number }>(
    `SELECT last_error_code AS code, count(*) AS count FROM outbox WHERE status = $1::text
      GROUP BY last_error_code ORDER BY count(*) DESC, last_error_code`,
    [status],
  );
  return rows;
}

/** An outbox row as the operator sees it, with the Stripe customer its tenant is billed as. */
export interface OperatorRow {
  id: number;
  idempotency_key: string;
  tenant_id: string;
  status: string;
  attempt_count: number;
  last_error_code: string | null;
  last_error_message: string | null;
  occurred_at: Date;
  created_at: Date;
  first_attempted_at: Date | null;
  dead_at: Date | null;
  stripe_customer_id: string | null;
}

const OPERATOR_COLUMNS = `o.id, o.idempotency_key, o.tenant_id, o.status, o.attempt_count, o.last_error_code,
  o.last_error_message, o.occurred_at, o.created_at, o.first_attempted_at, o.dead_at,
  (SELECT c.stripe_customer_id FROM billing_customers c WHERE c.tenant_id = o.tenant_id) AS stripe_customer_id`;

export interface DeadLetterFilter {
  tenantId?: string | undefined;
  errorCode?: string | undefined;
}

/**
 * One page of dead letters after `afterId`, oldest first. Keyset paging (not OFFSET): a bulk retry
 * moves rows out of `dead` while it pages, which would make OFFSET skip rows, and each page costs
 * the same however deep it is.
 */
export async function listDeadLetters(
  db: Queryable,
  opts: DeadLetterFilter & { afterId: number; limit: number },
): Promise<OperatorRow[]> {
  const { rows } = await db.query<OperatorRow>(
    `SELECT ${OPERATOR_COLUMNS} FROM outbox o
      WHERE o.status = 'dead' AND o.id > $1::bigint
        AND ($2::text IS NULL OR o.tenant_id = $2::text)
        AND ($3::text IS NULL OR o.last_error_code = $3::text)
      ORDER BY o.id
      LIMIT $4::int`,
    [opts.afterId, opts.tenantId ?? null, opts.errorCode ?? null, opts.limit],
  );
  return rows;
}

export async function countDeadLetters(db: Queryable, filter: DeadLetterFilter): Promise<number> {
  const { rows } = await db.query<{ count: number }>(
    `SELECT count(*) AS count FROM outbox
      WHERE status = 'dead' AND ($1::text IS NULL OR tenant_id = $1::text) AND ($2::text IS NULL OR last_error_code = $2::text)`,
    [filter.tenantId ?? null, filter.errorCode ?? null],
  );
  return rows[0]!.count;
}

export async function findOperatorRow(db: Queryable, key: string): Promise<OperatorRow | undefined> {
  const { rows } = await db.query<OperatorRow>(`SELECT ${OPERATOR_COLUMNS} FROM outbox o WHERE o.idempotency_key = $1::text`, [key]);
  return rows[0];
}

/**
 * Takes a dead letter back in flight before an operator starts a new workflow run for it. The
 * `status = 'dead'` guard is the lock: of two operators reopening the same event at once, the
 * second one's UPDATE re-checks the row after the first commits, finds it dispatched, and returns
 * nothing, so only one of them goes on to start a run. A sent row can never match. Returns the
 * previous dead_at, for `restoreDeadLetter` if the start fails.
 */
export async function reopenDeadLetter(db: Queryable, key: string): Promise<{ tenant_id: string; previous_dead_at: Date | null } | undefined> {
  const { rows } = await db.query<{ tenant_id: string; previous_dead_at: Date | null }>(
    `WITH prev AS (
       SELECT id, dead_at FROM outbox WHERE idempotency_key = $1::text AND status = 'dead' FOR UPDATE
     )
     UPDATE outbox o
        SET status = 'dispatched', dispatched_at = now(), dead_at = NULL,
            workflow_id = COALESCE(o.workflow_id, o.idempotency_key), updated_at = now()
       FROM prev
      WHERE o.id = prev.id AND o.status = 'dead'
     RETURNING o.tenant_id, prev.dead_at AS previous_dead_at`,
    [key],
  );
  return rows[0];
}

/** Undoes `reopenDeadLetter` when no run could be started: the row is a dead letter again. */
export async function restoreDeadLetter(db: Queryable, key: string, deadAt: Date | null): Promise<boolean> {
  const result = await db.query(
    `UPDATE outbox SET status = 'dead', dead_at = COALESCE($2::timestamptz, now()), updated_at = now()
      WHERE idempotency_key = $1::text AND status = 'dispatched'`,
    [key, deadAt],
  );
  return (result.rowCount ?? 0) > 0;
}

export interface BillingCustomerRow {
  tenant_id: string;
  stripe_customer_id: string;
  created_at: Date;
  updated_at: Date;
}

/** Maps a tenant to its Stripe customer (insert or replace); also returns the customer it replaced. */
export async function upsertBillingCustomer(
  db: Queryable,
  tenantId: string,
  stripeCustomerId: string,
): Promise<BillingCustomerRow & { previous_customer_id: string | null }> {
  const { rows } = await db.query<BillingCustomerRow & { previous_customer_id: string | null }>(
    `WITH prev AS (SELECT stripe_customer_id FROM billing_customers WHERE tenant_id = $1::text)
     INSERT INTO billing_customers (tenant_id, stripe_customer_id) VALUES ($1::text, $2::text)
     ON CONFLICT (tenant_id) DO UPDATE SET stripe_customer_id = EXCLUDED.stripe_customer_id, updated_at = now()
     RETURNING tenant_id, stripe_customer_id, created_at, updated_at, (SELECT stripe_customer_id FROM prev) AS previous_customer_id`,
    [tenantId, stripeCustomerId],
  );
  return rows[0]!;
}

export async function listBillingCustomers(db: Queryable): Promise<BillingCustomerRow[]> {
  const { rows } = await db.query<BillingCustomerRow>(
    'SELECT tenant_id, stripe_customer_id, created_at, updated_at FROM billing_customers ORDER BY tenant_id',
  );
  return rows;
}

export interface OperatorAction {
  actor: string;
  action: 'retry' | 'customers.set' | 'cancel';
  key: string | null;
  tenantId: string | null;
  forced: boolean;
  outcome: string;
  detail: string | null;
}

export async function recordOperatorAction(db: Queryable, a: OperatorAction): Promise<void> {
  await db.query(
    `INSERT INTO operator_actions (actor, action, idempotency_key, tenant_id, forced, outcome, detail)
     VALUES ($1::text, $2::text, $3::text, $4::text, $5::boolean, $6::text, $7::text)`,
    [a.actor.slice(0, 200), a.action, a.key, a.tenantId, a.forced, a.outcome, a.detail?.slice(0, 2000) ?? null],
  );
}

export interface OperatorActionRow {
  at: Date;
  actor: string;
  action: string;
  forced: boolean;
  outcome: string;
  detail: string | null;
}

/** The most recent operator actions on one event, newest first. */
export async function listOperatorActions(db: Queryable, key: string, limit: number): Promise<OperatorActionRow[]> {
  const { rows } = await db.query<OperatorActionRow>(
    `SELECT at, actor, action, forced, outcome, detail FROM operator_actions
      WHERE idempotency_key = $1::text ORDER BY at DESC, id DESC LIMIT $2::int`,
    [key, limit],
  );
  return rows;
}

// ---- Stripe's asynchronous error reports (src/api/webhooks.ts) -------------------------------------

/**
 * Claims one error-report event for processing. The event id is the primary key, so of two
 * deliveries of the same event (Stripe redelivers, possibly concurrently) only the first inserts;
 * the second waits on the first's uncommitted row and then finds it. Returns false for a redelivery.
 */
export async function insertErrorReport(
  db: Queryable,
  report: { eventId: string; meterId: string | null; errorCount: number; report: unknown },
): Promise<boolean> {
  const result = await db.query(
    `INSERT INTO stripe_error_reports (event_id, meter_id, error_count, report)
     VALUES ($1::text, $2::text, $3::int, $4::jsonb)
     ON CONFLICT (event_id) DO NOTHING`,
    [report.eventId, report.meterId, report.errorCount, JSON.stringify(report.report)],
  );
  return (result.rowCount ?? 0) > 0;
}

export async function finishErrorReport(db: Queryable, eventId: string, counts: { matched: number; unmatched: number }): Promise<void> {
  await db.query('UPDATE stripe_error_reports SET matched = $2::int, unmatched = $3::int WHERE event_id = $1::text', [
    eventId,
    counts.matched,
    counts.unmatched,
  ]);
}

export interface RejectedSample {
  key: string;
  code: string;
  message: string;
}

export interface RejectedSampleResult {
  key: string;
  /** Null when no outbox row has this key. */
  status_before: string | null;
  tenant_id: string | null;
  /** True when the row was `sent` and is now `rejected_async`. */
  marked: boolean;
}

/**
 * Marks the rows Stripe named in an error report `rejected_async`, while they are `sent`, or
 * `dispatched` (Stripe accepted the call but our `markSent` has not run yet; it will leave the
 * rejection alone). Cancelled or already rejected rows are left alone. Says for every
 * sample what its row was. One statement: the outer SELECT reads the rows as they were before the
 * UPDATE (a data-modifying CTE's effects are invisible to the rest of its statement).
 */
export async function markRejectedAsync(db: Queryable, samples: RejectedSample[]): Promise<RejectedSampleResult[]> {
  if (samples.length === 0) return [];
  const { rows } = await db.query<RejectedSampleResult>(
    `WITH s AS (
       SELECT * FROM unnest($1::text[], $2::text[], $3::text[]) AS s(key, code, message)
     ), marked AS (
       UPDATE outbox o
          SET status = 'rejected_async', rejected_at = now(), last_error_code = s.code,
              last_error_message = s.message, updated_at = now()
         FROM s
        WHERE o.idempotency_key = s.key AND o.status IN ('sent', 'dispatched')
       RETURNING o.idempotency_key
     )
     SELECT s.key, o.status AS status_before, o.tenant_id, (m.idempotency_key IS NOT NULL) AS marked
       FROM s
       LEFT JOIN outbox o ON o.idempotency_key = s.key
       LEFT JOIN marked m ON m.idempotency_key = s.key`,
    [samples.map((s) => s.key), samples.map((s) => s.code), samples.map((s) => s.message.slice(0, 1000))],
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

export async function errorReportTotals(db: Queryable): Promise<ErrorReportTotals> {
  const { rows } = await db.query<ErrorReportTotals>(
    `SELECT count(*) AS reports, COALESCE(sum(error_count), 0)::bigint AS error_count,
            COALESCE(sum(matched), 0)::bigint AS matched, COALESCE(sum(unmatched), 0)::bigint AS unmatched,
            max(received_at) AS last_received_at
       FROM stripe_error_reports`,
  );
  return rows[0]!;
}

/**
 * The two statuses `statusSummary` leaves out, counted exactly on the partial index
 * `outbox_status_idx` (status <> 'sent'), like the other unsent statuses.
 */
export async function countRejectedAndCancelled(db: Queryable): Promise<{ rejected_async: number; cancelled: number }> {
  const { rows } = await db.query<{ rejected_async: number; cancelled: number }>(
    `SELECT count(*) FILTER (WHERE status = 'rejected_async') AS rejected_async,
            count(*) FILTER (WHERE status = 'cancelled')      AS cancelled
       FROM outbox WHERE status <> 'sent' AND status IN ('rejected_async', 'cancelled')`,
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
export async function listRejectedAsync(db: Queryable, opts: { tenantId?: string | undefined; limit: number }): Promise<RejectedRow[]> {
  const { rows } = await db.query<RejectedRow>(
    `SELECT id, idempotency_key, tenant_id, event_name, quantity, occurred_at, sent_at, rejected_at, last_error_code, last_error_message
       FROM outbox
      WHERE status = 'rejected_async' AND ($1::text IS NULL OR tenant_id = $1::text)
      ORDER BY rejected_at, id
      LIMIT $2::int`,
    [opts.tenantId ?? null, opts.limit],
  );
  return rows;
}

export async function countRejectedAsync(db: Queryable, opts: { tenantId?: string | undefined }): Promise<number> {
  const { rows } = await db.query<{ count: number }>(
    `SELECT count(*) AS count FROM outbox WHERE status = 'rejected_async' AND ($1::text IS NULL OR tenant_id = $1::text)`,
    [opts.tenantId ?? null],
  );
  return rows[0]!.count;
}

// ---- Reconciliation (src/reconcile.ts) ---------------------------------------------------------------

export interface ReconcileWindowRow {
  stripe_customer_id: string;
  event_name: string;
  /** Tenants billed as this customer that have rows in the window. */
  tenant_ids: string[];
  /** Unix seconds of the hour the rows' occurred_at falls in (Stripe's meter-event timestamp). */
  window_start: number;
  /** What Stripe should count: the quantities of `sent` rows. */
  sent_quantity: number;
  sent_count: number;
  /** Rows Stripe may or may not hold (pending, claimed, dispatched, dead). */
  unsettled_count: number;
  /** Rows Stripe must not count (rejected_async, cancelled). */
  excluded_count: number;
}

/**
 * Our side of a reconciliation: per (Stripe customer, event name, hour of occurred_at), the sum of
 * the `sent` quantities, and how many rows of each other kind fall in the hour. Grouped by Stripe
 * customer, not tenant, because Stripe's summaries are per customer: two tenants billed as one
 * customer are compared together. With a tenant, every customer that tenant is billed as.
 *
 * There is no index on occurred_at (the hot path pays for every index). A sent row's sent_at is at
 * most 5 minutes before its occurred_at (Stripe refuses timestamps further ahead), so
 * `sent_at >= from - 1 hour` (a margin for clock skew) selects the same sent rows and lets
 * PostgreSQL start from `outbox_sent_at_idx` instead of reading the whole table; the other rows come
 * from `outbox_status_idx`.
 */
export async function reconcileWindows(
  db: Queryable,
  opts: { from: Date; to: Date; tenantId?: string | undefined },
): Promise<ReconcileWindowRow[]> {
  const { rows } = await db.query<ReconcileWindowRow>(
    `SELECT c.stripe_customer_id, o.event_name, array_agg(DISTINCT o.tenant_id ORDER BY o.tenant_id) AS tenant_ids,
            (floor(extract(epoch FROM o.occurred_at) / 3600) * 3600)::bigint AS window_start,
            COALESCE(sum(o.quantity) FILTER (WHERE o.status = 'sent'), 0)::bigint AS sent_quantity,
            count(*) FILTER (WHERE o.status = 'sent') AS sent_count,
            count(*) FILTER (WHERE o.status IN ('pending', 'claimed', 'dispatched', 'dead')) AS unsettled_count,
            count(*) FILTER (WHERE o.status IN ('rejected_async', 'cancelled')) AS excluded_count
       FROM outbox o
       JOIN billing_customers c ON c.tenant_id = o.tenant_id
      WHERE o.occurred_at >= $1::timestamptz AND o.occurred_at < $2::timestamptz
        AND (o.sent_at >= $1::timestamptz - interval '1 hour' OR o.status <> 'sent')
        AND ($3::text IS NULL OR c.stripe_customer_id IN (SELECT b.stripe_customer_id FROM billing_customers b WHERE b.tenant_id = $3::text))
      GROUP BY c.stripe_customer_id, o.event_name, window_start
      ORDER BY c.stripe_customer_id, o.event_name, window_start`,
    [opts.from, opts.to, opts.tenantId ?? null],
  );
  return rows;
}

export interface ReconcileEventRow {
  stripe_customer_id: string;
  event_name: string;
  window_start: number;
  idempotency_key: string;
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
 * per window (oldest first), so an operator can see which events make up a difference.
 */
export async function listWindowEvents(
  db: Queryable,
  windows: { stripeCustomerId: string; eventName: string; windowStart: number }[],
  perWindow: number,
): Promise<ReconcileEventRow[]> {
  if (windows.length === 0) return [];
  const { rows } = await db.query<ReconcileEventRow>(
    `WITH w AS (
       SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[]) AS w(stripe_customer_id, event_name, window_start)
     ), r AS (
       SELECT w.stripe_customer_id, w.event_name, w.window_start, o.idempotency_key, o.tenant_id, o.quantity, o.status,
              o.occurred_at, o.sent_at, o.last_error_code,
              row_number() OVER (PARTITION BY w.stripe_customer_id, w.event_name, w.window_start ORDER BY o.occurred_at, o.id) AS n,
              count(*) OVER (PARTITION BY w.stripe_customer_id, w.event_name, w.window_start) AS window_rows
         FROM w
         JOIN billing_customers c ON c.stripe_customer_id = w.stripe_customer_id
         JOIN outbox o ON o.tenant_id = c.tenant_id AND o.event_name = w.event_name
          AND o.occurred_at >= to_timestamp(w.window_start) AND o.occurred_at < to_timestamp(w.window_start + 3600)
     )
     SELECT stripe_customer_id, event_name, window_start, idempotency_key, tenant_id, quantity, status, occurred_at,
            sent_at, last_error_code, window_rows
       FROM r WHERE n <= $4::int
      ORDER BY stripe_customer_id, event_name, window_start, occurred_at, idempotency_key`,
    [windows.map((w) => w.stripeCustomerId), windows.map((w) => w.eventName), windows.map((w) => w.windowStart), perWindow],
  );
  return rows;
}

// ---- Cancellation (src/cli/commands/cancel.ts) -------------------------------------------------------

/**
 * After Stripe accepted the cancellation: the row stops counting as billed. Guarded by
 * `status = 'sent'` so a row that moved meanwhile (rejected by Stripe's later validation, or
 * cancelled by another operator) is not overwritten. Returns whether it was this call that did it.
 */
export async function markCancelled(db: Queryable, key: string): Promise<boolean> {
  const result = await db.query(
    `UPDATE outbox SET status = 'cancelled', cancelled_at = now(), updated_at = now()
      WHERE idempotency_key = $1::text AND status = 'sent'`,
    [key],
  );
  return (result.rowCount ?? 0) > 0;
}

export interface CancelCandidateRow {
  idempotency_key: string;
  tenant_id: string;
  event_name: string;
  quantity: number;
  status: string;
  occurred_at: Date;
  sent_at: Date | null;
  rejected_at: Date | null;
  cancelled_at: Date | null;
  last_error_code: string | null;
}

export async function findCancelCandidate(db: Queryable, key: string): Promise<CancelCandidateRow | undefined> {
  const { rows } = await db.query<CancelCandidateRow>(
    `SELECT idempotency_key, tenant_id, event_name, quantity, status, occurred_at, sent_at, rejected_at, cancelled_at, last_error_code
       FROM outbox WHERE idempotency_key = $1::text`,
    [key],
  );
  return rows[0];
}

/** Whether an error-report event was already processed (a redelivery needs no call to Stripe). */
export async function errorReportExists(db: Queryable, eventId: string): Promise<boolean> {
  const { rows } = await db.query('SELECT 1 FROM stripe_error_reports WHERE event_id = $1::text', [eventId]);
  return rows.length > 0;
}
