/**
 * Names shared by workflows, activities and clients: signals, queries, search attributes, and the
 * shapes that cross the workflow boundary. Importable from both sides (no Node APIs here).
 */
import { defineSearchAttributeKey, SearchAttributeType } from '@temporalio/common';
import { defineQuery, defineSignal, defineUpdate } from '@temporalio/workflow';
import type { AT_STRIPE, OutboxStatus } from '../src/outbox/statuses.js';

export type { OutboxStatus };

/** Current status of the event, kept in step with the outbox row; the Web UI and CLI filter on it. */
export const OutboxStatusKey = defineSearchAttributeKey('OutboxStatus', SearchAttributeType.KEYWORD);
export const TenantIdKey = defineSearchAttributeKey('TenantId', SearchAttributeType.KEYWORD);
/**
 * Why a dead letter died (the row's `last_error_code`: Stripe's code, or one of ErrorTypes'
 * reasons), set in the same upsert that makes OutboxStatus `dead` and removed when it is retried:
 * the Web UI's list shows why without opening the run, and filters on it.
 */
export const OutboxErrorKey = defineSearchAttributeKey('OutboxError', SearchAttributeType.KEYWORD);
/** Every custom search attribute the namespace must have (Keyword), registered by each setup path. */
export const SEARCH_ATTRIBUTES = [OutboxStatusKey, TenantIdKey, OutboxErrorKey];

/**
 * Temporal's retry policy of the Stripe call (RETRY_*), and the bounds around it: one type for the
 * configuration (src/config.ts `retry`) and the usage workflow's input.
 */
export interface RetryPolicy {
  initialIntervalMs: number;
  backoffCoefficient: number;
  maximumIntervalMs: number;
  maximumAttempts: number;
  /**
   * How long one attempt may take before Temporal gives up on it and retries (derived in
   * src/config.ts `resolveTimings`). Also bounds how long a crashed worker's in-flight attempt
   * holds the event.
   */
  attemptTimeoutMs: number;
  /** A regular attempt heartbeats throughout: a dead worker's attempt is retried after this. */
  heartbeatTimeoutMs: number;
  /** How long Stripe may keep answering 429 before the event is dead-lettered (RETRY_MAX_RATE_LIMITED_MS). */
  maxRateLimitedMs: number;
  /** How long a dead letter's run stays open waiting for a retry signal (DEAD_LETTER_OPEN_DAYS). */
  deadLetterOpenMs: number;
}

export interface UsageWorkflowInput {
  /** The outbox row's idempotency key: also this workflow's id and Stripe's `identifier`. */
  key: string;
  tenantId: string;
  retry: RetryPolicy;
  /**
   * An operator's forced reopen, not yet used: the next attempt may resend past the 24 h window
   * (and starts a new one, see beginAttempt). Used up by that attempt, whatever its outcome.
   */
  force?: boolean;
  /**
   * When the event was first attempted (ms since the epoch), for a run that did not make that
   * attempt itself: carried across continue-as-new, and passed by an operator's reopen from the
   * row. The `retry` Update's validator refuses a resend past the safe window from it.
   */
  firstAttemptedAt?: number;
  /**
   * How long (ms) the delivery has waited on an unbroken stretch of Stripe 429s, carried across
   * continue-as-new so that RETRY_MAX_RATE_LIMITED_MS bounds the whole stretch, not each run. Any
   * other answer from Stripe ends the stretch.
   */
  rateLimitedMs?: number;
  /**
   * Attempts of the delivery in progress that failed (RETRY_MAXIMUM_ATTEMPTS is the event's budget,
   * not each activity's): carried across deferrals and continue-as-new, reset by an operator's retry.
   */
  attemptsSpent?: number;
  /** The delivery's last try was held as Stripe down (DeliverInput.heldByOutage): carried across continue-as-new. */
  heldByOutage?: OutageHold;
  /**
   * Deferrals (429s, pacing, a busy customer) one run waits out before continuing as new, besides
   * whenever the server suggests it: each adds about a dozen history events. Set by whoever starts
   * the run (DEFERRALS_PER_RUN), not read from the code as it replays: a later release that lowers
   * it must not change where an open run continues as new (a non-determinism error).
   */
  deferralsPerRun?: number;
  /**
   * Operator retries of a dead letter one run takes before continuing as new, besides whenever the
   * server suggests it: each adds about twenty history events (a job retrying every minute would
   * reach Temporal's history limit in about two days, and the run be closed for it). Set by whoever
   * starts the run (REOPENS_PER_RUN), as deferralsPerRun is.
   */
  reopensPerRun?: number;
}

/** UsageWorkflowInput.deferralsPerRun of the runs this release starts. */
export const DEFERRALS_PER_RUN = 200;

/** UsageWorkflowInput.reopensPerRun of the runs this release starts. */
export const REOPENS_PER_RUN = 50;

/** RelayWorkflowInput.callsPerRun of the runs this release starts. */
export const RELAY_CALLS_PER_RUN = 200;

export interface DeliverInput {
  key: string;
  /** Operator override of the identifier-window guard (see ReopenRequest.force). */
  force?: boolean;
  /**
   * The run's last try of Stripe was held because Stripe was down: a worker that has not judged so
   * itself, and has had no answer from Stripe since a worker last did, holds the next such failure
   * too instead of spending an attempt on it, for up to an hour after that judgement.
   */
  heldByOutage?: OutageHold;
}

/** A try held because Stripe was down (ms): since when, and when a worker last judged so by its own calls. */
export interface OutageHold {
  since: number;
  judgedAt: number;
}

/**
 * Why a delivery was put off without spending an attempt of the retry policy: Stripe answered 429
 * (`rate_limited`, the only one bounded by RETRY_MAX_RATE_LIMITED_MS), our own account-wide pace
 * had no slot soon enough (`paced`), another call held the (customer, meter) lease (`lease_busy`),
 * or our own PostgreSQL was unreachable (`database_unavailable`: our outage must never dead-letter
 * an event; its retries resume the delivery, and Stripe's dedup absorbs a call made again), or the
 * usage is stamped ahead of Stripe's 5-minute window by this worker's clock (`stamped_ahead`:
 * clock skew, bounded by MAX_AHEAD_WAIT_MS in src/stripe/send-check.ts), or Stripe refused the
 * deployment's API key (`stripe_credentials`: 401/403; about the key, not the event, so delivery
 * holds until the key works, bounded in the end by Stripe's 35-day window), or Stripe is down
 * (`stripe_down`: a 5xx or no answer while every customer's calls fail so, src/stripe/outage.ts;
 * bounded by RETRY_MAX_OUTAGE_MS from the event's first attempt, after which failures spend attempts),
 * or the event's meter is being replaced (`meter_replacing`: deactivated, no active one yet; bounded
 * by METER_SWAP_MS in src/stripe/meters.ts, after which the event is dead as `no_meter`).
 */
export type DeferralReason = 'rate_limited' | 'paced' | 'lease_busy' | 'database_unavailable' | 'stamped_ahead' | 'stripe_credentials' | 'stripe_down' | 'meter_replacing';

/** What one attempt of the delivery activity answers. */
export type DeliveryResult =
  /**
   * `sent`: v1, Stripe took it now (final); `accepted`: v2, the stream took it (validated later);
   * `duplicate`: Stripe already had it (an earlier lost answer); `already_sent`: the row says so,
   * and `status` what it is at Stripe (an error report or a cancel may have come since).
   */
  | { outcome: 'sent' | 'accepted' | 'duplicate'; attempts: number }
  | { outcome: 'already_sent'; attempts: number; status?: (typeof AT_STRIPE)[number] }
  /**
   * Not this time, and not a failure: the workflow waits `waitMs` and asks again (see
   * DeferralReason). `failedBefore`: attempts of this activity that failed before this one
   * deferred (Temporal retried them within the activity): they are spent from the event's budget.
   * `begun: false`: the attempt deferred before it began on the row (it touched nothing there), so
   * a forced retry's force still stands for the next one. `outageHold`: `stripe_down`'s, passed on
   * to the next try (DeliverInput.heldByOutage).
   */
  | { outcome: 'deferred'; reason: DeferralReason; waitMs: number; attempts: number; failedBefore?: number; begun?: false; outageHold?: OutageHold };

export interface UsageState {
  status: OutboxStatus;
  /** Calls made to Stripe for this event, as counted on the outbox row. */
  attempts: number;
  lastError: { code: string; message: string } | null;
}

/** An operator's retry of a dead letter (the CLI's `retry`, or the `retry` signal in the Web UI). */
export interface ReopenRequest {
  /**
   * Resend even though the event's first attempt is older than Stripe's 24-hour identifier
   * window, where Stripe can no longer tell it is a duplicate. Only after reconciliation.
   */
  force?: boolean;
  /**
   * Sent by a rebill: the event goes out under an identifier Stripe never had, so the 24-hour
   * window starts again with its next attempt (the earlier identifier's age no longer matters).
   */
  newIdentifier?: boolean;
  /** Who asked, for the record. */
  requestedBy?: string;
}

/**
 * A retry's request as it arrives: the Web UI's signal and Update forms, and the temporal CLI, send
 * whatever JSON an operator types. Only `force: true` and `newIdentifier: true` count, and
 * `requestedBy` only as text (at most 200 characters); anything else is left out. A `requestedBy`
 * that was an object failed every workflow task of the run once the row was reopened.
 */
export function readReopenRequest(raw: unknown): ReopenRequest {
  const given = raw !== null && typeof raw === 'object' && !Array.isArray(raw) ? (raw as Record<string, unknown>) : {};
  return {
    ...(given.force === true ? { force: true } : {}),
    ...(given.newIdentifier === true ? { newIdentifier: true } : {}),
    ...(typeof given.requestedBy === 'string' && given.requestedBy !== '' ? { requestedBy: given.requestedBy.slice(0, 200) } : {}),
  };
}

/**
 * Sent by an operator to a dead letter's open run: reopen it, and deliver again with the same
 * identifier. In code the operator's action is "reopen" (Temporal's "retry" is its retry policy);
 * on the wire the signal keeps the name operators type in the Web UI and the CLI: `retry`.
 */
export const reopenSignal = defineSignal<[ReopenRequest?]>('retry');
/**
 * The same reopen as an Update, for a caller that wants the answer (`billing-outbox retry --wait`).
 * Its validator refuses, before anything is written to the history, what cannot be retried: a run
 * whose event is not dead (in flight, or already being retried), and an event first attempted past
 * the safe resend window without `force`. Accepted, it answers once the new delivery has settled:
 * `sent`/`accepted`, or `dead` again with Stripe's answer in `lastError`, or `dispatched` when the
 * run continued as new while the delivery still waits (the new run carries on with it).
 */
export const retryUpdate = defineUpdate<UsageState, [ReopenRequest]>('retry');
export const stateQuery = defineQuery<UsageState>('state');
/**
 * The event's row changed outside its run: sent to a dead letter's open run when Stripe's error
 * report made its row `rejected_async` (src/api/webhooks.ts), or when an attempt the run had given
 * up on delivered after all (activities/index.ts `deliveredLateNotice`). The run reads its row
 * again, and ends with it once it is at Stripe, instead of showing a dead letter until it closes.
 */
export const rowChangedSignal = defineSignal('rowChanged');
/**
 * The failure type of a `retry` Update its validator refused; its first detail says why (a
 * RetryRefusal), its message says it to a person.
 */
export const RETRY_REFUSED = 'RetryRefused';
/** `not_dead`: in flight or delivered; `under_way`: already being retried; `window`: past the safe resend window without force. */
export type RetryRefusal = 'not_dead' | 'under_way' | 'window';

export interface RelayWorkflowInput {
  relayId: string;
  /**
   * Activity calls per run before continuing as new (each adds a handful of history events). In the
   * input, as UsageWorkflowInput.deferralsPerRun is, so that a release changing it leaves open runs
   * replaying as they ran.
   */
  callsPerRun?: number;
}

/** Error types the delivery activity throws; the workflow records them on the row. */
export const ErrorTypes = {
  /** Stripe refused the event for good (4xx other than 429 and the duplicate identifier), or has no meter for it. */
  rejected: 'StripeRejected',
  retryable: 'StripeRetryable',
  /** 429s for longer than RETRY_MAX_RATE_LIMITED_MS. */
  deferredTooLong: 'DeferredTooLong',
  /** The outbox row or its billing customer is missing: nothing to send. */
  missing: 'OutboxRowMissing',
  /** A dead letter's run closed after DEAD_LETTER_OPEN_DAYS without a retry signal (the row stays dead). */
  deadLetterClosed: 'DeadLetterClosed',
  /** Sending now could bill twice (identifier window passed) or Stripe cannot take it (timestamp). */
  unsafeToSend: 'UnsafeToSend',
} as const;

/**
 * The `last_error_code`s written when Temporal, not Stripe, is why an event is not on its way: the
 * operator's `dead` list and `status` group dead letters by them, and `retry` reopens each.
 */
export const TemporalErrorCodes = {
  /** Temporal refused the start for good (InvalidArgument and the like); its answer is the message. */
  startRefused: 'temporal_start_refused',
  /** The last start failed for a reason that may pass (Temporal away): the row waits for a relay, still counted. */
  startFailing: 'temporal_start_failed',
  /** The key's run closed (terminated, cancelled, timed out, failed, gone, or completed) and left the row undelivered. */
  workflowClosed: 'workflow_closed',
  /** The usage workflow was cancelled; it marked its row dead on the way out. */
  workflowCancelled: 'workflow_cancelled',
} as const;

/** Relays are per task queue, so deployments sharing a namespace keep their relays apart. */
export function relayWorkflowId(taskQueue: string, index: number): string {
  return `billing-outbox-relay:${taskQueue}:${index}`;
}

/**
 * A value as one Markdown code span, for the run's current details in the Web UI: fenced by more
 * backticks than it holds in a row, so a usage id with a backtick cannot close the span and show
 * the operator a link or text of the tenant's making.
 */
export function codeSpan(value: string): string {
  const longest = Math.max(0, ...[...value.matchAll(/`+/g)].map((m) => m[0].length));
  const fence = '`'.repeat(longest + 1);
  // A space inside each fence when the value starts or ends with a backtick (Markdown drops one).
  const pad = value.startsWith('`') || value.endsWith('`') ? ' ' : '';
  return `${fence}${pad}${value}${pad}${fence}`;
}

/**
 * Text shown in the Web UI's Markdown as it is. Stripe's answers and our own messages quote what a
 * tenant sent (ids, names), which must not become links, emphasis, tables or HTML: every ASCII
 * punctuation character is escaped, one by one (so a cut anywhere leaves nothing half-open). A
 * plain word (`acme`, `api_requests`, `t-42`) is left as it is: nothing in it is Markdown.
 */
export function markdownText(value: string): string {
  if (/^[A-Za-z0-9][A-Za-z0-9_.=+-]*$/.test(value) && !/www\./i.test(value)) return value;
  return value.replace(/[!-/:-@[-`{-~]/g, (ch) => `\\${ch}`);
}

/**
 * A value as one shell word, for the commands we print for an operator to paste: as is when it is
 * plainly safe, single-quoted otherwise. A usage id may hold `'`, `;` or `$(`: pasted unquoted, a
 * tenant's id would run in the operator's shell, beside the database and Stripe credentials.
 */
export function shellWord(value: string): string {
  return /^[A-Za-z0-9._:@/+=-]+$/.test(value) ? value : `'${value.replace(/'/g, `'\\''`)}'`;
}
