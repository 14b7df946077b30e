/**
 * Pruning delivered rows past OUTBOX_RETENTION_DAYS, batch by batch, pausing between batches so
 * the hot path keeps the database. Run by every worker on a timer (SKIP LOCKED lets several run at
 * once) and by `billing-outbox prune`.
 */
import type { Queryable } from '../db.js';
import { countPrunable, pruneBatch, pruneExpiredLeases } from '../outbox/sql/retention.js';
import type { Schema } from '../outbox/sql/schema.js';

export { PRUNABLE } from '../outbox/sql/retention.js';

export interface PruneOptions {
  olderThanMs: number;
  batchSize?: number;
  /** Pause between batches (default 50 ms). */
  pauseMs?: number;
  /** Stops between batches when aborted. */
  signal?: AbortSignal;
  onBatch?: (deleted: number) => void;
}

/** A lease past its expiry by this much is no worker's: an hour is far beyond any call or hold. */
const LEASE_LEFTOVER_MS = 60 * 60_000;

/**
 * Prunes until a batch comes back short; returns the outbox rows deleted. Also removes the
 * (customer, meter) leases that crashed workers left behind, expired over an hour ago.
 */
export async function pruneDelivered(db: Queryable, schema: Schema, opts: PruneOptions): Promise<number> {
  const batchSize = opts.batchSize ?? 2_000;
  await pruneExpiredLeases(db, schema, LEASE_LEFTOVER_MS);
  let total = 0;
  for (;;) {
    if (opts.signal?.aborted) return total;
    const deleted = await pruneBatch(db, schema, { olderThanMs: opts.olderThanMs, batchSize });
    total += deleted;
    if (deleted > 0) opts.onBatch?.(deleted);
    if (deleted < batchSize) return total;
    await new Promise((r) => setTimeout(r, opts.pauseMs ?? 50));
  }
}

/** How many rows a prune would delete now (`prune --dry-run`). */
export async function countPrunableRows(db: Queryable, schema: Schema, olderThanMs: number): Promise<number> {
  return countPrunable(db, schema, olderThanMs);
}
