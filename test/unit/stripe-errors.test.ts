/** How each Stripe failure is treated, pure: built as the `stripe` package builds its errors. */
import Stripe from 'stripe';
import { describe, expect, it } from 'vitest';
import { classifyStripeError, looksDown, neverReachedStripe, parseRetryAfter, StreamSessionError } from '../../src/stripe/errors.js';

type Raw = { message: string; statusCode?: number; code?: string; headers?: Record<string, string> };
const invalid = (raw: Raw) => new Stripe.errors.StripeInvalidRequestError({ type: 'invalid_request_error', ...raw } as never);
const api = (raw: Raw) => new Stripe.errors.StripeAPIError({ type: 'api_error', ...raw } as never);
const rate = (raw: Raw) => new Stripe.errors.StripeRateLimitError({ type: 'rate_limit_error', ...raw } as never);
const DUP = 'An event already exists with identifier u:acme:1.';

describe('classifyStripeError', () => {
  it("no v2 stream session: a refusal of the session request is retryable (it says nothing of the events, none sent); a refused key, a 429 or a 5xx is classed as it is", () => {
    const session = (err: unknown) => classifyStripeError(new StreamSessionError(err));
    expect(session(invalid({ message: 'Meter event streams are not enabled for this account.', statusCode: 400 }))).toEqual({
      kind: 'retryable',
      code: 'stream_session_failed',
      message: 'no meter event stream session, so nothing was sent: Meter event streams are not enabled for this account.',
    });
    expect(session(invalid({ message: 'Unrecognized request URL', statusCode: 404 })).kind).toBe('retryable');
    expect(session(invalid({ message: DUP, statusCode: 400 })).kind).toBe('retryable');
    expect(session(new Stripe.errors.StripeAuthenticationError({ message: 'Invalid API Key', statusCode: 401 } as never))).toMatchObject({ kind: 'credentials', code: 'http_401' });
    expect(session(rate({ message: 'slow down', statusCode: 429 }))).toMatchObject({ kind: 'rate_limited' });
    expect(session(api({ message: 'down', statusCode: 503 }))).toEqual({ kind: 'retryable', code: 'http_503', message: 'down' });
  });

  it("Stripe's duplicate-identifier 400 is delivered (an earlier attempt got through)", () => {
    expect(classifyStripeError(invalid({ message: DUP, statusCode: 400 }))).toEqual({ kind: 'delivered' });
  });

  it('the duplicate answer is recognised by its code when Stripe gives one, by its message otherwise', () => {
    expect(classifyStripeError(invalid({ message: 'Identifier taken.', statusCode: 400, code: 'resource_already_exists' }))).toEqual({ kind: 'delivered' });
    expect(classifyStripeError(invalid({ message: DUP, statusCode: 400, code: 'resource_already_exists' }))).toEqual({ kind: 'delivered' });
    // The code on another status or error type is not the duplicate answer.
    expect(classifyStripeError(invalid({ message: 'x', statusCode: 404, code: 'resource_already_exists' })).kind).toBe('rejected');
    expect(classifyStripeError(api({ message: 'x', statusCode: 400, code: 'resource_already_exists' })).kind).toBe('rejected');
  });

  it('the same words elsewhere are not: another status, another error type, not at the start', () => {
    expect(classifyStripeError(invalid({ message: DUP, statusCode: 404 })).kind).toBe('rejected');
    expect(classifyStripeError(api({ message: DUP, statusCode: 400 })).kind).toBe('rejected');
    expect(classifyStripeError(invalid({ message: `Oops. ${DUP}`, statusCode: 400 })).kind).toBe('rejected');
  });

  it('429: rate limited, with Retry-After when Stripe gives one', () => {
    expect(classifyStripeError(rate({ message: 'slow down', statusCode: 429, headers: { 'retry-after': '2' } }))).toEqual({
      kind: 'rate_limited',
      code: 'rate_limited',
      message: 'slow down',
      retryAfterMs: 2000,
    });
    expect(classifyStripeError(rate({ message: 'm', statusCode: 429, code: 'lock_timeout' }))).toEqual({ kind: 'rate_limited', code: 'lock_timeout', message: 'm', retryAfterMs: undefined });
  });

  it("a 400 whose code is rate_limit is rate limited, as the package's StripeRateLimitError or as it arrives", () => {
    // What the package builds for it (its Error.js: a 429, or a 400 with code rate_limit).
    const built = Stripe.errors.StripeError.generate({ type: 'invalid_request_error', code: 'rate_limit', message: 'Too many requests', statusCode: 400 } as never);
    expect(built).toBeInstanceOf(Stripe.errors.StripeRateLimitError);
    expect(classifyStripeError(built)).toEqual({ kind: 'rate_limited', code: 'rate_limit', message: 'Too many requests', retryAfterMs: undefined });
    expect(classifyStripeError(invalid({ message: 'Too many requests', statusCode: 400, code: 'rate_limit' })).kind).toBe('rate_limited');
  });

  it("a timestamp Stripe's clock sees in the future is retryable (clock skew: time mends it), not rejected", () => {
    expect(classifyStripeError(invalid({ message: 'Timestamp is in the future', statusCode: 400, code: 'timestamp_in_future' }))).toEqual({
      kind: 'retryable',
      code: 'timestamp_in_future',
      message: 'Timestamp is in the future',
    });
  });

  it('409 and every 5xx are retryable, with their code or the status', () => {
    expect(classifyStripeError(invalid({ message: 'conflict', statusCode: 409, code: 'idempotency_key_in_use' }))).toEqual({ kind: 'retryable', code: 'idempotency_key_in_use', message: 'conflict' });
    for (const statusCode of [500, 502, 503, 504, 599]) {
      expect(classifyStripeError(api({ message: 'down', statusCode }))).toEqual({ kind: 'retryable', code: `http_${statusCode}`, message: 'down' });
    }
  });

  it('any other 4xx is rejected at once, with its code or the status', () => {
    expect(classifyStripeError(invalid({ message: "No such customer: 'cus_x'", statusCode: 400, code: 'resource_missing' }))).toEqual({
      kind: 'rejected',
      code: 'resource_missing',
      message: "No such customer: 'cus_x'",
    });
    for (const statusCode of [400, 402, 404, 422, 499]) {
      expect(classifyStripeError(invalid({ message: 'no', statusCode }))).toEqual({ kind: 'rejected', code: `http_${statusCode}`, message: 'no' });
    }
  });

  it("401 and 403 are about the deployment's key, not the event: credentials", () => {
    const expired = new Stripe.errors.StripeAuthenticationError({ type: 'invalid_request_error', message: 'Expired API Key provided: sk_live_****1234', statusCode: 401, code: 'api_key_expired' } as never);
    expect(classifyStripeError(expired)).toEqual({ kind: 'credentials', code: 'api_key_expired', message: 'Expired API Key provided: sk_live_****1234' });
    const restricted = new Stripe.errors.StripePermissionError({ type: 'invalid_request_error', message: 'The provided key does not have the required permissions', statusCode: 403 } as never);
    expect(classifyStripeError(restricted)).toMatchObject({ kind: 'credentials', code: 'http_403' });
    expect(classifyStripeError(invalid({ message: 'Invalid API Key provided', statusCode: 401 }))).toMatchObject({ kind: 'credentials', code: 'http_401' });
  });

  it('no answer (connection error, timeout) is retryable', () => {
    const conn = new Stripe.errors.StripeConnectionError({ message: 'Request aborted due to timeout being reached (500ms)', type: 'api_connection_error' } as never);
    expect(classifyStripeError(conn)).toEqual({ kind: 'retryable', code: 'connection_error', message: 'Request aborted due to timeout being reached (500ms)' });
    // A Stripe error without a status (no answer at all) counts as one too.
    expect(classifyStripeError(api({ message: 'nothing' }))).toEqual({ kind: 'retryable', code: 'connection_error', message: 'nothing' });
  });

  it("the v2 stream's expired session is retryable, by type or by code", () => {
    const byCode = invalid({ message: 'expired', statusCode: 401, code: 'billing_meter_event_session_expired' });
    expect(classifyStripeError(byCode)).toEqual({ kind: 'retryable', code: 'billing_meter_event_session_expired', message: 'expired' });
    const byType = Object.assign(invalid({ message: 'expired', statusCode: 401 }), { type: 'TemporarySessionExpiredError' });
    expect(classifyStripeError(byType).kind).toBe('retryable');
  });

  it('anything that is not a Stripe error is retryable, with its message', () => {
    expect(classifyStripeError(new Error('socket hang up'))).toEqual({ kind: 'retryable', code: 'unexpected_error', message: 'socket hang up' });
    expect(classifyStripeError('boom')).toEqual({ kind: 'retryable', code: 'unexpected_error', message: 'boom' });
  });
});

describe('parseRetryAfter', () => {
  const NOW = Date.parse('2026-12-02T12:00:00Z');
  it('reads seconds, whole or not, and HTTP dates', () => {
    expect(parseRetryAfter('3', NOW)).toBe(3000);
    expect(parseRetryAfter(' 1.5 ', NOW)).toBe(1500);
    expect(parseRetryAfter('0', NOW)).toBe(0);
    expect(parseRetryAfter('12', NOW)).toBe(12_000);
    expect(parseRetryAfter('1.25', NOW)).toBe(1250);
    expect(parseRetryAfter('Wed, 02 Dec 2026 12:00:10 GMT', NOW)).toBe(10_000);
    expect(parseRetryAfter('Wed, 02 Dec 2026 11:59:00 GMT', NOW)).toBe(0);
  });
  it('ignores what it cannot read', () => {
    for (const v of [undefined, '', 'soon', 'in a minute', '5s', 'x5']) expect(parseRetryAfter(v, NOW), String(v)).toBeUndefined();
  });
});

describe('neverReachedStripe', () => {
  const connection = (code?: string) =>
    new Stripe.errors.StripeConnectionError({ message: 'An error occurred with our connection to Stripe.', ...(code ? { detail: Object.assign(new Error(code), { code }) } : {}) } as never);
  it('a refused connection or an unknown host: nothing left; a reset, a timeout or no detail: Stripe may have it', () => {
    for (const code of ['ECONNREFUSED', 'ENOTFOUND', 'EAI_AGAIN', 'EHOSTUNREACH', 'ENETUNREACH']) expect(neverReachedStripe(connection(code)), code).toBe(true);
    for (const code of ['ECONNRESET', 'ETIMEDOUT', 'EPIPE', undefined]) expect(neverReachedStripe(connection(code)), String(code)).toBe(false);
    expect(neverReachedStripe(new Error('ECONNREFUSED'))).toBe(false);
  });
});

describe('looksDown', () => {
  it('a 5xx or no answer looks like Stripe down, also behind a stream session request; an answer about the event, or an error of ours, does not', () => {
    expect(looksDown(api({ message: 'down', statusCode: 500 }))).toBe(true);
    expect(looksDown(api({ message: 'down', statusCode: 503 }))).toBe(true);
    expect(looksDown(new Stripe.errors.StripeConnectionError({ message: 'socket hang up' } as never))).toBe(true);
    // A StripeError with no status: the package's own when no answer came.
    expect(looksDown(api({ message: 'nothing' }))).toBe(true);
    expect(looksDown(new StreamSessionError(api({ message: 'down', statusCode: 502 })))).toBe(true);

    expect(looksDown(api({ message: 'almost', statusCode: 499 }))).toBe(false);
    expect(looksDown(new Stripe.errors.StripeIdempotencyError({ message: 'conflict', statusCode: 409 } as never))).toBe(false);
    expect(looksDown(invalid({ message: 'No such customer', statusCode: 400 }))).toBe(false);
    expect(looksDown(rate({ message: 'slow down', statusCode: 429 }))).toBe(false);
    expect(looksDown(new StreamSessionError(invalid({ message: 'not enabled', statusCode: 400 })))).toBe(false);
    expect(looksDown(new Error('socket hang up'))).toBe(false);
    expect(looksDown('boom')).toBe(false);
  });
});
