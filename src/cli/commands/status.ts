/** `billing-outbox status`: how the outbox is doing, at a glance. */
import { idleInFlightAlarmMs, outboxStatus, reconcileStatus, type ReconcileStatus } from '../../ops/status.js';
import { OUTBOX_STATUSES } from '../../outbox/statuses.js';
import { noPositionals, parse } from '../args.js';
import { EXIT_OK, writeJson, type CliContext } from '../context.js';
import { formatDuration, formatTable } from '../format.js';
import { TemporalErrorCodes } from '../../../workflows/shared.js';
import { schemaFor } from '../../outbox/sql/schema.js';

export const STATUS_HELP = `Usage: billing-outbox status [--json]

Counts of outbox rows by status, the age of the oldest event not yet handed to Temporal, the event
in flight whose row has gone untouched longest (no attempt or mark since; its run at work never
leaves it so for hours), events sent in the last minute and hour, dead letters grouped by their last error code, events Stripe
rejected after accepting them (rejected_async) grouped by Stripe's error code, and the error reports
Stripe sent, events in flight by the error their last attempt met, and alarms first (for example
every delivery held because Stripe refused the API key, relays paused by an operator, or an event
in flight untouched for 2 h). Stripe's reports name only a sample of the failed events: \`unmatched\` counts failures
that could not be tied to a row, so more events may be affected than are marked rejected_async.

Options:
  --json   print {counts: {pending, claimed, dispatched, sent, accepted, dead, rejected_async, cancelled},
           sentEstimated, oldestPendingAgeSeconds, longestIdleInFlight: {key, idleSeconds} or null,
           sentLastMinute, sentLastHour,
           deadByErrorCode: [{code, count}], startFailing, rejectedAsyncByErrorCode: [{code, count}],
           errorReports: {received, lastReceivedAt, errorCount, matched, unmatched},
           inFlightByLastError: [{code, count}], relaysPaused: {at, by, reason} or null, alarms: [sentence],
           reconcile: {scheduleId, exists, paused, nextRunAt, lastRun, lastSuccess: {workflowId, closedAt, result}}
                      or {error} when Temporal could not be asked}

The reconcile schedule's last completed run comes last: the window it compared, and its drift by
direction with the customers it concerns (\`billing-outbox reconcile\` shows each hour and event).
`;

/** Stripe only takes usage stamped within its window: these dead letters can never be delivered as they are. */

export async function statusCommand(args: string[], ctx: CliContext): Promise<number> {
  const { values, positionals } = parse(args, { json: { type: 'boolean' } }, STATUS_HELP);
  if (values.help) {
    ctx.out.write(STATUS_HELP);
    return EXIT_OK;
  }
  noPositionals(positionals, STATUS_HELP);
  const outbox = await outboxStatus(await ctx.db(), schemaFor(ctx.config.databaseSchema), { idleAlarmMs: idleInFlightAlarmMs(ctx.config.retry) });
  // The outbox is the point of `status`: Temporal out of reach costs the reconcile lines only.
  const reconcile = await withinMs(
    TEMPORAL_WAIT_MS,
    ctx.temporal().then((client) => reconcileStatus(client, ctx.config.temporal.taskQueue)),
  ).catch((err: unknown): { error: string } => ({ error: err instanceof Error ? err.message : String(err) }));
  const report = { ...outbox, reconcile };
  if (values.json) {
    writeJson(ctx.out, report);
    return EXIT_OK;
  }
  const { counts } = report;
  // What needs a person comes first.
  for (const alarm of report.alarms) ctx.out.write(`ALARM: ${alarm}\n\n`);
  ctx.out.write(
    formatTable(
      [{ header: 'STATUS' }, { header: 'COUNT', align: 'right' }],
      OUTBOX_STATUSES.map((s) => [
        s,
        (s === 'sent' || s === 'accepted') && report.sentEstimated ? (s === 'sent' ? `~${counts[s]} (sent + accepted)` : '~') : String(counts[s]),
      ]),
    ),
  );
  const oldest = report.oldestPendingAgeSeconds === null ? 'none waiting' : formatDuration(report.oldestPendingAgeSeconds * 1000);
  ctx.out.write(`\noldest pending: ${oldest}\n`);
  const idle = report.longestIdleInFlight;
  ctx.out.write(`in flight, longest untouched: ${idle ? `${formatDuration(idle.idleSeconds * 1000)} (${idle.key})` : 'none in flight'}\n`);
  ctx.out.write(`sent: ${report.sentLastMinute} in the last minute, ${report.sentLastHour} in the last hour\n`);
  if (report.startFailing > 0) {
    ctx.out.write(
      `workflow starts failing: ${report.startFailing} event(s) whose last start Temporal did not take (tried again; inspect one for the error; is Temporal reachable?)\n`,
    );
  }
  if (report.deadByErrorCode.length > 0) {
    ctx.out.write('\n');
    ctx.out.write(
      formatTable(
        [{ header: 'DEAD BY ERROR CODE' }, { header: 'COUNT', align: 'right' }],
        report.deadByErrorCode.map((d) => [d.code ?? '(none)', String(d.count)]),
      ),
    );
    ctx.out.write('list them: billing-outbox dead\n');
    if (report.deadByErrorCode.some((d) => d.code === TemporalErrorCodes.workflowClosed || d.code === TemporalErrorCodes.workflowCancelled)) {
      ctx.out.write('workflow_closed / workflow_cancelled: their run ended without delivering them (see inspect); retry starts a new run\n');
    }
    if (report.deadByErrorCode.some((d) => d.code === TemporalErrorCodes.startRefused)) {
      ctx.out.write("temporal_start_refused: Temporal refused the event's start (its answer is on the row); fix the cause, then retry\n");
    }
    if (report.deadByErrorCode.some((d) => d.code === 'timestamp_too_far_in_past')) {
      ctx.out.write("timestamp_too_far_in_past: older than Stripe's 35-day window: retrying cannot deliver them\n");
    }
    if (report.deadByErrorCode.some((d) => d.code === 'timestamp_in_future')) {
      ctx.out.write("timestamp_in_future: stamped ahead of the clock that judged it (the worker's, by over an hour, or Stripe's): a clock is wrong; fix it, then retry once the usage is within the hour\n");
    }
  }
  if (report.inFlightByLastError.length > 0) {
    ctx.out.write('\n');
    ctx.out.write(
      formatTable(
        [{ header: 'IN FLIGHT, LAST ATTEMPT MET' }, { header: 'COUNT', align: 'right' }],
        report.inFlightByLastError.map((d) => [d.code, String(d.count)]),
      ),
    );
  }
  if (report.rejectedAsyncByErrorCode.length > 0) {
    ctx.out.write('\n');
    ctx.out.write(
      formatTable(
        [{ header: 'REJECTED BY STRIPE AFTER 200, BY CODE' }, { header: 'COUNT', align: 'right' }],
        report.rejectedAsyncByErrorCode.map((d) => [d.code ?? '(none)', String(d.count)]),
      ),
    );
    ctx.out.write('list them: billing-outbox dead --rejected\n');
  }
  const r = report.errorReports;
  if (r.received > 0) {
    ctx.out.write(
      `\nStripe error reports: ${r.received} received (last ${r.lastReceivedAt}), ${r.errorCount} failed event(s): ` +
        `${r.matched} named one of our rows, ${r.unmatched} unmatched\n`,
    );
    if (r.unmatched > 0) {
      ctx.out.write(
        '  Stripe names only a sample of the failed events: more events than those marked rejected_async may be affected; ' +
          "reconcile the reports' periods (billing-outbox reconcile)\n",
      );
    }
  }
  ctx.out.write(`\n${reconcileLines(reconcile).join('\n')}\n`);
  return EXIT_OK;
}

/** How long `status` waits for Temporal's answer about the reconcile schedule before saying it does not know. */
const TEMPORAL_WAIT_MS = 5_000;

function withinMs<T>(ms: number, p: Promise<T>): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const late = new Promise<never>((_, reject) => (timer = setTimeout(() => reject(new Error(`no answer within ${ms / 1000} s`)), ms)));
  return Promise.race([p, late]).finally(() => clearTimeout(timer));
}

function reconcileLines(r: ReconcileStatus | { error: string }): string[] {
  if ('error' in r) return [`reconcile schedule: unknown (Temporal: ${r.error})`];
  if (!r.exists) return [`reconcile schedule: none (${r.scheduleId}; a worker creates it at start unless RECONCILE_SCHEDULE=off)`];
  const lines = [
    `reconcile schedule: ${r.scheduleId}${r.paused ? ', PAUSED' : ''}${r.nextRunAt ? `, next run ${r.nextRunAt}` : ''}`,
  ];
  if (r.lastRun && r.lastRun.status !== 'COMPLETED') lines.push(`  last run: ${r.lastRun.status} (started ${r.lastRun.startedAt}, ${r.lastRun.workflowId})`);
  if (!r.lastSuccess) {
    lines.push('  no completed run yet');
    return lines;
  }
  const x = r.lastSuccess.result;
  const window = `${x.from} – ${x.to}`;
  if (x.match) lines.push(`  last completed: ${r.lastSuccess.closedAt} over ${window}: ${x.pairs === 0 ? 'no usage in the window' : `matched (${x.pairs} customer/meter pair(s))`}`);
  else {
    lines.push(
      `  last completed: ${r.lastSuccess.closedAt} over ${window}: DRIFT in ${x.differing} of ${x.windows} hour(s): ` +
        `Stripe counts ${x.drift.stripeMore} more and ${x.drift.stripeLess} less than our sent rows`,
    );
    for (const p of x.drifting) {
      const tenants = `${p.tenantIds.join(', ')}${p.tenantsOmitted > 0 ? ` and ${p.tenantsOmitted} more` : ''}`;
      lines.push(`    ${p.stripeCustomerId} (${tenants}) ${p.eventName}: ours ${p.ours}, Stripe ${p.stripe}${p.problem ? ` (${p.problem})` : ''}`);
    }
    if (x.driftingOmitted > 0) lines.push(`    and ${x.driftingOmitted} more pair(s)`);
    lines.push(`  each hour and event: billing-outbox reconcile --from ${x.from} --to ${x.to} [--tenant <tenant>]`);
  }
  if (x.stripeOnly.windows > 0) lines.push(`  Stripe counts ${x.stripeOnly.quantity} in ${x.stripeOnly.windows} hour(s) with no row of ours`);
  return lines;
}
