/**
 * API-key check. Stripe takes the secret key as a Bearer token (what stripe-node sends) or as the
 * Basic-auth user name (what `curl -u sk_test_…:` sends), and answers 401 before anything else runs.
 */
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
