/**
 * The `Idempotency-Key` header store.
 *
 * Stripe saves the status and body of the first request with a key once the endpoint has started
 * executing — a 200, a business-rule 400, and also a 500 — and replays that answer to any later
 * request with the same key and parameters, with `idempotent-replayed: true`. Requests refused
 * before execution (bad key, rate limited, invalid parameters) save nothing, so a retry with the
 * same key is evaluated afresh. Keys can be pruned after 24 hours; here they expire exactly then.
 *
 * This is why reusing one key across deliberate retries is a trap: a stored 500 is replayed for a
 * day, although Stripe itself may be healthy again.
 */
import { DAY_MS } from './ledger.js';
import { stripeError, type ApiResponse } from './wire.js';

export const MAX_KEY_LENGTH = 255;

interface StoredResult {
  endpoint: string;
  params: string;
  response: ApiResponse;
  storedAt: number;
}

export type IdempotencyLookup =
  | { kind: 'new' }
  | { kind: 'replay'; response: ApiResponse }
  | { kind: 'conflict'; response: ApiResponse };

export class IdempotencyStore {
  private results = new Map<string, StoredResult>();

  private readonly now: () => number;
  constructor(now: () => number) {
    this.now = now;
  }

  /**
   * @param endpoint e.g. 'POST /v1/billing/meter_events'
   * @param params canonical text of the request parameters
   */
  lookup(key: string, endpoint: string, params: string): IdempotencyLookup {
    if (key.length > MAX_KEY_LENGTH) {
      return {
        kind: 'conflict',
        response: stripeError(400, {
          type: 'invalid_request_error',
          message: `Idempotency-Key is ${key.length} characters long; the maximum is ${MAX_KEY_LENGTH}.`,
        }),
      };
    }
    const stored = this.results.get(key);
    if (!stored || this.now() - stored.storedAt >= DAY_MS) {
      this.results.delete(key);
      return { kind: 'new' };
    }
    if (stored.endpoint !== endpoint) {
      return conflict(
        `Keys for idempotent requests can only be used for the endpoint they were first used with ` +
          `(${stored.endpoint}). Use a different key than '${key}' for a different request.`,
      );
    }
    if (stored.params !== params) {
      return conflict(
        `Keys for idempotent requests can only be used with the parameters they were first used with. ` +
          `Use a different key than '${key}' for a different request.`,
      );
    }
    const response = stored.response;
    return { kind: 'replay', response: { ...response, headers: { ...response.headers, 'idempotent-replayed': 'true' } } };
  }

  save(key: string, endpoint: string, params: string, response: ApiResponse): void {
    this.results.set(key, { endpoint, params, response, storedAt: this.now() });
  }

  reset(): void {
    this.results = new Map();
  }
}

function conflict(message: string): IdempotencyLookup {
  return { kind: 'conflict', response: stripeError(400, { type: 'idempotency_error', message }) };
}
