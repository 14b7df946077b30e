/**
 * Retrying one dead letter, safely. The decision, in order:
 *
 * 1. A delivered row (`sent`, `accepted`) is never resent (Stripe has it; a resend past its dedup
 *    window would bill twice): skipped, nothing to retry. A row that is not `dead` is still in
 *    flight: nothing to do.
 * 2. If the first attempt is older than SAFE_RESEND_WINDOW_MS (23 h) and the operator did not force
 *    it, refuse: Stripe only deduplicates identifiers for 24 h, so it could not tell a resend from
 *    a new event. The operator reconciles first, then forces.
 * 3. If the event's workflow is open (a dead letter's workflow waits for a `retry` signal), signal
 *    it; with `wait`, send the `retry` Update instead, whose validator refuses in the workflow
 *    (nothing recorded) what cannot be retried, and which answers with the new attempt's outcome.
 *    The delivery activity re-checks the window itself, so a stale decision here cannot send.
 * 4. If the workflow has closed (terminated, cancelled, timed out, failed, or gone past retention), reopen:
 *    move the row dead → dispatched with a guarded UPDATE (only one operator can win it), then
 *    start a new run with the same workflow id (conflict policy FAIL, reuse policy ALLOW_DUPLICATE:
 *    the relay keeps REJECT_DUPLICATE; only this path, behind the row guard, may start a second
 *    run). If the start fails the row goes back to dead.
 * 5. If the workflow completed (Temporal recorded the event delivered) yet the row is dead, refuse,
 *    except for a row made dead as `workflow_closed` (put back by hand after its run delivered it,
 *    or restored from an older backup): reopened while a resend is still caught by Stripe's
 *    identifier dedup (within the safe resend window of the run's close), or when forced.
 */
import {
  WorkflowNotFoundError,
  WorkflowUpdateFailedError,
  WorkflowUpdateRPCTimeoutOrCancelledError,
  WorkflowUpdateStage,
  type Client,
  type WorkflowExecutionStatusName,
} from '@temporalio/client';
import { ApplicationFailure } from '@temporalio/common';
import type { Config } from '../config.js';
import type { Queryable } from '../db.js';
import { scrub } from '../log.js';
import { temporalUnreachable } from '../reachable.js';
import {
  findOperatorRow,
  identifierNamespaceOf,
  laneInFlight,
  listDeadLetters,
  startOperatorAction,
  finishOperatorAction,
  reopenDeadLetter,
  restoreDeadLetter,
  type DeadLetterFilter,
  type OperatorRow,
} from '../outbox/sql/operator.js';
import { storedIdentifier } from '../outbox/sql/delivery.js';
import { DELIVERED } from '../outbox/statuses.js';
import { closedRunMessage, firstAttemptBound, isOpenRun, openRunNow, unpolledWarning, usageWorkflowStartOptions } from '../temporal/start-usage.js';
import { reopenSignal, RETRY_REFUSED, retryUpdate, stateQuery, TemporalErrorCodes, type RetryRefusal, type UsageState, shellWord } from '../../workflows/shared.js';
import { IDENTIFIER_WINDOW_MS, inHours, SAFE_RESEND_WINDOW_MS, tooOldToSend } from '../stripe/rules.js';
import { formatDuration } from '../duration.js';
import type { Schema } from '../outbox/sql/schema.js';
import { forEachLimit } from '../limit.js';

/**
 * signalled / reopened: the event is on its way again. retried: its open run took the `retry`
 * Update (with `wait`) and answered. skipped: nothing to do (already in flight, or another
 * operator got there first). refused: retrying would be wrong. failed: an error.
 */
export type RetryOutcome = 'signalled' | 'retried' | 'reopened' | 'skipped' | 'refused' | 'failed';

export interface RetryResult {
  key: string;
  outcome: RetryOutcome;
  forced: boolean;
  message: string;
  /**
   * With `wait`: the event's state once the new delivery settled (`sent`/`accepted`, or `dead`
   * with Stripe's answer in `lastError`), or `dispatched` when it was still on its way when the
   * wait ended. Absent when nothing was retried, or the run could not be asked.
   */
  answer?: UsageState;
}

/** A retry that was refused or failed, or that was waited for and ended dead again. */
export const isProblem = (r: RetryResult) => r.outcome === 'refused' || r.outcome === 'failed' || r.answer?.status === 'dead';

/** How an operator's retry is asked for; `wait` makes it wait for the new attempt's outcome. */
export interface RetryOptions {
  force: boolean;
  requestedBy: string;
  wait?: { timeoutMs: number } | undefined;
}

/** How long `retry --wait` waits for one event's new attempt before saying it is still on its way. */
export const DEFAULT_WAIT_MS = 10 * 60_000;
/** How often a reopened run's state is asked while waiting for its outcome. */
const WAIT_POLL_MS = 250;

/** The answer of a waited retry, in a few words: what the operator reads first. */
export function describeAnswer(answer: UsageState | undefined): string {
  if (!answer) return 'its outcome is unknown';
  if (answer.status === 'dead') {
    const why = answer.lastError ? `${answer.lastError.code}: ${answer.lastError.message}` : 'no error recorded';
    return `dead again after ${answer.attempts} attempt(s): ${why}`;
  }
  if (answer.status === 'dispatched') return 'still on its way (deferred or retrying): follow it with billing-outbox inspect';
  return `${answer.status} after ${answer.attempts} attempt(s)`;
}

export interface RetrierDeps {
  db: Queryable;
  /** The PostgreSQL schema of the tables. */
  schema: Schema;
  client: Client;
  config: Pick<Config, 'retry' | 'temporal' | 'lanes' | 'stripe'>;
  now: () => number;
  /** How long a bulk retry waits for room in a lane before it reports that lane's rows untried (LANE_ROOM_WAIT_MS). */
  laneRoomWaitMs?: number;
}

const QUERY_TIMEOUT_MS = 5_000;
/** Dead letters in a row that Temporal did not answer for before a bulk retry stops. */
const STOP_AFTER_UNREACHABLE = 8;
/** How long an open run's worker may take to accept the `retry` Update (`--wait`). */
const ACCEPT_TIMEOUT_MS = 10_000;
/** Closed statuses after which a new run may be started; COMPLETED means the event was delivered. */
/** How far Temporal's clock and PostgreSQL's may be apart when a run's close is set against a rebill's time. */
const CLOCKS_APART_MS = 5 * 60_000;

const REOPENABLE: ReadonlySet<WorkflowExecutionStatusName> = new Set(['TERMINATED', 'TIMED_OUT', 'FAILED', 'CANCELLED', 'CONTINUED_AS_NEW']);

/** True while a resend would still be caught by Stripe's identifier deduplication. */
export function withinResendWindow(row: Pick<OperatorRow, 'first_attempted_at'>, now: number): boolean {
  return row.first_attempted_at === null || now - row.first_attempted_at.getTime() <= SAFE_RESEND_WINDOW_MS;
}

const hours = (ms: number) => `${inHours(ms)} h`;

/** Why an old event is not resent, and what to check instead. */
export function windowRefusal(row: OperatorRow, now: number): string {
  const since = formatDuration(now - row.first_attempted_at!.getTime());
  const hour = new Date(row.occurred_at);
  hour.setUTCMinutes(0, 0, 0);
  const customer = row.stripe_customer_id ?? `(no customer mapped for tenant ${row.tenant_id})`;
  const next = new Date(hour.getTime() + 3_600_000);
  const command = `billing-outbox reconcile --from ${hour.toISOString()} --to ${next.toISOString()} --tenant=${shellWord(row.tenant_id)}`;
  return (
    `first attempted ${since} ago (${row.first_attempted_at!.toISOString()}), past the ${hours(SAFE_RESEND_WINDOW_MS)} safe resend window. ` +
    `Stripe deduplicates meter-event identifiers for only ${hours(IDENTIFIER_WINDOW_MS)}, so if an earlier attempt did reach Stripe, ` +
    `a resend now could bill the customer twice. Check first: run \`${command}\` (Stripe customer ${customer}, the hour of the ` +
    `event's occurred_at). If that window matches without this event, Stripe does not have it: retry with --force. If Stripe counts ` +
    `it (the window differs by its quantity), do not resend it.`
  );
}

/** Retries in flight at once in a bulk retry: each is a few round trips to Temporal and PostgreSQL. */
const BULK_CONCURRENCY = 8;
/** How often a bulk retry looks again at a lane with no room, and how long it waits for room at most. */
const LANE_ROOM_POLL_MS = 250;
const LANE_ROOM_WAIT_MS = 120_000;
/** How long a retried row may take to leave `dead` (its run marks it dispatched) before its lane's next row is looked at anyway. */
const LEAVES_DEAD_WITHIN_MS = 5_000;
const DEFAULT_PAGE_SIZE = 500;

/** Each lane's first row, then each lane's second, and so on: the lanes in turn. */
function inTurns<T>(lanes: [string, T[]][]): [string, T][] {
  const out: [string, T][] = [];
  const total = lanes.reduce((n, [, rows]) => n + rows.length, 0);
  for (let i = 0; out.length < total; i++) {
    for (const [lane, rows] of lanes) if (i < rows.length) out.push([lane, rows[i]!]);
  }
  return out;
}

export class DeadLetterRetrier {
  private readonly deps: RetrierDeps;
  constructor(deps: RetrierDeps) {
    this.deps = deps;
  }

  /** Retries the event with `key`; never throws (errors come back as `failed`). */
  async retryKey(key: string, opts: RetryOptions): Promise<RetryResult> {
    try {
      const row = await findOperatorRow(this.deps.db, this.deps.schema, key);
      if (!row) return { key, outcome: 'failed', forced: opts.force, message: 'no outbox row with this key' };
      return await this.retryRow(row, opts);
    } catch (err) {
      return { key, outcome: 'failed', forced: opts.force, message: scrub((err as Error).message) };
    }
  }

  /**
   * Retries every dead letter matching `filter`, page by page (keyset paging: retried rows leave
   * `dead`, and rows that die again meanwhile, with ids below the cursor, are not revisited, so the
   * run ends), a few at a time; `onResult` hears each outcome as it comes.
   */
  async retryAllDead(
    filter: DeadLetterFilter,
    opts: RetryOptions & { pageSize?: number | undefined },
    onResult: (result: RetryResult) => void,
  ): Promise<{ stopped?: string }> {
    // Lanes that stayed full for LANE_ROOM_WAIT_MS: their rows are reported, not tried; others go on.
    const fullLanes = new Set<string>();
    // Rows signalled that did not leave `dead` (no worker took their run's retry yet): in flight as
    // soon as one does, so counted in their lane's room for the rest of the command.
    const unmoved = new Map<string, number>();
    for (let afterId = 0; ; ) {
      const page = await listDeadLetters(this.deps.db, this.deps.schema, { ...filter, afterId, limit: opts.pageSize ?? DEFAULT_PAGE_SIZE });
      if (page.length === 0) return {};
      afterId = page.at(-1)!.id;
      // A lane's rows one after another, each when the lane has room (LANE_MAX_IN_FLIGHT, as the
      // claim gives it): a tenant's thousands of dead letters go back at the pace its lane drains,
      // not into Temporal at once, where every tenant's events would queue behind them. The lanes
      // take the eight slots in turn, one slot each, so one tenant's pile waiting for room does not
      // hold the others' dead letters back. With `--wait` each retry holds its slot until its
      // outcome, so the eight slots bound what this command has in flight, and a lane's rows are
      // not chained (one would wait for the other's outcome): the rows go in turns of the lanes,
      // and a lane found full stops every wait for its room (a full lane's rows may still take
      // several slots for up to LANE_ROOM_WAIT_MS).
      const lanes = new Map<string, OperatorRow[]>();
      for (const row of page) {
        const lane = JSON.stringify([row.tenant_id, row.event_name]);
        const rows = lanes.get(lane);
        if (rows) rows.push(row);
        else lanes.set(lane, [row]);
      }
      const retryInTurn = async (lane: string, row: OperatorRow) => {
        if (this.unreachableInARow >= STOP_AFTER_UNREACHABLE) return;
        const notTried = (outcome: RetryOutcome, why: string) => onResult({ key: row.idempotency_key, outcome, forced: opts.force, message: `not retried: ${why}` });
        const full =
          `its lane (tenant ${row.tenant_id}, meter ${row.event_name}) had its ${this.deps.config.lanes.maxInFlight} events in flight (LANE_MAX_IN_FLIGHT) for ${this.laneRoomWaitMs / 1000} s without one finishing ` +
          '(its events retried may be failing again, or no worker is running): run the same command again later';
        if (fullLanes.has(lane)) return notTried('refused', full);
        try {
          if (!(await this.laneRoom(row, unmoved.get(lane) ?? 0, () => fullLanes.has(lane)))) {
            fullLanes.add(lane);
            return notTried('refused', full);
          }
        } catch (err) {
          return notTried('failed', `counting its lane's events in flight failed: ${scrub((err as Error).message)}`);
        }
        const result = await this.retryRow(row, opts);
        onResult(result);
        if (!opts.wait && (result.outcome === 'signalled' || result.outcome === 'reopened')) {
          if (!(await this.leftDead(row.idempotency_key).catch(() => true))) unmoved.set(lane, (unmoved.get(lane) ?? 0) + 1);
        }
      };
      if (opts.wait) {
        await forEachLimit(inTurns([...lanes.entries()]), BULK_CONCURRENCY, ([lane, row]) => retryInTurn(lane, row));
      } else {
        await forEachLimit([...lanes.entries()], BULK_CONCURRENCY, async ([lane, rows]) => {
          for (const row of rows) await retryInTurn(lane, row);
        });
      }
      // Temporal away: each row would wait out the client's retries (some 20 s) and fail, for
      // every dead letter there is. The rows not reached are still dead: the same command goes on.
      if (this.unreachableInARow >= STOP_AFTER_UNREACHABLE) {
        return { stopped: `Temporal did not answer for ${STOP_AFTER_UNREACHABLE} dead letters in a row; the rest were not tried` };
      }
    }
  }

  private get laneRoomWaitMs(): number {
    return this.deps.laneRoomWaitMs ?? LANE_ROOM_WAIT_MS;
  }

  /**
   * Waits until the row's lane has room, counting `unmoved` rows as in flight (at most
   * laneRoomWaitMs, or until `foundFull`: another row's wait for the lane gave up); false if it never did.
   */
  private async laneRoom(row: OperatorRow, unmoved: number, foundFull: () => boolean): Promise<boolean> {
    const until = Date.now() + this.laneRoomWaitMs;
    for (;;) {
      if ((await laneInFlight(this.deps.db, this.deps.schema, row.tenant_id, row.event_name)) + unmoved < this.deps.config.lanes.maxInFlight) return true;
      if (Date.now() >= until || foundFull()) return false;
      await new Promise((resolve) => setTimeout(resolve, LANE_ROOM_POLL_MS));
    }
  }

  /** Waits (briefly) until a retried row has left `dead`: its run marks it dispatched, and its lane counts it. False if it has not. */
  private async leftDead(key: string): Promise<boolean> {
    const until = Date.now() + LEAVES_DEAD_WITHIN_MS;
    for (;;) {
      if ((await findOperatorRow(this.deps.db, this.deps.schema, key))?.status !== 'dead') return true;
      if (Date.now() >= until) return false;
      await new Promise((resolve) => setTimeout(resolve, 50));
    }
  }

  /** Rows in a row whose retry failed because Temporal did not answer (the bulk retry stops at STOP_AFTER_UNREACHABLE). */
  private unreachableInARow = 0;

  /**
   * Retries one row, its audit row written first (`started`) and completed with what happened: a
   * `--wait` cut short (Ctrl-C) leaves a row saying the retry began. Never throws.
   */
  async retryRow(row: OperatorRow, opts: RetryOptions): Promise<RetryResult> {
    const key = row.idempotency_key;
    const { db, schema } = this.deps;
    let audit: string;
    try {
      audit = await startOperatorAction(db, schema, {
        actor: opts.requestedBy,
        action: 'retry',
        key,
        tenantId: row.tenant_id,
        forced: opts.force,
        detail: opts.wait ? 'retry asked; waiting for its outcome' : 'retry asked',
      });
    } catch (err) {
      // Nothing unrecorded is done.
      return { key, outcome: 'failed', forced: opts.force, message: `not retried: recording it in operator_actions failed: ${scrub((err as Error).message)}` };
    }
    let result: RetryResult;
    try {
      result = await this.decide(row, opts);
      this.unreachableInARow = 0;
    } catch (err) {
      result = { key, outcome: 'failed', forced: opts.force, message: scrub((err as Error).message) };
      this.unreachableInARow = temporalUnreachable(err) ? this.unreachableInARow + 1 : 0;
    }
    try {
      await finishOperatorAction(db, schema, audit, result.outcome, result.message);
    } catch (err) {
      // The retry itself stands; its row says only that it began, which the operator must hear.
      result = { ...result, outcome: 'failed', message: `${result.message} (and recording its outcome in operator_actions failed: ${scrub((err as Error).message)})` };
    }
    return result;
  }

  private async decide(row: OperatorRow, opts: RetryOptions, describedAgain = false): Promise<RetryResult> {
    const key = row.idempotency_key;
    const done = (outcome: RetryOutcome, message: string): RetryResult => ({ key, outcome, forced: opts.force, message });
    // Nothing to do, not a refusal: the operator wants the event billed, and it is (a bulk retry also
    // meets rows another operator's retry delivered since its page was read).
    if ((DELIVERED as readonly string[]).includes(row.status)) return done('skipped', `already delivered (status ${row.status}): nothing to retry`);
    // Stripe keeps the identifier of a rejected or cancelled event: a resend would only be told "already exists".
    if (row.status === 'rejected_async') {
      return done(
        'refused',
        `Stripe rejected it after accepting it (${row.last_error_code ?? 'no code'}); its identifier stays taken at Stripe, so a retry would only be told "already exists": fix the cause, then \`billing-outbox rebill ${shellWord(key)}\` bills it under a new identifier`,
      );
    }
    if (row.status === 'cancelled') {
      return done('refused', 'it was cancelled at Stripe by an operator; a cancelled event is never retried (record the usage again as a new usage if it should be billed)');
    }
    if (row.status !== 'dead') return done('skipped', `not a dead letter (status ${row.status}): it is still in flight`);
    const now = this.deps.now();
    // Not even --force helps: Stripe refuses usage older than its window, whatever the identifier.
    if (tooOldToSend(row.occurred_at, now)) {
      return done(
        'refused',
        `it occurred at ${row.occurred_at.toISOString()}, outside Stripe's 35-day window (less an hour for delivery): Stripe would refuse it, so no retry can bill it: bill it another way or write it off, and record the decision (docs/operations.md, "Dead letters"); the row stays dead`,
      );
    }
    const fresh = withinResendWindow(row, now);
    if (!fresh && !opts.force) return done('refused', windowRefusal(row, now));

    const { client } = this.deps;
    const handle = client.workflow.getHandle(key);
    let status: WorkflowExecutionStatusName | 'NOT_FOUND';
    let closedAt: Date | undefined;
    let startedAt: Date | undefined;
    let runId: string | undefined;
    /** The run's task queue when it is not ours (it closed there): how it closed says nothing of our row. */
    let elsewhere: string | undefined;
    try {
      const described = await handle.describe();
      // An open run of another deployment (a namespace shared, or TEMPORAL_TASK_QUEUE changed):
      // signalling it would act on that deployment's event, not ours. (A closed one is reopened on
      // our queue, for our row.)
      const ours = this.deps.config.temporal.taskQueue;
      if (isOpenRun(described.status.name) && described.taskQueue !== ours) {
        const message = closedRunMessage(key, { kind: 'closed', status: 'OTHER_TASK_QUEUE', closedAt: undefined, taskQueue: described.taskQueue }, row.status);
        return done('refused', `${message} (this command uses task queue ${JSON.stringify(ours)}: if that run is ours, set TEMPORAL_TASK_QUEUE as the workers have it)`);
      }
      status = described.status.name;
      closedAt = described.closeTime;
      startedAt = described.startTime;
      runId = described.runId;
      if (described.taskQueue !== ours) elsewhere = described.taskQueue;
    } catch (err) {
      if (!(err instanceof WorkflowNotFoundError)) throw err;
      status = 'NOT_FOUND';
    }

    if (status === 'RUNNING') {
      try {
        const state = await this.queryState(key);
        // A run whose state is not dead has already taken a retry (another operator's, or a run
        // reopened since the row was read): signalling again would do nothing, so say so.
        if (state && state.status !== 'dead') return done('skipped', `its workflow is already retrying it (state ${state.status})`);
        // An Update needs a worker to take it; with none answering, it would wait for one for good.
        // A signal waits in the run's history instead, for whenever one comes.
        if (opts.wait && state) return await this.retryByUpdate(key, opts, opts.wait.timeoutMs);
        return await this.signalRetry(key, opts, state ? undefined : 'its state query went unanswered: is a worker running?');
      } catch (err) {
        // Closed since it was described (its dead-letter wait ended while this command ran, as a
        // week-old outage's dead letters all do within minutes): decided again as the closed run it is.
        if (err instanceof WorkflowNotFoundError && !describedAgain) return this.decide(row, opts, true);
        throw err;
      }
    }
    if (elsewhere !== undefined && status !== 'NOT_FOUND' && (status === 'COMPLETED' || REOPENABLE.has(status))) {
      return this.reopen(row, `${status} on task queue ${JSON.stringify(elsewhere)}, not this deployment's`, fresh, opts);
    }
    // A row rebilled after its run closed (a rebill cut short before its own run started): that run
    // sent only earlier identifiers, and the row records no attempt of this one. Its times bound
    // nothing of it: reopened as never attempted. Closed well before (Temporal's clock against
    // PostgreSQL's): the rebill's own run closes after it, and is never taken for an earlier one.
    if (
      row.rebilled_at &&
      row.first_attempted_at === null &&
      closedAt &&
      closedAt.getTime() + CLOCKS_APART_MS < row.rebilled_at.getTime() &&
      status !== 'NOT_FOUND' &&
      (status === 'COMPLETED' || REOPENABLE.has(status))
    ) {
      return this.reopen(row, `${status} before the rebill to its identifier`, fresh, opts);
    }
    // A row found dead because its run closed (workflow_closed: put back by hand, or a database
    // restored from an older backup) that records no attempt, yet whose run may have made some
    // that reached Stripe: the earliest they may have been (firstAttemptBound) stands in for its
    // first attempt, counts the resend window and is kept on the row. (A dead letter that died
    // with its own code and no attempt, its run closed after its wait, never reached Stripe.)
    let mayHaveReached: Date | undefined;
    if (status !== 'NOT_FOUND' && row.first_attempted_at === null && row.last_error_code === TemporalErrorCodes.workflowClosed && startedAt && runId) {
      const bound = await this.attemptBound(key, runId, startedAt, opts.force);
      if (typeof bound === 'string') return done('failed', bound);
      mayHaveReached = bound;
    }
    if (status === 'COMPLETED') {
      // Another operator may have reopened and delivered it since the row was read.
      const current = await findOperatorRow(this.deps.db, this.deps.schema, key);
      if (current?.status !== 'dead') return done('skipped', `no longer dead (now ${current?.status ?? 'missing'}): another retry got there first`);
      // Found by the relay or the closed-run sweep: the row was put back (by hand, or a database
      // restored from an older backup) after its run delivered it. A resend under the same
      // identifier is told "already exists" by Stripe while its dedup still holds, which marks the
      // row delivered: safe within the resend window counted from when the event may first have
      // reached Stripe (the run's close at the latest, or mayHaveReached), and only forced after that.
      if (current.last_error_code === TemporalErrorCodes.workflowClosed && closedAt) {
        const from = mayHaveReached ?? closedAt;
        const withinWindow = withinResendWindow({ first_attempted_at: from }, now);
        if (withinWindow || opts.force) return this.reopen(row, status, fresh && withinWindow, opts, from);
        return done(
          'refused',
          `its workflow completed at ${closedAt.toISOString()} (Temporal recorded it as delivered; it may have reached Stripe from ${from.toISOString()}), past the ${hours(SAFE_RESEND_WINDOW_MS)} safe resend window: ` +
            'reconcile first (billing-outbox reconcile); retry with --force only if Stripe does not have it',
        );
      }
      return done('refused', 'its workflow completed (Temporal recorded it as delivered) yet the row is dead: investigate with `billing-outbox inspect` before anything else');
    }
    if (status !== 'NOT_FOUND' && !REOPENABLE.has(status)) {
      return done('failed', `its workflow is ${status}; not reopening it`);
    }
    if (mayHaveReached) {
      const bounded = { ...row, first_attempted_at: mayHaveReached };
      const withinWindow = withinResendWindow(bounded, now);
      if (!withinWindow && !opts.force) {
        return done('refused', `its row records no attempt, but its workflow run (${status}, started ${startedAt!.toISOString()}) may have made some: ${windowRefusal(bounded, now)}`);
      }
      return this.reopen(row, status, withinWindow, opts, mayHaveReached);
    }
    return this.reopen(row, status, fresh, opts);
  }

  /**
   * `reachedStripeBy`: the event may have reached Stripe by then (its run completed then, or
   * started then and may have made attempts the row does not record): see reopenDeadLetter.
   */
  private async reopen(row: OperatorRow, was: string, fresh: boolean, opts: RetryOptions, reachedStripeBy?: Date): Promise<RetryResult> {
    const key = row.idempotency_key;
    const done = (outcome: RetryOutcome, message: string): RetryResult => ({ key, outcome, forced: opts.force, message });
    const { db, schema, client, config } = this.deps;

    const namespace = await identifierNamespaceOf(db, schema, config.stripe.identifierNamespace);
    const reopened = await reopenDeadLetter(db, schema, key, reachedStripeBy, storedIdentifier(key, 0, namespace));
    if (!reopened) {
      const current = await findOperatorRow(db, schema, key);
      return done('skipped', `no longer dead (now ${current?.status ?? 'missing'}): another retry got there first`);
    }
    try {
      const options = usageWorkflowStartOptions({ ...row, idempotency_key: key, tenant_id: reopened.tenant_id }, config, {
        reusePolicy: 'ALLOW_DUPLICATE',
        force: opts.force,
      });
      // The new run did not make the first attempt: it is told when that was, so that its `retry`
      // Update refuses a resend past the safe window as this command does.
      const firstAttemptedAt = (row.first_attempted_at ?? reachedStripeBy)?.getTime();
      if (firstAttemptedAt !== undefined) options.args = [{ ...options.args[0], firstAttemptedAt }];
      await client.workflow.start('usageWorkflow', options);
    } catch (err) {
      // A run open under the key now (the one before it was closed) is this start's, its answer
      // lost, or another operator's retry's: the row goes on with it.
      if (!(await openRunNow(client, key, config.temporal.taskQueue))) {
        const restored = await restoreDeadLetter(db, schema, key, reopened.previous_dead_at);
        return done(
          'failed',
          `could not start a new workflow run: ${scrub((err as Error).message)}; ${restored ? 'the row is dead again' : 'the row has moved on meanwhile'}`,
        );
      }
    }
    const how = `reopened: its workflow was ${was === 'NOT_FOUND' ? 'gone (past retention)' : was}; started a new run`;
    const result = done('reopened', `${fresh ? how : `${how}, forced past the 24 h identifier window`}${await this.taskQueueWarning()}`);
    if (!opts.wait) return result;
    // The run is started: the retry stands whatever happens to the wait for its outcome.
    const answer = await this.awaitOutcome(key, opts.wait.timeoutMs).catch((err: unknown) => new Error(scrub((err as Error).message)));
    if (answer instanceof Error) return { ...result, message: `${result.message}; its outcome is unknown: ${answer.message}` };
    return { ...result, message: `${result.message}; ${describeAnswer(answer)}`, ...(answer ? { answer } : {}) };
  }

  /**
   * firstAttemptBound, or why it could not be had. Forced, the bound only goes on the row: the
   * run's start stands in when its history cannot be read.
   */
  private async attemptBound(key: string, runId: string, startedAt: Date, force: boolean): Promise<Date | string> {
    try {
      return await firstAttemptBound(this.deps.client, key, runId, startedAt);
    } catch (err) {
      if (force) return startedAt;
      return `could not read its workflow run's history, which bounds when an attempt the row does not record may have reached Stripe: ${scrub((err as Error).message)}; the row stays dead (try again, or reconcile and retry with --force)`;
    }
  }

  /** unpolledWarning, asked once per command. */
  private unpolled?: Promise<string>;
  private taskQueueWarning(): Promise<string> {
    this.unpolled ??= unpolledWarning(this.deps.client, this.deps.config.temporal);
    return this.unpolled;
  }

  /** The open run's reopen signal: recorded in its history, acted on when its worker next runs it. */
  private async signalRetry(key: string, opts: RetryOptions, why: string | undefined): Promise<RetryResult> {
    await this.deps.client.workflow.getHandle(key).signal(reopenSignal, { force: opts.force, requestedBy: opts.requestedBy });
    const waited = opts.wait ? '; not waited for' : '';
    return { key, outcome: 'signalled', forced: opts.force, message: `signalled its open workflow to retry${why ? ` (${why}${waited})` : ''}` };
  }

  /**
   * The open run's `retry` Update: its validator refuses in the workflow what cannot be retried
   * (recording nothing); accepted, it answers with the new delivery's outcome, which is waited for
   * at most `timeoutMs` (after that the event is reported still on its way: the retry stands).
   */
  private async retryByUpdate(key: string, opts: RetryOptions, timeoutMs: number): Promise<RetryResult> {
    const done = (outcome: RetryOutcome, message: string, answer?: UsageState): RetryResult => ({ key, outcome, forced: opts.force, message, ...(answer ? { answer } : {}) });
    const { client } = this.deps;
    const handle = client.workflow.getHandle(key);
    try {
      let update;
      try {
        update = await client.withDeadline(Date.now() + ACCEPT_TIMEOUT_MS, () =>
          handle.startUpdate(retryUpdate, { args: [{ force: opts.force, requestedBy: opts.requestedBy }], waitForStage: WorkflowUpdateStage.ACCEPTED }),
        );
      } catch (err) {
        if (!(err instanceof WorkflowUpdateRPCTimeoutOrCancelledError)) throw err;
        // Its worker answered the state query but took no Update since (gone, or its workflow
        // task failing). Should the Update still be taken later, it finds the run retrying and
        // refuses; the signal finds it retrying after the Update and does nothing.
        return this.signalRetry(key, opts, `its workflow took no Update within ${formatDuration(ACCEPT_TIMEOUT_MS)}: is its worker running?`);
      }
      // Accepted: the retry stands whatever happens to the wait for its answer.
      const answer = await client.withDeadline(Date.now() + timeoutMs, () => update.result()).catch((err: unknown) => {
        if (err instanceof WorkflowUpdateFailedError || err instanceof WorkflowUpdateRPCTimeoutOrCancelledError) throw err;
        return new Error(scrub((err as Error).message));
      });
      if (answer instanceof Error) return done('retried', `accepted; its outcome is unknown: ${answer.message}`);
      return done('retried', describeAnswer(answer), answer);
    } catch (err) {
      if (err instanceof WorkflowUpdateFailedError && err.cause instanceof ApplicationFailure && err.cause.type === RETRY_REFUSED) {
        const reason = err.cause.details?.[0] as RetryRefusal | undefined;
        // Not dead any more, or already being retried: another operator got there first.
        return done(reason === 'window' ? 'refused' : 'skipped', `its workflow refused the retry: ${err.cause.message}`);
      }
      if (err instanceof WorkflowUpdateRPCTimeoutOrCancelledError) {
        const state = await this.queryState(key);
        return done('retried', `no answer within ${formatDuration(timeoutMs)}; ${describeAnswer(state ?? { status: 'dispatched', attempts: 0, lastError: null })}`, state);
      }
      throw err;
    }
  }

  /**
   * A reopened run's outcome: its state once it is no longer `dispatched` (dead again), or its
   * result once it completed (delivered); after `timeoutMs`, its state as it is (still on its way).
   */
  private async awaitOutcome(key: string, timeoutMs: number): Promise<UsageState | undefined> {
    const handle = this.deps.client.workflow.getHandle(key);
    const until = Date.now() + timeoutMs;
    for (;;) {
      const { status } = await handle.describe();
      if (status.name === 'COMPLETED') return (await handle.result()) as UsageState;
      if (status.name !== 'RUNNING' && status.name !== 'CONTINUED_AS_NEW') {
        return { status: 'dead', attempts: 0, lastError: { code: TemporalErrorCodes.workflowClosed, message: `its new run closed as ${status.name}` } };
      }
      const state = status.name === 'RUNNING' ? await this.queryState(key) : undefined;
      if (state && state.status !== 'dispatched') return state;
      if (Date.now() >= until) return state;
      await new Promise((resolve) => setTimeout(resolve, WAIT_POLL_MS));
    }
  }

  private async queryState(key: string): Promise<UsageState | undefined> {
    try {
      return await this.deps.client.withDeadline(Date.now() + QUERY_TIMEOUT_MS, () => this.deps.client.workflow.getHandle(key).query(stateQuery));
    } catch {
      return undefined;
    }
  }
}
