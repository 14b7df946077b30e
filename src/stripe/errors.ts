/**
 * How each way a Stripe call can fail is treated, decided here, next to the call (the activity turns
 * the class into a retryable or non-retryable Temporal failure).
 */
import Stripe from 'stripe';

/**
 * How a failed call should be treated:
 * - `delivered`: Stripe already holds an event with this identifier (an earlier attempt got
 *   through and its answer was lost). Counts as success.
 * - `retryable`: connection errors, timeouts, 409, 5xx. Temporal backs off and tries again.
 * - `rate_limited`: 429. Retried after Retry-After when Stripe gives one.
 * - `rejected`: any other 4xx. Sending it again cannot succeed; dead-letter it at once.
 */
export type FailureClass =
  | { kind: 'delivered' }
  | { kind: 'retryable'; code: string; message: string }
  | { kind: 'rate_limited'; code: string; message: string; retryAfterMs: number | undefined }
  | { kind: 'rejected'; code: string; message: string };

const DUPLICATE_IDENTIFIER = /^An event already exists with identifier /;

export function classifyStripeError(err: unknown): FailureClass {
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
  if (status === 400 && err.type === 'StripeInvalidRequestError' && DUPLICATE_IDENTIFIER.test(message)) {
    return { kind: 'delivered' };
  }
  if (status === 429) {
    return { kind: 'rate_limited', code: err.code ?? 'rate_limited', message, retryAfterMs: parseRetryAfter(err.headers?.['retry-after']) };
  }
  if (status === 409 || status >= 500) {
    return { kind: 'retryable', code: err.code ?? `http_${status}`, message };
  }
  return { kind: 'rejected', code: err.code ?? `http_${status}`, message };
}

/** Retry-After in seconds (Stripe's form) or as an HTTP date; undefined when absent or unusable. */
export function parseRetryAfter(value: string | undefined, now = Date.now()): number | undefined {
  if (!value) return undefined;
  if (/^\d+(\.\d+)?$/.test(value.trim())) return Math.round(Number(value) * 1000);
  const at = Date.parse(value);
  return Number.isNaN(at) ? undefined : Math.max(0, at - now);
}
