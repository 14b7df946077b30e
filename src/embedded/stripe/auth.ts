/**
 * API-key check. Stripe takes the secret key as a Bearer token (what stripe-node sends) or as the
 * Basic-auth user name (what `curl -u sk_test_…:` sends), and answers 401 before anything else runs.
 * The v2 meter event stream is the exception: it takes only a meter event session's token.
 */
import type { MeterEventSession, MeterEventSessions } from './sessions.js';
import { stripeError, type ApiResponse } from './wire.js';

/** Returns the 401 to send, or undefined when the key is acceptable. */
export function checkApiKey(authorization: string | null, requiredKey: string | undefined): ApiResponse | undefined {
  const key = keyFrom(authorization);
  if (!key) {
    return unauthorized(
      'You did not provide an API key. Send your secret key in the Authorization header as a Bearer token ' +
        "(e.g. 'Authorization: Bearer sk_test_…').",
    );
  }
  const accepted = requiredKey !== undefined ? key === requiredKey : /^(sk|rk)_test_\w/.test(key);
  return accepted ? undefined : unauthorized(`Invalid API Key provided: ${redact(key)}`);
}

/**
 * The stream's check: the token of a live session, or a 401. The secret key is not a session token
 * and is refused like any unknown token. An expired session gets the v2 error type stripe-node maps
 * to `TemporarySessionExpiredError` (its other 401s fall back, by status, to StripeAuthenticationError).
 */
export function checkSessionToken(authorization: string | null, sessions: MeterEventSessions): MeterEventSession | ApiResponse {
  const found = sessions.lookup(keyFrom(authorization));
  if (found.kind === 'valid') return found.session;
  if (found.kind === 'expired') {
    return stripeError(401, {
      type: 'temporary_session_expired',
      code: 'billing_meter_event_session_expired',
      message:
        `The meter event session ${found.session.id} expired at ${new Date(found.session.expiresAt).toISOString()}. ` +
        'Create a new session (POST /v2/billing/meter_event_session) and send with its authentication_token.',
    });
  }
  return unauthorized(
    'The meter event stream needs the authentication_token of a meter event session as a Bearer token ' +
      '(create one with POST /v2/billing/meter_event_session); this token is not one.',
  );
}

function keyFrom(authorization: string | null): string | undefined {
  if (!authorization) return undefined;
  const [scheme, credentials] = authorization.trim().split(/\s+/, 2);
  if (!credentials) return undefined;
  if (scheme?.toLowerCase() === 'bearer') return credentials;
  if (scheme?.toLowerCase() === 'basic') {
    const user = Buffer.from(credentials, 'base64').toString('utf8').split(':')[0];
    return user || undefined;
  }
  return undefined;
}

/** Stripe never echoes a whole key back: it keeps the mode prefix and the last four characters. */
function redact(key: string): string {
  const prefix = /^[a-z]+_(test|live)_/.exec(key)?.[0] ?? '';
  return `${prefix}${'*'.repeat(Math.max(key.length - prefix.length - 4, 0))}${key.slice(-4)}`;
}

/**
 * Real Stripe labels a bad key `invalid_request_error` with status 401 (there is no code); the
 * client libraries pick their error class from the status, so stripe-node raises
 * StripeAuthenticationError.
 */
function unauthorized(message: string): ApiResponse {
  return stripeError(401, { type: 'invalid_request_error', message }, { 'www-authenticate': 'Bearer realm="Stripe"' });
}
