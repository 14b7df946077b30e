/**
 * Injected failures: the ways Stripe, or the network in front of it, lets a pipeline down.
 */
import { performance } from 'node:perf_hooks';
import type { AsyncErrorInfo, FailNextOptions, FaultState } from './types.js';
import { stripeError, type ApiResponse } from './wire.js';

/** A FIFO of "the next N requests get X"; later calls queue behind earlier ones. */
class CountedQueue<T> {
  private batches: { remaining: number; item: T }[] = [];

  add(count: number, item: T): void {
    if (count > 0) this.batches.push({ remaining: count, item });
  }

  take(): T | undefined {
    const batch = this.batches[0];
    if (!batch) return undefined;
    batch.remaining--;
    if (batch.remaining === 0) this.batches.shift();
    return batch.item;
  }

  clear(): void {
    this.batches = [];
  }

  /** What is still queued, oldest first. */
  list(): { remaining: number; item: T }[] {
    return this.batches.map((b) => ({ ...b }));
  }

  total(): number {
    return this.batches.reduce((n, b) => n + b.remaining, 0);
  }
}

export interface InjectedFailure extends FailNextOptions {
  status: number;
}

export class FaultPlan {
  private readonly failures = new CountedQueue<InjectedFailure>();
  private readonly drops = new CountedQueue<true>();
  private readonly garbles = new CountedQueue<true>();
  private readonly asyncErrors = new CountedQueue<AsyncErrorInfo>();
  /** Identifiers that make every stream request carrying them fail, with this status. */
  private readonly poisoned = new Map<string, number>();
  /** Customers whose every v1 meter-event call fails so. */
  private readonly refusedCustomers = new Map<string, InjectedFailure>();
  private refuseUntil = 0;
  latencyMs = 0;

  /** Every stream request carrying `identifier` fails with `status` (5xx: a StripeAPIError), until reset. */
  failRequestsWith(identifier: string, status: number): void {
    if (status < 400 || status > 599) throw new RangeError(`failRequestsWith needs an error status, got ${status}`);
    this.poisoned.set(identifier, status);
  }

  /** The failure for a request carrying `identifiers`, when one of them is poisoned. */
  takePoisoned(identifiers: readonly (string | null)[]): InjectedFailure | undefined {
    for (const id of identifiers) {
      const status = id === null ? undefined : this.poisoned.get(id);
      if (status !== undefined) return { status, message: `Something went wrong on Stripe's end (injected for requests carrying ${id}).` };
    }
    return undefined;
  }

  /** Every v1 meter-event call naming `customer` fails with `status`, until reset. */
  refuseCustomer(customer: string, status: number, opts: FailNextOptions = {}): void {
    if (status < 400 || status > 599) throw new RangeError(`refuseCustomer needs an error status, got ${status}`);
    this.refusedCustomers.set(customer, { status, ...opts });
  }

  admitCustomer(customer: string): void {
    this.refusedCustomers.delete(customer);
  }

  /** The failure for a v1 call naming `customer`, when that customer is refused. */
  customerRefusal(customer: string | null): InjectedFailure | undefined {
    return customer === null ? undefined : this.refusedCustomers.get(customer);
  }

  failNext(count: number, status: number, opts: FailNextOptions = {}): void {
    if (status < 400 || status > 599) throw new RangeError(`failNext needs an error status, got ${status}`);
    this.failures.add(count, { status, ...opts });
  }

  takeFailure(): InjectedFailure | undefined {
    return this.failures.take();
  }

  dropAfterRecord(count: number): void {
    this.drops.add(count, true);
  }

  takeDrop(): boolean {
    return this.drops.take() ?? false;
  }

  garbleNext(count: number): void {
    this.garbles.add(count, true);
  }

  takeGarble(): boolean {
    return this.garbles.take() ?? false;
  }

  /** Real time, not the simulated clock: an outage lasts as long as the test waits. */
  refuseFor(seconds: number): void {
    this.refuseUntil = performance.now() + seconds * 1000;
  }

  isRefusing(): boolean {
    return performance.now() < this.refuseUntil;
  }

  asyncErrorNext(count: number, code: string, message?: string): void {
    this.asyncErrors.add(count, { code, message: message ?? defaultAsyncMessage(code) });
  }

  takeAsyncError(): AsyncErrorInfo | undefined {
    return this.asyncErrors.take();
  }

  /** The faults in force and still queued, as `npm run stripe -- status` shows them. */
  state(): FaultState {
    return {
      refusingForMs: Math.max(0, Math.ceil(this.refuseUntil - performance.now())),
      latencyMs: this.latencyMs,
      failNext: this.failures.list().map(({ remaining, item }) => ({ count: remaining, status: item.status })),
      dropAfterRecord: this.drops.total(),
      garbleNext: this.garbles.total(),
      asyncErrorNext: this.asyncErrors.list().map(({ remaining, item }) => ({ count: remaining, code: item.code })),
      refusedCustomers: [...this.refusedCustomers].map(([customer, failure]) => ({ customer, status: failure.status })),
    };
  }

  /** No outage, no latency, and nothing queued: Stripe answers normally from the next call on. */
  reset(): void {
    this.failures.clear();
    this.drops.clear();
    this.garbles.clear();
    this.asyncErrors.clear();
    this.poisoned.clear();
    this.refusedCustomers.clear();
    this.refuseUntil = 0;
    this.latencyMs = 0;
  }
}

/**
 * The answer Stripe gives for an injected status. Each carries the error type stripe-node maps to
 * its error classes, so a pipeline's error classification sees what it would see in production.
 */
export function failureResponse(failure: InjectedFailure): ApiResponse {
  const { status, message, retryAfterSeconds, code } = failure;
  if (status === 429) {
    // A 429 promises nothing about retrying; only Retry-After, when present, says when.
    const headers = retryAfterSeconds !== undefined ? { 'retry-after': String(retryAfterSeconds) } : undefined;
    return stripeError(
      429,
      { type: 'rate_limit_error', code: 'rate_limit', message: message ?? 'Too many requests hit the API too quickly.' },
      headers,
    );
  }
  if (status === 409) {
    // Stripe's 409: another request with the same Idempotency-Key is still executing.
    return stripeError(409, {
      type: 'idempotency_error',
      code: 'idempotency_key_in_use',
      message: message ?? 'Another request with this Idempotency-Key is in progress. Retry it later.',
    });
  }
  if (status >= 500) {
    return stripeError(status, { type: 'api_error', message: message ?? 'Something went wrong on Stripe\'s end (injected fault).' });
  }
  // As Stripe answers a rolled or expired key, and a restricted key without the permission.
  if (status === 401) {
    return stripeError(401, { type: 'invalid_request_error', code: 'api_key_expired', message: message ?? 'Expired API Key provided: sk_test_****************************abcd' });
  }
  if (status === 403) {
    return stripeError(403, { type: 'invalid_request_error', message: message ?? 'The provided key does not have the required permissions for this endpoint.' });
  }
  return stripeError(status, { type: 'invalid_request_error', message: message ?? `Injected ${status} error.`, ...(code ? { code } : {}) });
}

/** Stripe saves a 5xx under its Idempotency-Key (the endpoint had started); 4xx faults are refusals. */
export function isStoredFailure(failure: InjectedFailure): boolean {
  return failure.status >= 500;
}

function defaultAsyncMessage(code: string): string {
  switch (code) {
    case 'meter_event_customer_not_found':
      return 'No customer was found with the id in payload[stripe_customer_id].';
    case 'no_meter':
      return 'No active meter was found for this event name.';
    case 'archived_meter':
      return 'The meter for this event name is archived.';
    case 'meter_event_invalid_value':
      return 'The value in payload[value] is not a valid number.';
    case 'timestamp_too_far_in_past':
      return 'The timestamp is more than 35 days in the past.';
    case 'timestamp_in_future':
      return 'The timestamp is more than 5 minutes in the future.';
    default:
      return `The meter event failed validation (${code}).`;
  }
}
