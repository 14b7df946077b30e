/**
 * The closed-run sweep's statements (src/ops/closed-runs.ts): dispatched rows that have not moved for
 * a while, and making one of them dead when its run turns out closed.
 * One named function per statement; values always travel as typed parameters, never as SQL text.
 */
import type { Queryable } from '../../db.js';
import type { Schema } from './schema.js';
import { firstAttemptStamp } from './delivery.js';

export interface DispatchedRow {
  id: number;
  idempotency_key: string;
}

/**
 * Up to `limit` dispatched rows after `afterId` (keyset: the sweep walks all of them in turn, not
 * the same oldest ones every time) not updated for `staleAfterMs`: a row just dispatched or reopened
 * may not have its run yet. Dispatched rows are bounded by the lanes (LANE_MAX_IN_FLIGHT each) and
 * read from the partial index of unsettled rows.
 */
export async function listStaleDispatched(db: Queryable, schema: Schema, opts: { afterId: number; staleAfterMs: number; limit: number }): Promise<DispatchedRow[]> {
  const { rows } = await db.query<DispatchedRow>(
    `SELECT id, idempotency_key FROM ${schema.outbox}
      WHERE status = 'dispatched' AND id > $1::bigint AND updated_at < now() - $2::int * interval '1 millisecond'
      ORDER BY id LIMIT $3::int`,
    [opts.afterId, opts.staleAfterMs, opts.limit],
  );
  return rows;
}

/**
 * A dispatched row whose run has closed (or waits as a dead letter): dead with the reason. Guarded by
 * the same staleness, so a row reopened (or delivered) since it was read is left alone. Wakes the
 * relays: its lane has room. `firstAttempt`: when the run may first have reached Stripe, and the
 * identifier it sent then (storedIdentifier), kept on a row that records no attempt (restored from
 * before it) as reopenDeadLetter keeps them: counted as an attempt, so a try taken back later does
 * not clear the stamp, and under that identifier, so a retry sends what the run sent.
 */
export async function markStaleDispatchedDead(
  db: Queryable,
  schema: Schema,
  id: number,
  opts: { staleAfterMs: number; code: string; message: string; firstAttempt?: { by: Date; identifier: string | null } },
): Promise<boolean> {
  const { rows } = await db.query(
    `WITH dead AS (
       UPDATE ${schema.outbox} o
          SET status = 'dead', dead_at = now(), last_error_code = $3::text, last_error_message = $4::text, updated_at = now(),
              ${firstAttemptStamp('o', '$6::timestamptz', '$7::text')}
        WHERE id = $1::bigint AND status = 'dispatched' AND updated_at < now() - $2::int * interval '1 millisecond'
        RETURNING id
     )
     SELECT pg_notify($5::text, '') FROM dead`,
    [id, opts.staleAfterMs, opts.code, opts.message.slice(0, 1000), schema.outboxChannel, opts.firstAttempt?.by ?? null, opts.firstAttempt?.identifier ?? null],
  );
  return rows.length > 0;
}
