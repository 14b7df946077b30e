/**
 * One usage event's journey to Stripe. Workflow id = the event's idempotency key.
 *
 * Temporal's retry policy does the backoff between failed attempts. When the attempts run out (or
 * Stripe refuses the event for good) the row becomes a dead letter, and this workflow stays open
 * waiting for an operator's `retry` signal, so the dead letter is visible in the Web UI and can be
 * resent with the same identifier.
 *
 * Waiting is not failing: the delivery activity waits for the (customer, meter) lease (Stripe allows
 * one call at a time per customer and meter) and for its slot in the account-wide pace, and a 429
 * makes the workflow wait Stripe's Retry-After. None of these spends a retry attempt: the activity
 * answers `deferred`, and the workflow waits on a timer.
 */
import {
  ActivityCancellationType,
  ActivityFailure,
  allHandlersFinished,
  ApplicationFailure,
  CancellationScope,
  CancelledFailure,
  condition,
  continueAsNew,
  isCancellation,
  proxyActivities,
  proxyLocalActivities,
  setCurrentDetails,
  setHandler,
  sleep,
  TimeoutFailure,
  upsertSearchAttributes,
  workflowInfo,
} from '@temporalio/workflow';
import type { DeliveryActivities } from '../activities/delivery.js';
import { isAtStripe, isUnbilled, type OutboxStatus } from '../src/outbox/statuses.js';
import { inHours, SAFE_RESEND_WINDOW_MS } from '../src/stripe/rules.js';
import {
  codeSpan,
  ErrorTypes,
  markdownText,
  OutboxErrorKey,
  OutboxStatusKey,
  DEFERRALS_PER_RUN,
  REOPENS_PER_RUN,
  readReopenRequest,
  reopenSignal,
  RETRY_REFUSED,
  retryUpdate,
  rowChangedSignal,
  shellWord,
  stateQuery,
  TemporalErrorCodes,
  type DeliveryResult,
  type OutageHold,
  type ReopenRequest,
  type RetryRefusal,
  type UsageState,
  type UsageWorkflowInput,
} from './shared.js';


/**
 * The run's fairness key (its tenant's, set at start by src/temporal/start-usage.ts), passed on to
 * each activity it schedules. The server would let an activity inherit it anyway (a priority field
 * left unset means "the workflow's"); written out, the key is in the activity's own record, where
 * `describe` and the Web UI show it. A run started without one passes none, as before.
 */
const runPriority = () => {
  const priority = workflowInfo().priority;
  return priority?.fairnessKey ? { priority } : {};
};

const NON_RETRYABLE: readonly string[] = [ErrorTypes.rejected, ErrorTypes.missing, ErrorTypes.unsafeToSend, ErrorTypes.deferredTooLong];

export async function usageWorkflow(input: UsageWorkflowInput): Promise<UsageState> {
  const state: UsageState = { status: 'dispatched', attempts: 0, lastError: null };
  const row: RowMark = { dead: false };
  try {
    return await deliverEvent(input, state, row);
  } catch (err) {
    if (!isCancellation(err)) throw err;
    const { markDead } = proxyActivities<DeliveryActivities>({
      ...runPriority(),
      startToCloseTimeout: '30 seconds',
      retry: { initialInterval: '1 second', maximumInterval: '1 minute' },
      summary: 'Mark the outbox row dead: the workflow was cancelled',
    });
    // Cancelled (from the Web UI, the CLI, a client) while the event is in flight: no run would
    // ever mark the row again, so it becomes a dead letter with the reason before the run ends, in
    // a scope the cancellation cannot reach; `retry` then starts a new run. A dead letter keeps
    // Stripe's reason (its row and the Web UI's OutboxError): marked with it here if the
    // cancellation came before its own mark did. A delivered event stays delivered. (A terminated
    // run runs no code: the worker's closed-run sweep finds its row.)
    // The row is not made dead when it is at Stripe (a timed-out attempt's call answered since, an
    // error report): the run then ends listed as what the row is, not as a dead letter.
    const listAtStripe = (dead: { atStripe?: string | undefined }) => {
      if (dead.atStripe) {
        upsertSearchAttributes([
          { key: OutboxStatusKey, value: dead.atStripe },
          { key: OutboxErrorKey, value: null },
        ]);
      }
    };
    if (state.status === 'dead' && !row.dead && state.lastError) {
      const lastError = state.lastError;
      listAtStripe(await CancellationScope.nonCancellable(() => markDead({ key: input.key, ...lastError })));
    }
    if (state.status === 'dispatched') {
      // Listed with the dead letters in the Web UI, by its code, like any other.
      upsertSearchAttributes([
        { key: OutboxStatusKey, value: 'dead' },
        { key: OutboxErrorKey, value: TemporalErrorCodes.workflowCancelled },
      ]);
      const dead = await CancellationScope.nonCancellable(() =>
        markDead({
          key: input.key,
          code: TemporalErrorCodes.workflowCancelled,
          message: `its workflow was cancelled before the event was delivered; billing-outbox retry ${shellWord(input.key)} starts a new run (same identifier)`,
        }),
      );
      listAtStripe(dead);
    }
    throw err;
  }
}

/** Whether this run's last dead letter is on the row yet (its markDead has completed). */
interface RowMark {
  dead: boolean;
}

async function deliverEvent(input: UsageWorkflowInput, state: UsageState, row: RowMark): Promise<UsageState> {
  const { attemptTimeoutMs, maxRateLimitedMs, maximumAttempts } = input.retry;
  const retryPolicy = (attempts: number) => ({
    initialInterval: input.retry.initialIntervalMs,
    backoffCoefficient: input.retry.backoffCoefficient,
    maximumInterval: input.retry.maximumIntervalMs,
    maximumAttempts: attempts,
    nonRetryableErrorTypes: [...NON_RETRYABLE],
  });
  // The first attempt of a delivery runs as a local activity, inside the workflow task that
  // started the run: on the common path an event costs one workflow task (start, call, complete)
  // instead of three. Anything but an answer (a failure that may pass, a deferral) goes on as a
  // regular activity, under Temporal's retry policy and timers, with the attempts that are left.
  // A cancelled run waits for the attempt under way to end (bounded by its timeouts) rather than
  // leave it behind: a call Stripe takes meanwhile is then the run's outcome, not a row the run has
  // just marked dead (workflow_cancelled) that turns sent after it closed, listed dead in the Web UI.
  const cancellationType = ActivityCancellationType.WAIT_CANCELLATION_COMPLETED;
  const { deliverUsage: deliverInTask } = proxyLocalActivities<DeliveryActivities>({
    cancellationType,
    startToCloseTimeout: attemptTimeoutMs,
    retry: { maximumAttempts: 1 },
    summary: 'Report to Stripe: first attempt, in the workflow task',
  });
  /**
   * The regular activity with the attempts the event has left: RETRY_MAXIMUM_ATTEMPTS is the
   * event's budget, spent across deferrals and runs, not a fresh one for each activity scheduled.
   * At least one: a delivery that deferred always gets its next attempt.
   */
  const deliverWithBudget = (spent: number) =>
    proxyActivities<DeliveryActivities>({
      ...runPriority(),
      summary: "Report to Stripe: again, on Temporal's retry policy",
      cancellationType,
      startToCloseTimeout: attemptTimeoutMs,
      // The attempt heartbeats throughout (waiting for the lease or a batch, and the call): a dead
      // worker's attempt is retried elsewhere after this, not after the whole attempt timeout.
      heartbeatTimeout: input.retry.heartbeatTimeoutMs,
      retry: retryPolicy(Math.max(1, maximumAttempts - spent)),
    }).deliverUsage;
  // Bookkeeping on our own database: retried until it works, whatever the delivery policy says.
  const bookkeeping = {
    ...runPriority(),
    startToCloseTimeout: '30 seconds',
    retry: { initialInterval: '1 second', maximumInterval: '1 minute' },
  } as const;
  const { markDead } = proxyActivities<DeliveryActivities>({ ...bookkeeping, summary: 'Mark the outbox row dead' });
  const { markReopened } = proxyActivities<DeliveryActivities>({ ...bookkeeping, summary: "Reopen the outbox row for an operator's retry" });
  const { readRowStatus } = proxyActivities<DeliveryActivities>({ ...bookkeeping, summary: 'Read the outbox row: it changed outside this run' });

  // What the Web UI shows as this run's current details (kept in memory, served by a query: no history).
  const show = (lines: string[]) => setCurrentDetails(lines.join('\n\n'));
  show([`**Delivering** to Stripe with identifier ${codeSpan(input.key)}.`]);
  let requested: ReopenRequest | undefined;
  let force = input.force === true;
  // When the event was first attempted (workflow time of this chain's first attempt, or the row's
  // time passed by a reopen); a forced attempt past the window starts a new one, as on the row.
  let firstAttemptedAt = input.firstAttemptedAt;
  // Deliveries begun in this run, the last one settled (delivered, or dead with its bookkeeping
  // done), and whether the run is continuing as new: what an accepted `retry` Update waits for.
  let begun = 0;
  let settled = 0;
  let continuing = false;
  // Told while a dead letter that its row changed outside the run (Stripe's error report): read again.
  let rowChanged = false;
  setHandler(stateQuery, () => state);
  setHandler(rowChangedSignal, () => {
    if (state.status === 'dead') rowChanged = true;
  });
  setHandler(reopenSignal, (request?: ReopenRequest) => {
    // Only a dead letter can be retried; a retry sent while the event is in flight means nothing.
    if (state.status === 'dead') requested = readReopenRequest(request);
  });
  setHandler(
    retryUpdate,
    async (request?: ReopenRequest) => {
      // The delivery this retry starts: the next one (the validator took it only while dead, so
      // the one before has failed, though its bookkeeping may still be running).
      const mine = begun + 1;
      requested = readReopenRequest(request);
      await condition(() => settled >= mine || continuing);
      return { ...state, lastError: state.lastError && { ...state.lastError } };
    },
    {
      // Refused here, nothing is recorded in the history: the caller hears why, and the run is as it was.
      validator: (raw?: ReopenRequest) => {
        const request = readReopenRequest(raw);
        const refuse = (reason: RetryRefusal, message: string) => {
          throw ApplicationFailure.create({ type: RETRY_REFUSED, message, details: [reason], nonRetryable: true });
        };
        if (state.status !== 'dead') refuse('not_dead', `not a dead letter: the event is ${state.status}, nothing to retry`);
        if (requested !== undefined) refuse('under_way', 'a retry of this dead letter is already under way');
        if (request.force !== true && firstAttemptedAt !== undefined && Date.now() - firstAttemptedAt > SAFE_RESEND_WINDOW_MS) {
          refuse(
            'window',
            `first attempted at ${new Date(firstAttemptedAt).toISOString()}, past the ${inHours(SAFE_RESEND_WINDOW_MS)} h safe resend window: ` +
              'Stripe may no longer recognise the identifier, so a resend could bill twice. Reconcile first (billing-outbox reconcile); force only if Stripe does not have it',
          );
        }
      },
    },
  );

  /**
   * Waits for an operator's retry signal, or takes the one that arrived since the event died. A dead
   * letter's run waits at most `deadLetterOpenMs`, then closes: the row stays dead, and
   * `billing-outbox retry` reopens it with a new run, so open runs cannot pile up without bound.
   * Told its row changed meanwhile, it reads the row, and ends with it once it is no longer dead.
   */
  const nextReopen = async (): Promise<{ kind: 'reopen'; request: ReopenRequest } | { kind: 'closed' } | { kind: 'settled'; status: OutboxStatus }> => {
    const closesAt = Date.now() + input.retry.deadLetterOpenMs;
    for (let left = input.retry.deadLetterOpenMs; left > 0; left = closesAt - Date.now()) {
      await condition(() => requested !== undefined || rowChanged, left);
      if (requested !== undefined || !rowChanged) break;
      rowChanged = false;
      const now = await readRowStatus(input.key);
      // Only a row at Stripe ends the run (sent, accepted, rejected_async, cancelled): one put back in
      // flight (a rebill about to signal this run) is not this run's to close. A retry that came
      // while the row was read goes first: its delivery finds what the row is.
      if (now !== null && isAtStripe(now) && requested === undefined) return { kind: 'settled', status: now };
    }
    // Judged by the request, not by how the wait ended: a signal that arrives in the same workflow
    // task as the deadline is taken (the CLI said it signalled), not dropped with the run. Which of
    // the two settles `condition` first is the SDK's order of the task's jobs (today: signals before
    // timers, so the wait says true); this line does not depend on it. workflows.test.ts puts both
    // in one task and checks the retry happens.
    if (requested === undefined) return { kind: 'closed' };
    const request = requested ?? {};
    requested = undefined;
    rowChanged = false;
    if (request.newIdentifier === true) firstAttemptedAt = undefined;
    // In flight from here, in memory (the upsert follows the row): a second retry is refused at once.
    state.status = 'dispatched';
    return { kind: 'reopen', request };
  };

  /** Ends the run listed as its row is (at Stripe after all), once the handlers under way are done. */
  const endListedAs = async (status: OutboxStatus): Promise<UsageState> => {
    state.status = status;
    state.lastError = null;
    upsertSearchAttributes([
      { key: OutboxStatusKey, value: status },
      { key: OutboxErrorKey, value: null },
    ]);
    await condition(allHandlersFinished);
    return state;
  };

  // How long this delivery has waited on Stripe's 429s since Stripe last answered otherwise,
  // whatever run we are in.
  let rateLimitedMs = input.rateLimitedMs ?? 0;
  // Failed attempts of the delivery in progress, whatever run we are in.
  let spent = input.attemptsSpent ?? 0;
  // A hold of the run before, for this run's first delivery (UsageWorkflowInput.heldByOutage).
  let carriedHold = input.heldByOutage;

  /**
   * Calls Stripe until it answers for good, waiting out deferrals. Throws on failure. Only Stripe's
   * own 429s are bounded (RETRY_MAX_RATE_LIMITED_MS): waiting for our own pace or for a busy
   * customer is the backlog draining, and never dead-letters an event.
   */
  const deliver = async (): Promise<Extract<DeliveryResult, { attempts: number }>> => {
    let inTask = true;
    // The last try of Stripe was held as Stripe down (DeliverInput.heldByOutage); the run's first
    // delivery takes it from the run before (continue-as-new).
    let heldByOutage: OutageHold | undefined = carriedHold;
    carriedHold = undefined;
    for (let deferrals = 1; ; deferrals++) {
      let result: DeliveryResult;
      // A forced reopen forces one attempt: that attempt starts a new 24 h window (beginAttempt).
      const forcing = force;
      force = false;
      if (forcing && firstAttemptedAt !== undefined && Date.now() - firstAttemptedAt > SAFE_RESEND_WINDOW_MS) firstAttemptedAt = undefined;
      firstAttemptedAt ??= Date.now();
      if (inTask && spent === 0) {
        inTask = false;
        try {
          result = await deliverInTask({ key: input.key, force: forcing, ...(heldByOutage ? { heldByOutage } : {}) });
        } catch (err) {
          // A failure that another attempt cannot help, or no attempts left: as the retry policy would.
          spent += 1;
          // A failed try ends a stretch of 429s, as a deferral's failedBefore does.
          rateLimitedMs = 0;
          if (isFinal(err) || spent >= maximumAttempts) throw err;
          await sleep(input.retry.initialIntervalMs);
          continue;
        }
      } else {
        inTask = false;
        result = await deliverWithBudget(spent)({ key: input.key, force: forcing, ...(heldByOutage ? { heldByOutage } : {}) });
      }
      if (result.outcome !== 'deferred') return result;
      // Kept through waits of our own (the pace, the lease, our database), until Stripe answers.
      if (result.reason === 'stripe_down') heldByOutage = result.outageHold;
      else if (result.reason === 'rate_limited' || result.reason === 'stripe_credentials') heldByOutage = undefined;
      // Put off before it began on the row (a busy lease, our database away): the force is still
      // the operator's, for the attempt that does begin.
      if (forcing && result.begun === false) force = true;
      spent += result.failedBefore ?? 0;
      // The 429 budget bounds the waits of an unbroken stretch of Stripe's 429s. Only another answer
      // from Stripe ends the stretch (a failed try, a refused key, a failure while it is down); waits that are ours (the pace, a
      // busy lease, our database away) neither end it nor count towards it.
      if ((result.failedBefore ?? 0) > 0 || result.reason === 'stripe_credentials' || result.reason === 'stripe_down') rateLimitedMs = 0;
      let waitMs = result.waitMs;
      if (result.reason === 'rate_limited') {
        if (rateLimitedMs > maxRateLimitedMs) {
          throw ApplicationFailure.create({
            type: ErrorTypes.deferredTooLong,
            message: `Stripe kept answering 429 for over ${Math.round(maxRateLimitedMs / 1000)} s of waiting on it, with no other answer between`,
            details: ['rate_limited'],
            nonRetryable: true,
          });
        }
        // A Retry-After past the budget (a proxy's day, an HTTP date read by a clock behind) is cut
        // to it: the try after it gets through or ends the stretch with this reason, rather than
        // wake past the 23 h identifier window and die for that.
        waitMs = Math.min(waitMs, maxRateLimitedMs - rateLimitedMs + 1);
        rateLimitedMs += waitMs;
      }
      show([
        `**Waiting** ${WAITING_FOR[result.reason]}; next try at ${new Date(Date.now() + waitMs).toISOString()}. Waiting spends no retry attempt.`,
        `Identifier ${codeSpan(input.key)}.`,
      ]);
      await sleep(waitMs);
      // The wait is over: its reason must not stay on the run's page while the next tries fail otherwise.
      show([`**Delivering** to Stripe with identifier ${codeSpan(input.key)}.`]);
      // Deferrals add history; a very hot customer must not grow it without bound.
      if (workflowInfo().continueAsNewSuggested || deferrals >= (input.deferralsPerRun ?? DEFERRALS_PER_RUN)) {
        // A retry Update waiting on this delivery answers `dispatched` now: the new run cannot answer it.
        continuing = true;
        await condition(allHandlersFinished);
        await continueAsNew<typeof usageWorkflow>({
          ...input,
          force,
          firstAttemptedAt,
          attemptsSpent: spent,
          rateLimitedMs,
          heldByOutage,
        });
      }
    }
  };

  // Operator retries this run has taken (reopensPerRun).
  let reopens = 0;
  for (;;) {
    const delivery = ++begun;
    try {
      const result = await deliver();
      state.attempts = result.attempts;
      state.lastError = null;
      // v1: `sent`; v2: `accepted` (the stream validates later), as the row says.
      // Not upserted: a run that completes is a delivered event (ExecutionStatus "Completed"), and
      // an upsert would cost every event one more history event and, on Temporal Cloud, one more
      // billable action. OutboxStatus changes only while the run stays open (dead, retried).
      state.status = result.outcome === 'accepted' ? 'accepted' : 'sent';
      // Found at Stripe by an earlier attempt's answer: as the row says (v2: accepted).
      if (result.outcome === 'already_sent' && result.status) state.status = result.status;
      if (result.outcome === 'already_sent' && result.status && isUnbilled(result.status)) {
        // Stripe rejected it (an error report) or an operator cancelled it while this run waited: it
        // ends listed as that, not as one more delivered event.
        upsertSearchAttributes([
          { key: OutboxStatusKey, value: result.status },
          { key: OutboxErrorKey, value: null },
        ]);
      }
      settled = delivery;
      // A retry Update waiting on this delivery gets its answer before the run completes.
      await condition(allHandlersFinished);
      return state;
    } catch (err) {
      if (isCancellation(err) || (!(err instanceof ActivityFailure) && !(err instanceof ApplicationFailure))) throw err;
      // Cancelled while an attempt ran on a worker that is gone: the server waited for the attempt
      // (cancellationType above), and it ended timed out, not cancelled. The run's cancellation
      // all the same (workflow_cancelled), not the event's failure.
      if (CancellationScope.current().consideredCancelled && err instanceof ActivityFailure && err.cause instanceof TimeoutFailure) {
        throw new CancelledFailure('the workflow was cancelled while an attempt was under way on a worker that did not answer');
      }
      state.lastError = describeFailure(err);
      // Dead from here on, before the row is: an operator who sees the dead row and signals at
      // once must not have the signal dropped while the bookkeeping is still running.
      requested = undefined;
      state.status = 'dead';
      // One upsert: the list shows why it died as soon as it shows that it did.
      upsertSearchAttributes([
        { key: OutboxStatusKey, value: 'dead' },
        { key: OutboxErrorKey, value: state.lastError.code },
      ]);
      const dead = await markDead({ key: input.key, ...state.lastError });
      if (dead.atStripe) {
        // Not dead after all: an earlier try whose attempt timed out had its call answered since,
        // and the row is at Stripe (or an error report or a cancel came first). The run ends with
        // the row, not as a dead letter waiting a week for a retry that has nothing to do.
        state.attempts = dead.attempts;
        // A retry Update accepted meanwhile (the run said dead) waits for the next delivery: there
        // is none to make, and its answer is this state.
        settled = begun + 1;
        return endListedAs(dead.atStripe);
      }
      row.dead = true;
      state.attempts = dead.attempts;
      // The row's resend window, not this run's stamp: a try that never reached Stripe (a missing
      // customer or meter, a refused key) took its attempt back on the row, and a retry of it
      // must not be refused as past the window when nothing was ever sent.
      if (dead.firstAttemptedAt !== undefined) firstAttemptedAt = dead.firstAttemptedAt ?? undefined;
      const closesAt = new Date(Date.now() + input.retry.deadLetterOpenMs);
      show([
        `**Dead letter** after ${state.attempts} attempt(s). Stripe's last answer: ${codeSpan(state.lastError.code)}: ${markdownText(state.lastError.message)}`,
        // The command as it runs in the image (on PATH); from a checkout or an application that
        // installed the package, npx finds the same bin.
        `Fix the cause, then retry with the same identifier: ${codeSpan(`billing-outbox retry ${shellWord(input.key)}`)} (\`npx billing-outbox …\` from a checkout or your application; or signal \`retry\` here).`,
        `If nobody retries it, this run closes as Failed at ${closesAt.toISOString()}; the row stays dead and the retry command still works.`,
      ]);
      settled = delivery;
    }
    const next = await nextReopen();
    if (next.kind === 'settled') {
      // Not a dead letter any more (Stripe's error report rejected it, say): the run ends as the
      // row is, listed as that, not as a dead letter waiting for a retry with nothing to do.
      return endListedAs(next.status);
    }
    if (next.kind === 'closed') {
      // Nobody retried it in time: the run ends (as Failed, so no list counts it as delivered), the
      // row stays dead, and the CLI reopens it if it is ever retried.
      throw ApplicationFailure.create({
        type: ErrorTypes.deadLetterClosed,
        message: `dead letter not retried within ${Math.round(input.retry.deadLetterOpenMs / 3_600_000)} h; the row stays dead: billing-outbox retry ${shellWord(input.key)} reopens it`,
        details: [state.lastError?.code ?? 'dead'],
        nonRetryable: true,
      });
    }
    const reopen = next.request;
    force = reopen.force === true;
    row.dead = false;
    // A new delivery: its attempts and 429s are counted afresh.
    rateLimitedMs = 0;
    spent = 0;
    await markReopened(input.key);
    upsertSearchAttributes([
      { key: OutboxStatusKey, value: 'dispatched' },
      { key: OutboxErrorKey, value: null },
    ]);
    show([`**Retrying** at ${reopen.requestedBy ? `${markdownText(reopen.requestedBy)}'s` : "an operator's"} request${force ? ' (forced past the 24 h guard)' : ''}, with identifier ${codeSpan(input.key)}.`]);
    // A dead letter retried again and again (a job retrying it every minute) grows the history
    // by each retry: the retried delivery goes on in a new run before Temporal's limit closes this one.
    if (workflowInfo().continueAsNewSuggested || ++reopens >= (input.reopensPerRun ?? REOPENS_PER_RUN)) {
      // A retry Update waiting on this delivery answers `dispatched` now: the new run cannot answer it.
      continuing = true;
      await condition(allHandlersFinished);
      await continueAsNew<typeof usageWorkflow>({ ...input, force, firstAttemptedAt, attemptsSpent: 0, rateLimitedMs: 0, heldByOutage: undefined });
    }
  }
}

/** How the Web UI's current details say why a delivery waits. */
const WAITING_FOR: Record<Extract<DeliveryResult, { outcome: 'deferred' }>['reason'], string> = {
  rate_limited: 'for Stripe: it answered 429 (rate limited)',
  paced: "for a slot in the account's pace (STRIPE_RATE_LIMIT_PER_SECOND)",
  lease_busy: 'for the (customer, meter) lease: another call for this customer and meter is in flight',
  database_unavailable: 'for our PostgreSQL, which is unreachable',
  stripe_credentials: 'for a working Stripe API key: Stripe refused ours (401/403). Fix STRIPE_API_KEY; delivery resumes by itself',
  stripe_down:
    "for Stripe to come back: calls for two customers and more fail (5xx or no answer) with no other answer between, as the worker that tried this one sees them. A call made is counted on the row; up to RETRY_MAX_OUTAGE_MS after the event's first attempt (or its dispatch) none spends the retry budget",
  meter_replacing:
    "for the usage's meter: Stripe has it deactivated, with no active meter for its event name yet (an operator replacing it); for up to 15 minutes after the deactivation, then it is dead as no_meter",
  stamped_ahead:
    "for the usage's time: it is stamped more than 5 minutes ahead of Stripe's clock as this worker reads it (its own; v2: corrected by the skew measured against Stripe's, billing_outbox_stripe_clock_skew_seconds), which Stripe would refuse",
};

/** Whether a delivery failure is one no retry can change (Stripe's refusal, a missing row, an unsafe resend). */
function isFinal(err: unknown): boolean {
  if (isCancellation(err)) return true;
  const failure = err instanceof ActivityFailure ? err.cause : err;
  return failure instanceof ApplicationFailure && (failure.nonRetryable || NON_RETRYABLE.includes(failure.type ?? ''));
}

/** The code and message the delivery activity attached to its last failure. */
function describeFailure(err: ActivityFailure | ApplicationFailure): { code: string; message: string } {
  const cause = err instanceof ApplicationFailure ? err : err.cause;
  if (cause instanceof ApplicationFailure) {
    const code = typeof cause.details?.[0] === 'string' ? cause.details[0] : (cause.type ?? 'error');
    return { code, message: cause.message };
  }
  // Timeouts and cancellations carry no ApplicationFailure.
  return { code: cause?.name ?? 'activity_failure', message: cause?.message ?? err.message };
}
