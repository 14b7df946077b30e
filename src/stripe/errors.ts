/**
 * How each way a Stripe call can fail is treated, decided here, next to the call (the activity turns
 * the class into a retryable or non-retryable Temporal failure).
 */
import Stripe from 'stripe';

/**
 * How a failed call should be treated:
 * - `delivered`: Stripe already holds an event with this identifier (an earlier attempt got
 *   through and its answer was lost). Counts as success.
 * - `retryable`: connection errors, timeouts, 409, 5xx, a timestamp Stripe's clock sees in the future.
 *   Temporal backs off and tries again.
 * - `rate_limited`: 429, or a 400 with code `rate_limit`. Retried after Retry-After when Stripe gives one.
 * - `credentials`: 401 or 403 (outside the v2 stream's expired session): the API key is expired,
 *   rolled, wrong or lacks a permission. About the deployment, not the event: every event would
 *   get the same answer, so delivery holds (without spending attempts) and raises the alarm until
 *   the key works again.
 * - `rejected`: any other 4xx. Sending it again cannot succeed; dead-letter it at once.
 *
 * A v2 stream request that could not be made for want of a session (StreamSessionError) is classed
 * by its cause, except that a refusal is `retryable` (code `stream_session_failed`): it is about the
 * session request (the stream not enabled for the account, a base URL without the route), not the
 * events, none of which was sent.
 */
export type FailureClass =
  | { kind: 'delivered' }
  | { kind: 'retryable'; code: string; message: string }
  | { kind: 'rate_limited'; code: string; message: string; retryAfterMs: number | undefined }
  | { kind: 'credentials'; code: string; message: string }
  | { kind: 'rejected'; code: string; message: string };

/**
 * Stripe's answer to an identifier it already holds: a 400 `invalid_request_error`. Stripe documents
 * no code for it; `resource_already_exists` (Stripe's code for a create that meets an existing
 * object) is taken when present, and the message, the one signal seen so far, otherwise.
 */
const DUPLICATE_CODE = 'resource_already_exists';
const DUPLICATE_IDENTIFIER = /^An event already exists with identifier /;
/**
 * The event's timestamp is ahead of Stripe's clock: usage is refused at enqueue beyond 5 minutes
 * ahead by the recording machine's clock, so this is clock skew, and time mends it. Retried, never
 * dead-lettered for it at once.
 */
const TIMESTAMP_IN_FUTURE = 'timestamp_in_future';

/**
 * The row's last error while its delivery holds for the API key (Stripe's own code is in the
 * message): what `billing-outbox status` counts to raise the alarm.
 */
export const CREDENTIALS_REFUSED = 'stripe_credentials_refused';

/** No session for the v2 stream: the request was never made. `cause`: why the session could not be had. */
export class StreamSessionError extends Error {
  constructor(cause: unknown) {
    super(`no meter event stream session, so nothing was sent: ${cause instanceof Error ? cause.message : String(cause)}`, { cause });
    this.name = 'StreamSessionError';
  }
}

export function classifyStripeError(err: unknown): FailureClass {
  if (err instanceof StreamSessionError) {
    const failure = classifyStripeError(err.cause);
    // Not even Stripe's duplicate answer means delivered here: no event was in the request.
    return failure.kind === 'rejected' || failure.kind === 'delivered' ? { kind: 'retryable', code: 'stream_session_failed', message: err.message } : failure;
  }
  if (!(err instanceof Stripe.errors.StripeError)) {
    const message = err instanceof Error ? err.message : String(err);
    return { kind: 'retryable', code: 'unexpected_error', message };
  }
  const status = err.statusCode;
  const message = err.message;
  if (err instanceof Stripe.errors.StripeConnectionError || status === undefined) {
    return { kind: 'retryable', code: 'connection_error', message };
  }
  // The v2 stream's session ran out (the batcher renews it and resends once; if the renewed one is
  // refused too, the next attempt gets yet another).
  if (err.type === 'TemporarySessionExpiredError' || err.code === 'billing_meter_event_session_expired') {
    return { kind: 'retryable', code: 'billing_meter_event_session_expired', message };
  }
  if (status === 400 && err.type === 'StripeInvalidRequestError' && (err.code === DUPLICATE_CODE || DUPLICATE_IDENTIFIER.test(message))) {
    return { kind: 'delivered' };
  }
  // The package raises StripeRateLimitError for a 429 and for a 400 whose code is `rate_limit`.
  if (status === 429 || err instanceof Stripe.errors.StripeRateLimitError || err.code === 'rate_limit') {
    return { kind: 'rate_limited', code: err.code ?? 'rate_limited', message, retryAfterMs: parseRetryAfter(err.headers?.['retry-after']) };
  }
  if (status === 409 || status >= 500) {
    return { kind: 'retryable', code: err.code ?? `http_${status}`, message };
  }
  if (err.code === TIMESTAMP_IN_FUTURE) return { kind: 'retryable', code: TIMESTAMP_IN_FUTURE, message };
  if (status === 401 || status === 403) return { kind: 'credentials', code: err.code ?? `http_${status}`, message };
  return { kind: 'rejected', code: err.code ?? `http_${status}`, message };
}

/**
 * Whether a failed call looks like Stripe being down rather than an answer about the event: no
 * answer (a connection error, a timeout) or a 5xx, also when it was a v2 stream session's request
 * that failed so. A 409, a timestamp ahead or an error of ours (`unexpected_error`) are not.
 */
export function looksDown(err: unknown): boolean {
  if (err instanceof StreamSessionError) return looksDown(err.cause);
  if (!(err instanceof Stripe.errors.StripeError)) return false;
  return err instanceof Stripe.errors.StripeConnectionError || err.statusCode === undefined || err.statusCode >= 500;
}

/** Retry-After in seconds (Stripe's form) or as an HTTP date; undefined when absent or unusable. */
export function parseRetryAfter(value: string | undefined, now = Date.now()): number | undefined {
  if (!value) return undefined;
  if (/^\d+(\.\d+)?$/.test(value.trim())) return Math.round(Number(value) * 1000);
  const at = Date.parse(value);
  return Number.isNaN(at) ? undefined : Math.max(0, at - now);
}

/** Socket errors raised before a connection to Stripe existed: no byte of the request left. */
const NEVER_CONNECTED = ['ECONNREFUSED', 'ENOTFOUND', 'EAI_AGAIN', 'EHOSTUNREACH', 'ENETUNREACH'];

/**
 * Whether a failed call certainly never reached Stripe (the connection was refused or Stripe's
 * host not found), as opposed to one whose answer was lost, which Stripe may still be working on.
 */
export function neverReachedStripe(err: unknown): boolean {
  if (!(err instanceof Stripe.errors.StripeConnectionError)) return false;
  const code = (err.detail as { code?: unknown } | undefined)?.code;
  return typeof code === 'string' && NEVER_CONNECTED.includes(code);
}
