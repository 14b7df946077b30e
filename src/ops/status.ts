/**
 * How the outbox is doing, at a glance: counts by status, the backlog's age, the send rate, dead
 * letters and Stripe's later rejections by error code, and the error reports Stripe sent. Read by
 * `billing-outbox status`; the metrics scrape reads the same summary statement on its own.
 */
import { ScheduleNotFoundError, WorkflowNotFoundError, type Client } from '@temporalio/client';
import type { RetryPolicy } from '../config.js';
import type { Queryable } from '../db.js';
import { iso } from '../duration.js';
import { errorReportTotals } from '../outbox/sql/error-reports.js';
import { relaysPaused, type RelaysPaused } from '../outbox/sql/relay.js';
import { countByErrorCode, countRecentlySent, countStartFailing, statusSummary } from '../outbox/sql/status.js';
import type { OutboxStatus } from '../outbox/statuses.js';
import { CREDENTIALS_REFUSED } from '../stripe/errors.js';
import { shellWord, TemporalErrorCodes } from '../../workflows/shared.js';
import type { Schema } from '../outbox/sql/schema.js';
import { reconcileScheduleId } from '../temporal/reconcile-schedule.js';
import type { ReconcileRunResult } from './reconcile.js';

export interface StatusReport {
  counts: Record<OutboxStatus, number>;
  /** True when `counts.sent` is PostgreSQL's estimate of sent and accepted rows together (large tables), not a count. */
  sentEstimated: boolean;
  /** Null when nothing is waiting for a relay. */
  oldestPendingAgeSeconds: number | null;
  /** The event in flight whose row has gone untouched longest (no attempt, no mark), and how long; null when none is in flight. */
  longestIdleInFlight: { key: string; idleSeconds: number } | null;
  sentLastMinute: number;
  sentLastHour: number;
  deadByErrorCode: { code: string | null; count: number }[];
  /**
   * Rows waiting for a relay whose last workflow start failed for a reason that may pass (Temporal
   * away, overloaded): tried again, never silently. Refused starts and closed runs are dead letters
   * (`temporal_start_refused`, `workflow_closed`, `workflow_cancelled` in deadByErrorCode).
   */
  startFailing: number;
  /** Rows Stripe rejected after answering 200, by Stripe's error code. */
  rejectedAsyncByErrorCode: { code: string | null; count: number }[];
  /**
   * Stripe's error reports (v1.billing.meter.error_report_triggered) received so far: failures
   * Stripe counted, how many named one of our rows, and how many did not (not named in Stripe's
   * sample, or not ours).
   */
  errorReports: { received: number; lastReceivedAt: string | null; errorCount: number; matched: number; unmatched: number };
  /** Events in flight whose last attempt met an error, by its code (none: they are going well). */
  inFlightByLastError: { code: string; count: number }[];
  /** When an operator paused the relays (`billing-outbox relays pause`), by whom and why; null while they run. */
  relaysPaused: RelaysPaused | null;
  /** What needs a person now, one sentence each (empty: nothing). */
  alarms: string[];
}

/**
 * How long a row in flight may go untouched before `status` raises an alarm: longer than any wait of
 * a run at work between two tries, which touch the row. The longest are Stripe's Retry-After (cut to
 * RETRY_MAX_RATE_LIMITED_MS), the retry policy's interval (RETRY_MAXIMUM_INTERVAL_MS), usage stamped
 * ahead (an hour at most) and an outage's 5 minutes: two hours, or an hour more than the longer of
 * the two settings.
 */
const IDLE_ALARM_MS = 2 * 3_600_000;

export function idleInFlightAlarmMs(retry: Pick<RetryPolicy, 'maximumIntervalMs' | 'maxRateLimitedMs'>): number {
  return Math.max(IDLE_ALARM_MS, Math.max(retry.maximumIntervalMs, retry.maxRateLimitedMs) + 3_600_000);
}

/** The outbox's state now, by PostgreSQL's clock. */
export async function outboxStatus(db: Queryable, schema: Schema, opts: { idleAlarmMs?: number } = {}): Promise<StatusReport> {
  const [summary, recent, dead, rejected, reports, inFlight, startFailing, paused] = await Promise.all([
    statusSummary(db, schema),
    countRecentlySent(db, schema),
    countByErrorCode(db, schema, 'dead'),
    countByErrorCode(db, schema, 'rejected_async'),
    errorReportTotals(db, schema),
    countByErrorCode(db, schema, 'dispatched'),
    countStartFailing(db, schema, TemporalErrorCodes.startFailing),
    relaysPaused(db, schema),
  ]);
  const inFlightByLastError = inFlight.filter((r): r is { code: string; count: number } => r.code !== null);
  const alarms: string[] = [];
  const held = inFlightByLastError.find((r) => r.code === CREDENTIALS_REFUSED)?.count ?? 0;
  if (held > 0) {
    alarms.push(`${held} event(s) held: Stripe refused the API key (401/403). Fix STRIPE_API_KEY (expired, rolled or missing a permission); delivery resumes by itself.`);
  }
  const idle = summary.longestIdleInFlight;
  if (idle && idle.idleSeconds * 1000 >= (opts.idleAlarmMs ?? IDLE_ALARM_MS)) {
    alarms.push(
      `an event in flight untouched for ${Math.floor(idle.idleSeconds / 3600)} h and more (${idle.key}): no attempt or mark since, which a run at work never leaves this long. ` +
        `Its run may be paused, failing its workflow task, or on a queue no worker polls: billing-outbox inspect ${shellWord(idle.key)}.`,
    );
  }
  const waiting = summary.counts.pending + summary.counts.claimed;
  if (paused) {
    alarms.push(
      `relays paused since ${paused.at.toISOString()} by ${paused.by}${paused.reason ? ` (${paused.reason})` : ''}: ${waiting} event(s) wait unsent; ` +
        'those already dispatched go on. `billing-outbox relays resume` sends the rest.',
    );
  }
  return {
    counts: summary.counts,
    sentEstimated: summary.sentEstimated,
    oldestPendingAgeSeconds: waiting > 0 ? Math.floor(summary.oldestPendingAgeSeconds) : null,
    longestIdleInFlight: idle && { key: idle.key, idleSeconds: Math.floor(idle.idleSeconds) },
    sentLastMinute: recent.last_minute,
    sentLastHour: recent.last_hour,
    deadByErrorCode: dead,
    startFailing,
    rejectedAsyncByErrorCode: rejected,
    inFlightByLastError,
    relaysPaused: paused,
    alarms,
    errorReports: {
      received: reports.reports,
      lastReceivedAt: iso(reports.last_received_at),
      errorCount: reports.error_count,
      matched: reports.matched,
      unmatched: reports.unmatched,
    },
  };
}

/** The reconcile schedule and its runs, as `status` shows them. */
export interface ReconcileStatus {
  scheduleId: string;
  /** False when no worker has created it (RECONCILE_SCHEDULE=off, or no worker started yet). */
  exists: boolean;
  paused: boolean;
  nextRunAt: string | null;
  /** The most recent run the schedule started, however it is doing. */
  lastRun: { workflowId: string; startedAt: string; status: string } | null;
  /** The most recent run that completed, with what it found. */
  lastSuccess: { workflowId: string; closedAt: string | null; result: ReconcileRunResult } | null;
}

/**
 * Reads the schedule and its recent runs from Temporal: the runs' results are the record
 * (Temporal keeps the last ten actions on the schedule, each run's result in its history).
 */
export async function reconcileStatus(client: Client, taskQueue: string): Promise<ReconcileStatus> {
  const scheduleId = reconcileScheduleId(taskQueue);
  const empty: ReconcileStatus = { scheduleId, exists: false, paused: false, nextRunAt: null, lastRun: null, lastSuccess: null };
  let description;
  try {
    description = await client.schedule.getHandle(scheduleId).describe();
  } catch (err) {
    if (err instanceof ScheduleNotFoundError) return empty;
    throw err;
  }
  const actions = [...description.info.recentActions].sort((a, b) => b.takenAt.getTime() - a.takenAt.getTime());
  const report: ReconcileStatus = {
    ...empty,
    exists: true,
    paused: description.state.paused,
    nextRunAt: description.info.nextActionTimes[0]?.toISOString() ?? null,
  };
  for (const action of actions) {
    const handle = client.workflow.getHandle(action.action.workflow.workflowId, action.action.workflow.firstExecutionRunId);
    let run;
    try {
      run = await handle.describe();
    } catch (err) {
      // Past the namespace's retention a run is gone while the schedule still lists it.
      if (err instanceof WorkflowNotFoundError) continue;
      throw err;
    }
    report.lastRun ??= { workflowId: run.workflowId, startedAt: run.startTime.toISOString(), status: run.status.name };
    if (run.status.name === 'COMPLETED') {
      report.lastSuccess = { workflowId: run.workflowId, closedAt: run.closeTime?.toISOString() ?? null, result: (await handle.result()) as ReconcileRunResult };
      break;
    }
  }
  return report;
}
