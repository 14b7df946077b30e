/**
 * The relay's statements: claim a batch of outbox rows under a lease, and hand them to Temporal.
 * One named function per statement; values always travel as typed parameters, never as SQL text.
 */
import type { Queryable } from '../../db.js';
import { AWAITING_RELAY } from '../statuses.js';

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
 * the millions of sent ones (test/claim.test.ts checks the plan of this very statement). The
 * statuses arrive as a parameter, which pg plans with its value (an unnamed statement): the
 * planner then picks `outbox_claimable_idx` or `outbox_status_idx` (status <> 'sent'), both partial
 * and both sized by the backlog.
 */
export async function claimBatch(
  db: Queryable,
  opts: { limit: number; claimedBy: string; claimId: string; leaseMs: number },
): Promise<ClaimedRow[]> {
  const { rows } = await db.query<ClaimedRow>(
    `WITH candidates AS (
       SELECT id FROM outbox
       WHERE status = ANY($5::text[]) AND (status = 'pending' OR processing_deadline < now())
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
    [opts.limit, opts.claimedBy, opts.claimId, opts.leaseMs, [...AWAITING_RELAY]],
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
