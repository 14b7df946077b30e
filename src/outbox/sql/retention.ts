/**
 * Retention: delivered rows leave the outbox once they are older than any window that still needs
 * them. Only DELIVERED and cancelled rows go, by `sent_at` through `outbox_sent_at_idx`, in small
 * batches whose rows are taken with SKIP LOCKED: a batch never waits on a row someone else holds
 * and never blocks the relay's claim (which reads pending and claimed rows only). Dead, rejected
 * and unfinished rows are never pruned. The application's own usage_logs table is not touched: it
 * still answers a repeated usage id.
 */
import type { Queryable } from '../../db.js';
import { DELIVERED } from '../statuses.js';
import type { Schema } from './schema.js';

export const PRUNABLE = [...DELIVERED, 'cancelled'] as const;

/** Deletes one batch of prunable rows sent more than `olderThanMs` ago; returns how many went. */
export async function pruneBatch(db: Queryable, schema: Schema, opts: { olderThanMs: number; batchSize: number }): Promise<number> {
  const { rowCount } = await db.query({
    name: schema.statementName('prune'),
    text: `DELETE FROM ${schema.outbox} WHERE id IN (
             SELECT id FROM ${schema.outbox}
              WHERE sent_at < now() - make_interval(secs => $1::double precision / 1000)
                AND status = ANY($2::text[])
              ORDER BY sent_at
              LIMIT $3
                FOR UPDATE SKIP LOCKED)`,
    values: [opts.olderThanMs, PRUNABLE, opts.batchSize],
  });
  return rowCount ?? 0;
}

/** How many rows a prune would delete now (for `prune --dry-run`). */
export async function countPrunable(db: Queryable, schema: Schema, olderThanMs: number): Promise<number> {
  const { rows } = await db.query<{ n: string }>(
    `SELECT count(*) AS n FROM ${schema.outbox} WHERE sent_at < now() - make_interval(secs => $1::double precision / 1000) AND status = ANY($2::text[])`,
    [olderThanMs, PRUNABLE],
  );
  return Number(rows[0]!.n);
}

/**
 * (Customer, meter) leases and queue places that expired over `olderThanMs` ago: left by workers
 * that died holding or waiting for them. An expired lease is free to the next taker anyway; its row
 * only slows every look-up by holder, and the table grows with every crash. Returns how many went.
 */
export async function pruneExpiredLeases(db: Queryable, schema: Schema, olderThanMs: number): Promise<number> {
  const { rows } = await db.query<{ n: number }>({
    name: schema.statementName('prune-expired-leases'),
    text: `WITH leases AS (
             DELETE FROM ${schema.meterLeases} WHERE expires_at < now() - make_interval(secs => $1::double precision / 1000) RETURNING 1
           ), waiters AS (
             DELETE FROM ${schema.meterLeaseWaiters} WHERE expires_at < now() - make_interval(secs => $1::double precision / 1000) RETURNING 1
           )
           SELECT ((SELECT count(*) FROM leases) + (SELECT count(*) FROM waiters))::int AS n`,
    values: [olderThanMs],
  });
  return rows[0]!.n;
}
