/**
 * Rebilling an event Stripe rejected after accepting it (`billing-outbox rebill <key>`).
 *
 * Stripe keeps a rejected event's identifier taken: a resend with it is told "already exists" (and
 * would be marked sent, never billed), so `retry` refuses a `rejected_async` row. Once the cause is
 * fixed (the customer exists, the meter is active, the payload keys are right), a rebill gives the
 * event a NEW identifier and delivers it again, on the same path as a retry.
 *
 * Why it can never bill twice:
 * - Only a `rejected_async` row may be rebilled: Stripe said, by an error report naming the row's
 *   CURRENT identifier, that it does not count that event (a report naming an earlier identifier,
 *   before an earlier rebill, does not match the row: src/outbox/sql/error-reports.ts). Every earlier
 *   identifier of the row was rejected the same way (each rebill starts from `rejected_async`).
 *   So no identifier of this event counts at Stripe when a new one is made.
 * - The new identifier is derived deterministically from the key and a revision number stored on
 *   the row (src/outbox/keys.ts `stripeIdentifierFor`), and moving to it is one guarded UPDATE
 *   (`rejected_async` at revision n → `dispatched` at n + 1): two operators at once make ONE new
 *   revision; the loser changes nothing. Every attempt after it reads the identifier from the row in
 *   its own statement, so all of them send the same new identifier, deduplicated by Stripe as any
 *   event's attempts are.
 * - Not while its workflow is still running an attempt (a `dispatched` row Stripe rejected while
 *   its run was still at work): refused, to be rebilled once that run has ended.
 * - A rebill whose delivery cannot be started puts the row back to `rejected_async` (the new
 *   identifier was never sent, so "Stripe does not count it" holds for it too).
 */
import { WorkflowNotFoundError, type Client, type WorkflowExecutionStatusName } from '@temporalio/client';
import type { Config } from '../config.js';
import type { Queryable } from '../db.js';
import { scrub } from '../log.js';
import { stripeIdentifierFor } from '../outbox/keys.js';
import { findRebillCandidate, finishOperatorAction, identifierNamespaceOf, rebillRejected, restoreRejected, startOperatorAction, type RebillCandidateRow } from '../outbox/sql/operator.js';
import { tooOldToSend } from '../stripe/rules.js';
import { openRunNow, unpolledWarning, usageWorkflowStartOptions } from '../temporal/start-usage.js';
import { reopenSignal, stateQuery, type UsageState } from '../../workflows/shared.js';
import type { Schema } from '../outbox/sql/schema.js';

/**
 * rebilled: on its way under a new identifier. skipped: another operator rebilled it first.
 * refused: a rebill would be wrong (or cannot help). failed: an error.
 */
export type RebillOutcome = 'rebilled' | 'skipped' | 'refused' | 'failed';

export interface RebillResult {
  key: string;
  outcome: RebillOutcome;
  message: string;
  /** The identifier Stripe rejected, and the new one (when rebilled). */
  previousIdentifier: string | null;
  identifier: string | null;
  revision: number | null;
}

export interface RebillDeps {
  db: Queryable;
  /** The PostgreSQL schema of the tables. */
  schema: Schema;
  client: Client;
  config: Pick<Config, 'retry' | 'temporal'> & { stripe: Pick<Config['stripe'], 'identifierNamespace'> };
  now: () => number;
}

const QUERY_TIMEOUT_MS = 5_000;

/** Why a row that is not `rejected_async` is not rebilled. */
function notRejectedReason(row: RebillCandidateRow): string {
  switch (row.status) {
    case 'sent':
    case 'accepted':
      return `it is ${row.status}: Stripe counts it (as far as we know), and a new identifier would bill it twice. If Stripe rejected it, its error report marks it rejected_async first`;
    case 'dead':
      return 'it is a dead letter, not rejected by Stripe: retry it with the same identifier (`billing-outbox retry`), which Stripe deduplicates';
    case 'cancelled':
      return 'it was cancelled at Stripe by an operator; record the usage again as a new usage if it should be billed';
    default:
      return `it is ${row.status}: still on its way under its identifier`;
  }
}

export async function rebillEvent(deps: RebillDeps, key: string, opts: { actor: string }): Promise<RebillResult> {
  const failed = (message: string, row?: RebillCandidateRow): RebillResult => ({ key, outcome: 'failed', message, previousIdentifier: row?.identifier ?? null, identifier: null, revision: null });
  let row: RebillCandidateRow | undefined;
  let audit: string;
  try {
    row = await findRebillCandidate(deps.db, deps.schema, key);
    if (!row) return failed('no outbox row with this key');
    // Recorded before the row is touched: a rebill cut short (Ctrl-C while Temporal is slow, a
    // crash between moving the row and reaching its run) still says who began it, and when.
    audit = await startOperatorAction(deps.db, deps.schema, { actor: opts.actor, action: 'rebill', key, tenantId: row.tenant_id, forced: false, detail: `rebill of identifier ${row.identifier}` });
  } catch (err) {
    return failed(scrub((err as Error).message), row);
  }
  let result: RebillResult;
  try {
    result = await decide(deps, row, opts);
  } catch (err) {
    result = failed(scrub((err as Error).message), row);
  }
  try {
    const detail = result.identifier ? `${result.message} (identifier ${result.previousIdentifier} → ${result.identifier}, revision ${result.revision})` : result.message;
    await finishOperatorAction(deps.db, deps.schema, audit, result.outcome, detail);
  } catch (err) {
    result = { ...result, outcome: 'failed', message: `${result.message} (and recording it in operator_actions failed: ${scrub((err as Error).message)})` };
  }
  return result;
}

async function decide(deps: RebillDeps, row: RebillCandidateRow, opts: { actor: string }): Promise<RebillResult> {
  const key = row.idempotency_key;
  const previousIdentifier = row.identifier;
  const done = (outcome: RebillOutcome, message: string, next?: { identifier: string; revision: number }): RebillResult => ({
    key,
    outcome,
    message,
    previousIdentifier,
    identifier: next?.identifier ?? null,
    revision: next?.revision ?? null,
  });
  if (row.status !== 'rejected_async') return done('refused', `not rebilled: ${notRejectedReason(row)}`);
  if (tooOldToSend(row.occurred_at, deps.now())) {
    return done('refused', `not rebilled: it occurred at ${row.occurred_at.toISOString()}, outside Stripe's 35-day window: Stripe would refuse it under any identifier`);
  }

  const { db, schema, client, config } = deps;
  const handle = client.workflow.getHandle(key);
  let status: WorkflowExecutionStatusName | 'NOT_FOUND';
  try {
    const described = await handle.describe();
    // An open run of another deployment (a namespace shared, or TEMPORAL_TASK_QUEUE changed): the
    // signal would resend that deployment's event, not rebill ours.
    if (described.status.name === 'RUNNING' && described.taskQueue !== config.temporal.taskQueue) {
      return done(
        'refused',
        `not rebilled: the workflow id ${key} belongs to an open run on task queue ${JSON.stringify(described.taskQueue)}, not this deployment's ` +
          `(${JSON.stringify(config.temporal.taskQueue)}): a rebill would signal that run to resend its own event. Rebill it once that run has closed ` +
          '(a run left on this deployment\'s queue of before a TEMPORAL_TASK_QUEUE change never closes by itself: terminate it)',
      );
    }
    status = described.status.name;
  } catch (err) {
    if (!(err instanceof WorkflowNotFoundError)) throw err;
    status = 'NOT_FOUND';
  }
  if (status === 'RUNNING') {
    const state = await queryState(client, key);
    // A dead letter's run waits for a retry signal (the point-4 case: dead, then Stripe's report);
    // any other running run may still have an attempt under the old identifier in flight.
    if (state?.status !== 'dead') {
      // Another operator's rebill, begun after this row was read, has its run at work already.
      const current = await findRebillCandidate(db, schema, key);
      if (current && current.identifier_revision > row.identifier_revision) {
        return done('skipped', `rebilled meanwhile to revision ${current.identifier_revision} (now ${current.status}): another rebill got there first`);
      }
      return done(
        'refused',
        `not rebilled: its workflow is still running (${state ? `state ${state.status}` : 'its state query went unanswered: is a worker running?'}); rebill it once that run has ended`,
      );
    }
  }

  const revision = row.identifier_revision + 1;
  const identifier = stripeIdentifierFor(key, revision, await identifierNamespaceOf(db, schema, config.stripe.identifierNamespace));
  const moved = await rebillRejected(db, schema, key, { fromRevision: row.identifier_revision, identifier });
  if (!moved) {
    const current = await findRebillCandidate(db, schema, key);
    return done(
      'skipped',
      `no longer rejected_async at revision ${row.identifier_revision} (now ${current?.status ?? 'missing'}, revision ${current?.identifier_revision ?? '?'}): another rebill got there first`,
    );
  }
  const next = { identifier, revision };
  const why = `Stripe rejected identifier ${previousIdentifier} (${row.last_error_code ?? 'no code'})`;

  if (status === 'RUNNING') {
    try {
      await handle.signal(reopenSignal, { force: false, newIdentifier: true, requestedBy: opts.actor });
      return done('rebilled', `${why}; signalled its open workflow to deliver it as ${identifier}`, next);
    } catch (err) {
      // Closed since it was described (its dead-letter wait ended): a new run below.
      if (!(err instanceof WorkflowNotFoundError)) return restore(err);
    }
  }
  try {
    await client.workflow.start(
      'usageWorkflow',
      usageWorkflowStartOptions({ ...row, idempotency_key: key, tenant_id: moved.tenant_id }, config, { reusePolicy: 'ALLOW_DUPLICATE' }),
    );
  } catch (err) {
    // A run open under the key now (the one before it was closed) is this start's, its answer
    // lost: the rebill stands, and the row stays with the run that delivers it (put back to
    // rejected_async, the run would find it so and the operator be told it failed).
    if (!(await openRunNow(client, key, config.temporal.taskQueue))) return restore(err);
  }
  return done('rebilled', `${why}; started a new run to deliver it as ${identifier}${await unpolledWarning(client, config.temporal)}`, next);

  async function restore(err: unknown): Promise<RebillResult> {
    const restored = await restoreRejected(db, schema, key, revision);
    return done(
      'failed',
      `could not start its delivery: ${scrub((err as Error).message)}; ${restored ? 'the row is rejected_async again (rebill it again later)' : 'the row has moved on meanwhile'}`,
      next,
    );
  }
}

async function queryState(client: Client, key: string): Promise<UsageState | undefined> {
  try {
    return await client.withDeadline(Date.now() + QUERY_TIMEOUT_MS, () => client.workflow.getHandle(key).query(stateQuery));
  } catch {
    return undefined;
  }
}
