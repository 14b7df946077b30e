/**
 * The Stripe side: a client configured for Temporal-owned retries, and the classification of every
 * way a meter-event call can end.
 */
import Stripe from 'stripe';
import type { Config } from '../config.js';

/** The test key sent to the local Stripe-compatible server when no STRIPE_API_KEY is configured. */
export const LOCAL_TEST_KEY = 'sk_test_billing_outbox_local';

export function createStripeClient(stripe: Config['stripe']): Stripe {
  const base = new URL(stripe.apiBase);
  const protocol = base.protocol === 'http:' ? 'http' : 'https';
  return new Stripe(stripe.apiKey ?? LOCAL_TEST_KEY, {
    host: base.hostname,
    port: base.port ? Number(base.port) : protocol === 'http' ? 80 : 443,
    protocol,
    timeout: stripe.timeoutMs,
    // Temporal's retry policy owns retries. The library still retries a closed keep-alive socket
    // once; that retry reuses the per-call Idempotency-Key the library generates, which is the
    // only sound use of that header here: a fresh key per call, never one key across attempts
    // (Stripe would replay a stored 500 for a day).
    maxNetworkRetries: 0,
    telemetry: false,
    appInfo: { name: 'billing-outbox' },
  });
}

export interface MeterEventRequest {
  eventName: string;
  stripeCustomerId: string;
  quantity: number;
  identifier: string;
  occurredAt: Date;
}

export async function sendMeterEvent(client: Pick<Stripe, 'billing'>, event: MeterEventRequest): Promise<void> {
  await client.billing.meterEvents.create({
    event_name: event.eventName,
    payload: { stripe_customer_id: event.stripeCustomerId, value: String(event.quantity) },
    identifier: event.identifier,
    timestamp: Math.floor(event.occurredAt.getTime() / 1000),
  });
}

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

// ---- Reconciliation and corrections -----------------------------------------------------------------

/**
 * The meter each event name is recorded on. Stripe routes a meter event to the one active meter
 * with that `event_name`; an inactive meter is kept only when no active one has the name.
 */
export async function metersByEventName(client: Pick<Stripe, 'billing'>): Promise<Map<string, Stripe.Billing.Meter>> {
  const byName = new Map<string, Stripe.Billing.Meter>();
  for await (const meter of client.billing.meters.list({ limit: 100 })) {
    const current = byName.get(meter.event_name);
    if (!current || (current.status !== 'active' && meter.status === 'active')) byName.set(meter.event_name, meter);
  }
  return byName;
}

/**
 * What Stripe counted for one customer on one meter, per hour: window start (unix seconds) →
 * aggregated value. `start`/`end` must be on hour boundaries. Every page is read. Stripe's
 * summaries are eventually consistent: the most recent minutes may not be in them yet.
 */
export async function hourlyEventSummaries(
  client: Pick<Stripe, 'billing'>,
  q: { meterId: string; customer: string; start: number; end: number },
): Promise<Map<number, number>> {
  const totals = new Map<number, number>();
  const pages = client.billing.meters.listEventSummaries(q.meterId, {
    customer: q.customer,
    start_time: q.start,
    end_time: q.end,
    value_grouping_window: 'hour',
    limit: 100,
  });
  for await (const summary of pages) {
    totals.set(summary.start_time, (totals.get(summary.start_time) ?? 0) + summary.aggregated_value);
  }
  return totals;
}

/**
 * Cancels a meter event by its identifier (a meter event adjustment of type `cancel`). Stripe only
 * allows it within 24 hours of receiving the event; it answers 400 after that.
 */
export async function cancelMeterEvent(client: Pick<Stripe, 'billing'>, event: { eventName: string; identifier: string }): Promise<void> {
  await client.billing.meterEventAdjustments.create({
    event_name: event.eventName,
    type: 'cancel',
    cancel: { identifier: event.identifier },
  });
}
