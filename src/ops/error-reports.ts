/**
 * Stripe's asynchronous rejections (error reports, read from its webhook by src/api/webhooks.ts):
 * each report is recorded once, and the rows it names become `rejected_async` (sent, accepted,
 * dispatched, or dead: an attempt of a dead row may have reached Stripe with its answer lost). Rows
 * are found by the identifier Stripe got (src/outbox/keys.ts `stripeIdentifierFor`, stored on the
 * row), not by key: a namespaced or rebilled row's identifier is not its key.
 *
 * Stripe's report names only a *sample* of the failed requests. `error_count` minus the samples
 * that name one of our rows is stored as `unmatched`: those events are affected too but cannot be
 * told apart here; reconciling the report's period (`billing-outbox reconcile`) finds them.
 */
import type pg from 'pg';
import { withTransaction, type Queryable } from '../db.js';
import { errorReportExists, finishErrorReport, insertErrorReport, markRejectedAsync, type RejectedSample } from '../outbox/sql/error-reports.js';
import type { Schema } from '../outbox/sql/schema.js';

/** Stripe's full error-report event, as much of it as we rely on (read field by field by the webhook's parseErrorReport: it comes from outside). */
export interface ErrorReport {
  eventId: string;
  type: string;
  meterId: string | null;
  errorCount: number;
  errorTypes: { code: string; errorCount: number; samples: { identifier: string; message: string }[] }[];
  validationStart: string | null;
  validationEnd: string | null;
}

export interface ErrorReportOutcome {
  eventId: string;
  /** True for a redelivery of an event already processed: nothing was changed. */
  duplicate: boolean;
  errorCount: number;
  /** Samples naming one of our rows (any status). */
  matched: number;
  /** Keys of the rows moved from `sent`, `accepted`, `dispatched` or `dead` to `rejected_async`. */
  marked: string[];
  /** Those of them that were dead letters: their runs may be open, waiting for a retry (rowChangedSignal). */
  markedDead: string[];
  /** Named rows in another status (not yet sent, already rejected, cancelled, or `superseded`: an identifier a rebill replaced): left as they were. */
  notSent: { key: string; status: string }[];
  /** Sample identifiers that are not in our outbox. */
  unknown: string[];
  /** error_count minus matched: failed events Stripe did not name, or that are not ours. */
  unmatched: number;
}

/** Whether this error-report event was already recorded (a redelivery needs no call to Stripe). */
export async function errorReportProcessed(db: Queryable, schema: Schema, eventId: string): Promise<boolean> {
  return errorReportExists(db, schema, eventId);
}

/**
 * Records one error report, once: marks the named `sent`/`accepted`/`dispatched`/`dead` rows `rejected_async` with Stripe's code
 * and message. A redelivered event changes nothing and says `duplicate`.
 */
export async function recordErrorReport(db: pg.Pool, schema: Schema, report: ErrorReport, raw: unknown): Promise<ErrorReportOutcome> {
  const samples = new Map<string, RejectedSample>();
  for (const type of report.errorTypes) {
    for (const s of type.samples) {
      if (samples.has(s.identifier)) continue;
      const message = `${s.message || type.code} (rejected by Stripe after it accepted the event; error report ${report.eventId})`;
      samples.set(s.identifier, { identifier: s.identifier, code: type.code, message });
    }
  }
  return withTransaction(db, async (client) => {
    const none: ErrorReportOutcome = {
      eventId: report.eventId,
      duplicate: true,
      errorCount: report.errorCount,
      matched: 0,
      marked: [],
      markedDead: [],
      notSent: [],
      unknown: [],
      unmatched: 0,
    };
    if (!(await insertErrorReport(client, schema, { eventId: report.eventId, meterId: report.meterId, errorCount: report.errorCount, report: raw }))) {
      return none;
    }
    const results = await markRejectedAsync(client, schema, [...samples.values()]);
    const outcome: ErrorReportOutcome = { ...none, duplicate: false };
    for (const r of results) {
      if (r.status_before === null || r.key === null) outcome.unknown.push(r.identifier);
      else if (r.marked) {
        outcome.marked.push(r.key);
        if (r.status_before === 'dead') outcome.markedDead.push(r.key);
      }
      else outcome.notSent.push({ key: r.key, status: r.status_before });
    }
    outcome.matched = outcome.marked.length + outcome.notSent.length;
    outcome.unmatched = Math.max(0, report.errorCount - outcome.matched);
    await finishErrorReport(client, schema, report.eventId, { matched: outcome.matched, unmatched: outcome.unmatched });
    return outcome;
  }, { short: true });
}
