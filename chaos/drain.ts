/**
 * Waiting for the outbox to drain (no row waiting for a relay or in flight), read through the
 * product's own status summary: what a chaos run and the demo wait for before their check.
 */
import type { Queryable } from '../src/db.js';
import { statusSummary } from '../src/outbox/sql/status.js';
import { AWAITING_RELAY, IN_FLIGHT, type OutboxStatus } from '../src/outbox/statuses.js';
import { sleep } from './world.js';
import { schemaFor } from '../src/outbox/sql/schema.js';

const UNFINISHED: readonly OutboxStatus[] = [...new Set<OutboxStatus>([...AWAITING_RELAY, ...IN_FLIGHT])];

export interface OutboxProgress {
  counts: Record<OutboxStatus, number>;
  total: number;
  /** Rows waiting for a relay or in flight. */
  unfinished: number;
}

/** Rows per status, counted exactly (never the planner's estimate: these tables are small). */
export async function outboxProgress(db: Queryable): Promise<OutboxProgress> {
  const { counts } = await statusSummary(db, schemaFor(), { exactCountBelow: Number.MAX_SAFE_INTEGER });
  const total = Object.values(counts).reduce((s, n) => s + n, 0);
  return { counts, total, unfinished: UNFINISHED.reduce((s, status) => s + counts[status], 0) };
}

export interface DrainOptions {
  timeoutMs: number;
  /** Rows the outbox must hold before it counts as drained (default 1: an empty outbox has not begun). */
  atLeast?: number;
  pollMs?: number;
  signal?: AbortSignal;
  /** Each reading (none while the database is away). */
  onProgress?: (progress: OutboxProgress) => void;
}

/** True once drained; false at the timeout or when `signal` aborts. A database away meanwhile is waited out. */
export async function waitForDrain(db: Queryable, opts: DrainOptions): Promise<boolean> {
  const until = Date.now() + opts.timeoutMs;
  for (;;) {
    const progress = await outboxProgress(db).catch(() => undefined);
    if (progress) {
      opts.onProgress?.(progress);
      if (progress.total >= (opts.atLeast ?? 1) && progress.unfinished === 0) return true;
    }
    if (Date.now() > until || opts.signal?.aborted) return false;
    await sleep(opts.pollMs ?? 500);
  }
}
