/**
 * One scheduled reconciliation (started by the reconcile schedule, src/temporal/reconcile-schedule.ts):
 * compares the settled window before its start time with Stripe's meter summaries and returns the
 * bounded result, which is the record of the run (`billing-outbox status` reads the last one).
 */
import { defineSearchAttributeKey, SearchAttributeType } from '@temporalio/common';
import { proxyActivities, setCurrentDetails, upsertMemo, workflowInfo } from '@temporalio/workflow';
import type { ReconcileActivities } from '../activities/reconcile.js';
import type { ReconcileRunInput, ReconcileRunResult } from '../src/ops/reconcile.js';
import { markdownText } from './shared.js';

const { reconcileWindow } = proxyActivities<ReconcileActivities>({
  summary: "Compare the window's sent rows with Stripe's meter summaries",
  // Many customers take many paced calls: the heartbeat (one per call) notices a dead worker, the
  // start-to-close bounds a run stuck for good well before the next ones pile up behind it.
  startToCloseTimeout: '1 hour',
  heartbeatTimeout: '2 minutes',
  retry: { initialInterval: '10 seconds', backoffCoefficient: 2, maximumInterval: '5 minutes', maximumAttempts: 5 },
});

/** Set by Temporal on every run a schedule starts. */
const ScheduledStartTimeKey = defineSearchAttributeKey('TemporalScheduledStartTime', SearchAttributeType.DATETIME);

export async function reconcileWorkflow(input: ReconcileRunInput): Promise<ReconcileRunResult> {
  setCurrentDetails('**Comparing** the outbox with Stripe’s meter summaries.');
  // The time the schedule meant this run for (a run buffered or caught up late still compares its
  // own hours); started by hand, the workflow's clock. Both replay the same: every attempt of the
  // activity compares the same hours.
  const scheduled = workflowInfo().typedSearchAttributes.get(ScheduledStartTimeKey);
  const result = await reconcileWindow({ ...input, at: scheduled ? scheduled.getTime() : Date.now() });
  // The memo is kept with the closed run (the list and the run's page show it); the details only
  // while a worker answers the query.
  upsertMemo({ summary: reconcileSummary(result) });
  setCurrentDetails(reconcileDetails(result));
  return result;
}

/** One line: the window and what was found. */
export function reconcileSummary(r: ReconcileRunResult): string {
  const window = `${r.from} – ${r.to}`;
  if (r.pairs === 0) return `${window}: no usage in the window, nothing to compare`;
  if (r.match) return `${window}: matched, ${r.pairs} customer/meter pair(s), ${r.ours} units`;
  return (
    `${window}: DRIFT in ${r.differing} of ${r.windows} hour(s), ${r.driftingCustomers} customer(s): ` +
    `Stripe counts ${r.drift.stripeMore} more and ${r.drift.stripeLess} less than our sent rows`
  );
}

/** Markdown for the run's page: the summary, then the drifting pairs. */
export function reconcileDetails(r: ReconcileRunResult): string {
  const lines = [`**${reconcileSummary(r)}**`];
  if (r.stripeOnly.windows > 0) lines.push(`Stripe counts ${r.stripeOnly.quantity} in ${r.stripeOnly.windows} hour(s) where we hold no row of that customer and meter.`);
  if (r.unsettledRows > 0) lines.push(`${r.unsettledRows} row(s) in the window not settled (pending, in flight or dead): not counted as ours.`);
  if (r.drifting.length > 0) {
    lines.push(
      [
        '| customer | tenants | meter | ours | Stripe | Stripe more | Stripe less | note |',
        '|---|---|---|---|---|---|---|---|',
        // Tenant ids, names and Stripe's messages are text of others' making: escaped (a `|` too).
        ...r.drifting.map(
          (p) =>
            `| ${markdownText(p.stripeCustomerId)} | ${p.tenantIds.map(markdownText).join(', ')}${p.tenantsOmitted > 0 ? ` and ${p.tenantsOmitted} more` : ''} | ${markdownText(p.eventName)} | ${p.ours} | ${p.stripe} | ${p.stripeMore} | ${p.stripeLess} | ${markdownText(p.problem ?? '')} |`,
        ),
      ].join('\n'),
    );
    if (r.driftingOmitted > 0) lines.push(`${r.driftingOmitted} more pair(s) not listed.`);
    lines.push(`Each hour and its events: \`billing-outbox reconcile --from ${r.from} --to ${r.to} --tenant <tenant>\``);
  }
  return lines.join('\n\n');
}
