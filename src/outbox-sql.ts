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
        SET attempt_count = o.attempt_count + CASE WHEN o.status = 'sent' THEN 0 ELSE 1 END,
            first_attempted_at = COALESCE(o.first_attempted_at, now()),
            workflow_id = COALESCE(o.workflow_id, $2::text),
            updated_at = now()
      WHERE o.idempotency_key = $1::text
        AND (o.status = 'sent' OR $4::boolean OR o.first_attempted_at IS NULL
             OR o.first_attempted_at > now() - $3::bigint * interval '1 millisecond')
      RETURNING o.status, o.attempt_count, o.event_name, o.quantity, o.occurred_at, o.first_attempted_at,
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
      WHERE idempotency_key = $1::text AND status <> 'sent'`,
    [key, code, message.slice(0, 1000)],
  );
}

export async function markSent(db: Queryable, key: string): Promise<number> {
  const { rows } = await db.query<{ attempt_count: number }>(
    `UPDATE outbox
        SET status = 'sent', sent_at = COALESCE(sent_at, now()), last_error_code = NULL, last_error_message = NULL,
            claim_id = NULL, processing_deadline = NULL, dead_at = NULL, updated_at = now()
      WHERE idempotency_key = $1::text
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
      WHERE idempotency_key = $1::text AND status <> 'sent'
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
