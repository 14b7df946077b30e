/**
 * Every limit and window of Stripe's that billing-outbox plays by, in one place, each with where
 * Stripe says it. The pipeline, the API, the CLI and the local Stripe-compatible server all import
 * these; nothing else spells them out. Pure constants and arithmetic: importable from workflow code.
 *
 * Sources (also summarised in ../shared/reference/stripe-meter-events.md):
 *   [events]   https://docs.stripe.com/api/billing/meter-event/create
 *   [limits]   https://docs.stripe.com/billing/subscriptions/usage-based/recording-usage-api#rate-limits
 *   [adjust]   https://docs.stripe.com/api/billing/meter-event-adjustment/create
 *   [stream]   https://docs.stripe.com/api/v2/billing-meter-stream
 *   [idem]     https://docs.stripe.com/api/idempotent_requests
 */

const HOUR_MS = 3_600_000;
const DAY_MS = 24 * HOUR_MS;

/** [events] `identifier` and `event_name`: at most 100 characters each. */
export const MAX_IDENTIFIER_LENGTH = 100;
export const MAX_EVENT_NAME_LENGTH = 100;

/** [events] The payload value must fit in 15 significant digits: the largest whole quantity we send. */
export const MAX_VALUE = 999_999_999_999_999;

/** [events] `timestamp` must lie within the past 35 calendar days ... */
export const MAX_EVENT_AGE_MS = 35 * DAY_MS;
/** [events] ... and at most 5 minutes in the future. */
export const MAX_EVENT_FUTURE_MS = 5 * 60_000;

/**
 * [events] A second event with the same `identifier` is rejected "within a rolling period of at
 * least 24 hours". Past that a resend may be counted twice, so we stop resending an hour early.
 */
export const IDENTIFIER_WINDOW_MS = DAY_MS;
export const SAFE_RESEND_WINDOW_MS = IDENTIFIER_WINDOW_MS - HOUR_MS;

/** [adjust] A meter event can be cancelled only within 24 hours of Stripe receiving it. */
export const CANCEL_WINDOW_MS = DAY_MS;

/** [limits] Meter-event calls per second per account in live mode. */
export const LIVE_CALLS_PER_SECOND = 1_000;
/** [limits] Test mode counts meter events against the basic limit of 25 operations per second. */
export const TEST_CALLS_PER_SECOND = 25;
/** Our defaults stay 10 % (live) and 20 % (test) under those, leaving room for the account's other calls. */
export const DEFAULT_LIVE_RATE = 900;
export const DEFAULT_TEST_RATE = 20;
/** [limits] One concurrent meter-event call per customer per meter (v1; the lease, src/stripe/meter-lease.ts). */
export const CONCURRENT_CALLS_PER_CUSTOMER_METER = 1;

/** [stream] The v2 meter event stream takes "up to 100 events per request". */
export const MAX_STREAM_BATCH = 100;
/**
 * [stream] "Authentication tokens are only valid for 15 minutes": a meter event session's token
 * (`expires_at`, ISO-8601) must be replaced before then, and on `TemporarySessionExpiredError`.
 * No per-customer concurrency rule is documented for the stream.
 */
export const STREAM_SESSION_TTL_MS = 15 * 60_000;
/** [stream] The stream deduplicates identifiers silently over a rolling 24 hours (no "already exists" answer). */
export const STREAM_DEDUP_WINDOW_MS = DAY_MS;

/** [idem] Idempotency-Key: at most 255 characters, stored (with the first answer) for at least 24 h. */
export const MAX_IDEMPOTENCY_KEY_LENGTH = 255;

/** Why Stripe would refuse a meter event stamped `occurredAt` if it were sent at `now`, if it would. */
export function timestampProblem(occurredAt: Date, now: number): { code: string; message: string } | undefined {
  const age = now - occurredAt.getTime();
  if (age > MAX_EVENT_AGE_MS) {
    return {
      code: 'timestamp_too_far_in_past',
      message: `usage from ${occurredAt.toISOString()} is older than Stripe's 35-day window and cannot be reported`,
    };
  }
  if (-age > MAX_EVENT_FUTURE_MS) {
    return {
      code: 'timestamp_in_future',
      message:
        `usage stamped ${occurredAt.toISOString()} is more than 5 minutes ahead of this worker's clock (or Stripe's, as the stream measured it), ` +
        'and more than the hour delivery waits: a clock is wrong (this one behind, or the recording machine\'s ahead); fix it, then retry once the usage is within the hour',
    };
  }
  return undefined;
}

/**
 * Usage accepted at the door, or retried by an operator, must still be inside the 35-day window
 * when it reaches Stripe: an hour of margin for the queue and the retries on the way.
 */
export const WINDOW_MARGIN_MS = HOUR_MS;

/** True when usage this old would no longer be inside Stripe's window by the time it is sent. */
export function tooOldToSend(occurredAt: Date, now: number): boolean {
  return occurredAt.getTime() < now - (MAX_EVENT_AGE_MS - WINDOW_MARGIN_MS);
}

/** Hours, for messages: 23 for SAFE_RESEND_WINDOW_MS. */
export const inHours = (ms: number): number => ms / HOUR_MS;

/** What a Stripe secret or restricted key looks like (STRIPE_API_KEY, and a rolled key read from its file). */
export const SECRET_KEY_PATTERN = /^(sk|rk)_(test|live)_[A-Za-z0-9_]+$/;

/** What a webhook endpoint's signing secret looks like (STRIPE_WEBHOOK_SECRET, and a rolled one read from its file). */
export const WEBHOOK_SECRET_PATTERN = /^whsec_[A-Za-z0-9_]+$/;
