/**
 * Finds outbox rows left `dispatched` by a run that has closed without delivering them: a run
 * terminated or cancelled from the Web UI or the CLI, a database restored from a backup older than
 * Temporal's state, a row put back by hand. No run will ever mark such a row, `retry` only takes
 * dead letters, and the row holds a place of its lane: the sweep makes it a dead letter with the
 * reason (`workflow_closed`, naming how the run closed), which `status`, `dead` and the metric
 * `billing_outbox_closed_runs_total` show, and which `retry` reopens with a new run.
 *
 * It also finds a dispatched row whose run is open but waiting as a dead letter (it lists itself
 * `dead`): the run's mark of the row lost (a failover to a replica without that commit, a backup of
 * the outbox taken apart from Temporal's), or a `rebill` or a second `retry` that moved the row
 * and never reached the run. The row would wait, in flight for the relays and `retry`, until the run
 * closes days later; it is made dead with the run's error, where `retry` reopens it in that run.
 *
 * Bounded: each pass reads at most `batchSize` rows and describes each one's run; the worker runs a
 * pass every interval, walking all dispatched rows in turn (a keyset cursor that wraps around).
 */
import type { Client } from '@temporalio/client';
import type { Queryable } from '../db.js';
import type { Metrics } from '../metrics.js';
import { listStaleDispatched, markStaleDispatchedDead } from '../outbox/sql/sweep.js';
import { storedIdentifier } from '../outbox/sql/delivery.js';
import { closedRunMessage, describeRun, firstAttemptBound } from '../temporal/start-usage.js';
import { TemporalErrorCodes } from '../../workflows/shared.js';
import { temporalUnreachable } from '../reachable.js';
import type { Schema } from '../outbox/sql/schema.js';

export interface ClosedRunSweepDeps {
  db: Queryable;
  /** The PostgreSQL schema of the tables. */
  schema: Schema;
  client: Client;
  /** This deployment's task queue: a run on another is not ours. */
  taskQueue: string;
  /** STRIPE_IDENTIFIER_NAMESPACE: the identifier a row restored without its first attempt was sent under. */
  identifierNamespace?: string;
  metrics?: Pick<Metrics, 'closedRuns'> | undefined;
  log?: ((msg: string, fields: Record<string, unknown>) => void) | undefined;
}

export interface SweepOptions {
  /** Rows dispatched or updated more recently than this are not looked at (their run may be starting). */
  staleAfterMs: number;
  batchSize: number;
  /** Where the previous pass stopped (0: from the start). */
  afterId?: number;
  /** Ends the pass between two rows (the worker stopping). */
  signal?: AbortSignal;
}

/**
 * Runs that could not be described in a row, Temporal unreachable, before a pass stops: each try
 * waits out the client's retries (some 20 s), so a pass of 100 rows would take half an hour and hold
 * a stopping worker for as long. The next pass starts again where this one began. (A row whose run
 * cannot be described for another reason is skipped, as before: it cannot hold up the rows after it.)
 */
const SWEEP_FAILURES_IN_A_ROW = 3;

export interface SweepResult {
  checked: number;
  /** Rows made dead because their run had closed. */
  closed: number;
  /** Rows made dead because their open run waits as a dead letter. */
  deadLetters: number;
  /** Where the next pass starts: 0 once every dispatched row has been looked at. */
  nextAfterId: number;
}

/**
 * One pass of the sweep. A run that cannot be described is skipped until next time; after
 * SWEEP_FAILURES_IN_A_ROW runs in a row with Temporal unreachable, or when `signal` aborts, the pass
 * stops and the next one starts where this one began.
 */
export async function sweepClosedRuns(deps: ClosedRunSweepDeps, opts: SweepOptions): Promise<SweepResult> {
  const afterId = opts.afterId ?? 0;
  const rows = await listStaleDispatched(deps.db, deps.schema, { afterId, staleAfterMs: opts.staleAfterMs, limit: opts.batchSize });
  let closed = 0;
  let deadLetters = 0;
  let failuresInARow = 0;
  for (const row of rows) {
    if (opts.signal?.aborted || failuresInARow >= SWEEP_FAILURES_IN_A_ROW) return { checked: rows.indexOf(row), closed, deadLetters, nextAfterId: afterId };
    const run = await describeRun(deps.client, row.idempotency_key, deps.taskQueue).catch((err: unknown) => (temporalUnreachable(err) ? 'unreachable' : undefined));
    failuresInARow = run === 'unreachable' ? failuresInARow + 1 : 0;
    if (run === undefined || run === 'unreachable') continue;
    if (run.kind === 'running') {
      if (!run.deadLetter) continue;
      // The row may have lost its first attempt with the rest (a restore): the run's bound on it
      // goes on the row, where retry's resend guard reads it. Unreadable, the row waits for the next pass.
      const { code, runId, startTime } = run.deadLetter;
      const bound = await firstAttemptBound(deps.client, row.idempotency_key, runId, startTime).catch((err: unknown) => {
        deps.log?.("usage workflow waits as a dead letter while its row said dispatched, but its history could not be read; the row waits for the sweep's next pass", {
          key: row.idempotency_key,
          error: String(err),
        });
        return undefined;
      });
      if (!bound) continue;
      const firstAttempt = { by: bound, identifier: storedIdentifier(row.idempotency_key, 0, deps.identifierNamespace ?? '') };
      if (await markStaleDispatchedDead(deps.db, deps.schema, row.id, { staleAfterMs: opts.staleAfterMs, code, message: deadRunMessage(code), firstAttempt })) {
        deadLetters++;
        deps.log?.('usage workflow waits as a dead letter while its row said dispatched; the row is dead, for retry', { key: row.idempotency_key, code });
      }
      continue;
    }
    const message = closedRunMessage(row.idempotency_key, run, 'dispatched');
    const marked = await markStaleDispatchedDead(deps.db, deps.schema, row.id, { staleAfterMs: opts.staleAfterMs, code: TemporalErrorCodes.workflowClosed, message });
    if (!marked) continue;
    closed++;
    deps.metrics?.closedRuns.inc({ status: run.status.toLowerCase() });
    deps.log?.('usage workflow closed without delivering its dispatched row; the row is dead', {
      key: row.idempotency_key,
      runStatus: run.status,
      code: TemporalErrorCodes.workflowClosed,
    });
  }
  return { checked: rows.length, closed, deadLetters, nextAfterId: rows.length < opts.batchSize ? 0 : rows.at(-1)!.id };
}

function deadRunMessage(code: string): string {
  return (
    `its workflow run waits as a dead letter (${code}) while the row said dispatched: the run's mark of the row was lost ` +
    '(a failover, a database restored apart from Temporal) or a rebill or retry moved the row without reaching the run. ' +
    "Stripe's words are on the run's page in the Web UI; billing-outbox retry reopens it in that run"
  );
}
