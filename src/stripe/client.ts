/**
 * Calls to Stripe: a client configured for Temporal-owned retries, the meter-event call, and the
 * reads and corrections reconciliation uses. How a failed call is treated: ./errors.ts.
 */
import Stripe from 'stripe';
import { ConfigError, type Config } from '../config.js';
import { keyFromFile, newsOn, type KeyFileOptions, type KeyLog } from '../key-file.js';
import { SECRET_KEY_PATTERN } from './rules.js';
import { meterEventPayload, type MeterEvent } from './meters.js';

/** The test key sent to the local Stripe-compatible server when no STRIPE_API_KEY is configured. */
export const LOCAL_TEST_KEY = 'sk_test_billing_outbox_local';

/**
 * Refuses, before anything starts, a process or command that calls Stripe itself without a key:
 * the local test key would be refused there on every call. What does not call Stripe (`migrate`,
 * the operator commands that read the outbox) runs without one.
 */
export function requireStripeKey(stripe: Config['stripe'], who: string): void {
  if (stripe.apiKey === undefined && stripe.isRealStripe) {
    throw new ConfigError([`STRIPE_API_KEY: is not set, and ${who} calls Stripe with it (or set STRIPE_API_BASE to a Stripe-compatible server)`]);
  }
}

/**
 * A client for `stripe`'s base URL with the configured key: read again from its file while running
 * when it came from STRIPE_API_KEY_FILE (stripeKeyFromFile below; `log` hears of a new key in use, never the
 * key), or `sessionToken` instead (a v2 meter event session's).
 */
export function createStripeClient(stripe: Config['stripe'], opts: { sessionToken?: string; log?: KeyLog } = {}): Stripe {
  const base = new URL(stripe.apiBase);
  const protocol = base.protocol === 'http:' ? 'http' : 'https';
  const key = opts.sessionToken ?? stripe.apiKey ?? LOCAL_TEST_KEY;
  const rolling = opts.sessionToken === undefined && stripe.apiKey !== undefined && stripe.apiKeyFile !== undefined ? stripeKeyFromFile(stripe.apiKeyFile, stripe.apiKey, opts.log) : undefined;
  // stripe-node takes either a key or an authenticator, which sets the header on every request.
  return new Stripe(rolling ? '' : key, {
    ...(rolling ? { authenticator: (request) => Promise.resolve(void (request.headers.Authorization = `Bearer ${rolling()}`)) } : {}),
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

/**
 * STRIPE_API_KEY_FILE read again while running (../key-file.ts). A rolled key keeps its kind: a
 * live key where a test key was (or the reverse) would change what the configuration checked at
 * start (where a live key may be sent, the default pace), which is a restart's job.
 */
export function stripeKeyFromFile(
  file: string,
  firstKey: string,
  log: KeyLog | undefined,
  opts: Pick<KeyFileOptions, 'recheckMs' | 'now'> = {},
): () => string {
  const isLive = (key: string) => key.includes('_live_');
  return keyFromFile(file, firstKey, {
    ...opts,
    refuse: (key) =>
      !SECRET_KEY_PATTERN.test(key)
        ? 'does not hold a Stripe secret or restricted key (sk_test_…, sk_live_…, rk_…)'
        : isLive(key) !== isLive(firstKey)
          ? `holds a ${isLive(key) ? 'live' : 'test'} key where this process started with a ${isLive(firstKey) ? 'live' : 'test'} one: restart to change modes`
          : undefined,
    onNews: newsOn(log, file, { what: 'Stripe API key', noun: 'key', variable: 'STRIPE_API_KEY_FILE' }),
  });
}

/** One v1 meter-event call (the v1 sender of src/stripe/sender.ts; tests and benchmarks call it directly). */
export async function sendMeterEvent(client: Pick<Stripe, 'billing'>, event: MeterEvent): Promise<void> {
  await client.billing.meterEvents.create({
    event_name: event.eventName,
    payload: meterEventPayload(event),
    identifier: event.identifier,
    timestamp: Math.floor(event.occurredAt.getTime() / 1000),
  });
}

// ---- Reconciliation and corrections -----------------------------------------------------------------

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
  const params = { event_name: event.eventName, type: 'cancel', cancel: { identifier: event.identifier } } as const;
  try {
    // One Idempotency-Key per event's cancel, not one per call: a cancel repeated after one whose
    // answer was lost gets the first answer again from Stripe's idempotency store (kept at least
    // 24 h, as long as the cancel window itself) instead of a refusal.
    await client.billing.meterEventAdjustments.create(params, { idempotencyKey: cancelIdempotencyKey(event.identifier) });
  } catch (err) {
    // But Stripe stores a 5xx under its key too, and replays it for a day however healthy it is
    // again; and a refusal that may not hold now (no such event yet: the stream validates later).
    // Such a replay is asked again under a fresh key (the client makes one). If an earlier cancel
    // got through after all, Stripe refuses this one as already cancelled.
    if (!replayedFailure(err)) throw err;
    await client.billing.meterEventAdjustments.create(params);
  }
}

/** A failure Stripe answered from its idempotency store: the first request's, not a new one. */
function replayedFailure(err: unknown): boolean {
  return err instanceof Stripe.errors.StripeError && (err.statusCode ?? 0) >= 400 && err.headers?.['idempotent-replayed'] === 'true';
}

/** The Idempotency-Key of an event's cancel (an identifier is at most 100 characters; Stripe takes 255). */
export function cancelIdempotencyKey(identifier: string): string {
  return `billing-outbox-cancel:${identifier}`;
}
