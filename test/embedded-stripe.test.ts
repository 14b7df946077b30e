/**
 * The local Stripe server, exercised through the real `stripe` client: every behaviour the billing
 * pipeline relies on (dedup, idempotency replay, limits, faults, summaries, cancels, error reports).
 */
import { spawn } from 'node:child_process';
import http from 'node:http';
import type { AddressInfo } from 'node:net';
import { once } from 'node:events';
import { createInterface } from 'node:readline';
import { fileURLToPath } from 'node:url';
import Stripe from 'stripe';
import { describe, expect, it } from 'vitest';
import type { LocalStripe } from '../src/embedded/stripe/server.js';
import { cancelMeterEvent } from '../src/stripe/client.js';
import { CUSTOMER, DAY, HOUR, METER_EVENT, T0, cleanups, clientFor, startStripe } from './local-stripe.js';


/** A settable clock for the 24-hour and 35-day rules. */
function fakeClock(start = T0): { now: () => number; advance: (ms: number) => void } {
  let current = start;
  return { now: () => current, advance: (ms) => (current += ms) };
}

function usage(identifier: string | undefined, value = 1, extra: Partial<Stripe.Billing.MeterEventCreateParams> = {}) {
  return {
    event_name: METER_EVENT,
    payload: { stripe_customer_id: CUSTOMER, value: String(value) },
    ...(identifier !== undefined ? { identifier } : {}),
    ...extra,
  };
}

async function failureOf(call: Promise<unknown>): Promise<Stripe.errors.StripeError> {
  try {
    await call;
  } catch (error) {
    if (error instanceof Stripe.errors.StripeError) return error;
    throw error;
  }
  throw new Error('expected the Stripe call to fail');
}

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

describe('POST /v1/billing/meter_events', () => {
  it('accepts an event, answers in Stripe\'s shape and records exactly what was sent', async () => {
    const clock = fakeClock();
    const server = await startStripe({ now: clock.now });
    const stripe = clientFor(server);
    const timestamp = Math.floor(T0 / 1000) - 600;

    const event = await stripe.billing.meterEvents.create(usage('evt-1', 42, { timestamp }), { idempotencyKey: 'key-1' });

    expect(event).toMatchObject({
      object: 'billing.meter_event',
      event_name: METER_EVENT,
      identifier: 'evt-1',
      livemode: false,
      payload: { stripe_customer_id: CUSTOMER, value: '42' },
      timestamp,
      created: Math.floor(T0 / 1000),
    });
    expect(event.lastResponse.requestId).toMatch(/^req_/);
    expect(server.events()).toEqual([
      {
        identifier: 'evt-1',
        eventName: METER_EVENT,
        customer: CUSTOMER,
        value: 42,
        payload: { stripe_customer_id: CUSTOMER, value: '42' },
        timestamp,
        receivedAt: T0,
        cancelled: false,
        meterId: expect.stringMatching(/^mtr_/),
        idempotencyKey: 'key-1',
        requestId: event.lastResponse.requestId,
      },
    ]);
    expect(server.requests()).toEqual([
      expect.objectContaining({ identifier: 'evt-1', customer: CUSTOMER, eventName: METER_EVENT, status: 200, replayed: false, dropped: false }),
    ]);
  });

  it('generates an identifier when none is sent and uses now as the timestamp', async () => {
    const server = await startStripe({ now: fakeClock().now });
    const event = await clientFor(server).billing.meterEvents.create(usage(undefined, 5));
    expect(event.identifier).toMatch(/[0-9a-f-]{36}/);
    expect(event.timestamp).toBe(Math.floor(T0 / 1000));
    expect(server.events()[0]?.identifier).toBe(event.identifier);
  });

  it('rejects a second event with the same identifier exactly like Stripe, and records nothing', async () => {
    const server = await startStripe();
    const stripe = clientFor(server);
    await stripe.billing.meterEvents.create(usage('dup-1', 1));

    const error = await failureOf(stripe.billing.meterEvents.create(usage('dup-1', 1)));

    expect(error).toBeInstanceOf(Stripe.errors.StripeInvalidRequestError);
    expect(error.statusCode).toBe(400);
    expect(error.rawType).toBe('invalid_request_error');
    expect(error.message).toBe('An event already exists with identifier dup-1.');
    expect(error.headers?.['stripe-should-retry']).toBe('false');
    expect(server.events()).toHaveLength(1);
    expect(server.requests().map((r) => r.status)).toEqual([200, 400]);
  });

  it('forgets identifiers after 24 hours: a resend is then accepted and counted twice', async () => {
    const clock = fakeClock();
    const server = await startStripe({ now: clock.now });
    const stripe = clientFor(server);
    await stripe.billing.meterEvents.create(usage('late-resend', 1));

    clock.advance(23 * HOUR);
    await expect(stripe.billing.meterEvents.create(usage('late-resend', 1))).rejects.toThrow(/already exists/);
    clock.advance(2 * HOUR);
    await stripe.billing.meterEvents.create(usage('late-resend', 1));

    expect(server.events().map((e) => e.identifier)).toEqual(['late-resend', 'late-resend']);
  });

  it('accepts timestamps from the last 35 days up to 5 minutes ahead, and rejects the rest', async () => {
    const server = await startStripe({ now: fakeClock().now });
    const stripe = clientFor(server);
    const nowSeconds = Math.floor(T0 / 1000);

    const old = await failureOf(stripe.billing.meterEvents.create(usage('old', 1, { timestamp: nowSeconds - 36 * 86400 })));
    expect(old).toBeInstanceOf(Stripe.errors.StripeInvalidRequestError);
    expect(old.code).toBe('timestamp_too_far_in_past');
    expect(old.param).toBe('timestamp');

    const ahead = await failureOf(stripe.billing.meterEvents.create(usage('ahead', 1, { timestamp: nowSeconds + 6 * 60 })));
    expect(ahead.code).toBe('timestamp_in_future');

    await stripe.billing.meterEvents.create(usage('34-days', 1, { timestamp: nowSeconds - 34 * 86400 }));
    await stripe.billing.meterEvents.create(usage('4-min-ahead', 1, { timestamp: nowSeconds + 4 * 60 }));
    expect(server.events().map((e) => e.identifier)).toEqual(['34-days', '4-min-ahead']);
  });

  it('refuses an event name without a meter and a non-numeric value at once; takes an unknown customer, never counts it and reports it later', async () => {
    const server = await startStripe();
    const stripe = clientFor(server);

    const meter = await failureOf(stripe.billing.meterEvents.create(usage('x', 1, { event_name: 'no_such_meter' })));
    expect(meter.code).toBe('no_meter');
    const value = await failureOf(
      stripe.billing.meterEvents.create({ event_name: METER_EVENT, payload: { stripe_customer_id: CUSTOMER, value: 'lots' } }),
    );
    expect(value.param).toBe('payload[value]');
    expect(server.events()).toEqual([]);

    // As at Stripe: received (200), checked later against the account's customers.
    const taken = await stripe.billing.meterEvents.create({ event_name: METER_EVENT, identifier: 'nobody-1', payload: { stripe_customer_id: 'cus_nobody', value: '1' } });
    expect(taken.identifier).toBe('nobody-1');
    await server.flushAsyncErrors();
    expect(server.events().map((e) => [e.identifier, e.asyncError?.code])).toEqual([['nobody-1', 'meter_event_customer_not_found']]);
    const listed = await fetch(`${server.url}/v2/core/events`, { headers: { authorization: 'Bearer sk_test_local' } });
    const report = (await listed.json()) as { data: { data: { reason: { error_types: unknown[] } } }[] };
    expect(report.data[0]?.data.reason.error_types).toEqual([
      expect.objectContaining({ code: 'meter_event_customer_not_found', sample_errors: [expect.objectContaining({ request: { identifier: 'nobody-1' } })] }),
    ]);
    // Its identifier is taken all the same: a resend is the duplicate answer, not a new event.
    const again = await failureOf(stripe.billing.meterEvents.create({ event_name: METER_EVENT, identifier: 'nobody-1', payload: { stripe_customer_id: 'cus_nobody', value: '1' } }));
    expect(again.message).toBe('An event already exists with identifier nobody-1.');
  });

  it('answers 401 without a usable API key', async () => {
    const server = await startStripe();

    const bare = await fetch(`${server.url}/v1/billing/meters`);
    expect(bare.status).toBe(401);
    expect(bare.headers.get('request-id')).toMatch(/^req_/);
    expect(((await bare.json()) as { error: { message: string } }).error.message).toMatch(/did not provide an API key/);

    const live = await failureOf(clientFor(server, 'sk_live_abcdefgh1234').billing.meterEvents.create(usage('k', 1)));
    expect(live).toBeInstanceOf(Stripe.errors.StripeAuthenticationError);
    expect(live.statusCode).toBe(401);
    // Stripe never echoes a whole key.
    expect(live.message).toBe('Invalid API Key provided: sk_live_********1234');
    expect(server.events()).toEqual([]);
  });

  it('accepts only the configured key when apiKey is set', async () => {
    const server = await startStripe({ apiKey: 'sk_test_expected' });
    await clientFor(server, 'sk_test_expected').billing.meterEvents.create(usage('a', 1));
    const other = await failureOf(clientFor(server, 'sk_test_other').billing.meterEvents.create(usage('b', 1)));
    expect(other).toBeInstanceOf(Stripe.errors.StripeAuthenticationError);
  });
});

describe('state across restarts', () => {
  it('a snapshot brings back customers, meters and recorded events, and the identifier dedup with them', async () => {
    const first = await startStripe({ meters: [METER_EVENT, 'tokens'] });
    first.addCustomer('cus_added_later');
    await clientFor(first).billing.meterEvents.create(usage('kept-1', 7));
    const state = JSON.parse(JSON.stringify(first.snapshot())) as ReturnType<LocalStripe['snapshot']>;
    await first.close();

    const second = await startStripe({ state });
    expect(second.events().map((e) => [e.identifier, e.value])).toEqual([['kept-1', 7]]);
    expect(second.meters().map((m) => m.eventName).sort()).toEqual(['api_requests', 'tokens']);
    const stripe = clientFor(second);
    expect((await stripe.customers.list({ limit: 10 })).data.map((c) => c.id).sort()).toEqual([CUSTOMER, 'cus_added_later'].sort());
    const error = await failureOf(stripe.billing.meterEvents.create(usage('kept-1', 7)));
    expect(error.message).toBe('An event already exists with identifier kept-1.');
    expect(second.events()).toHaveLength(1);
  });
});

describe('Idempotency-Key', () => {
  it('replays a stored 500 for the same key even after the fault is over', async () => {
    const server = await startStripe();
    const stripe = clientFor(server);
    server.failNext(1, 500);

    const first = await failureOf(stripe.billing.meterEvents.create(usage('idem-1', 1), { idempotencyKey: 'same-key' }));
    const second = await failureOf(stripe.billing.meterEvents.create(usage('idem-1', 1), { idempotencyKey: 'same-key' }));
    const fresh = await stripe.billing.meterEvents.create(usage('idem-1', 1), { idempotencyKey: 'fresh-key' });

    expect(first).toBeInstanceOf(Stripe.errors.StripeAPIError);
    expect(first.statusCode).toBe(500);
    expect(second.statusCode).toBe(500);
    expect(second.headers?.['idempotent-replayed']).toBe('true');
    expect(fresh.identifier).toBe('idem-1');
    expect(server.requests().map((r) => [r.status, r.replayed])).toEqual([
      [500, false],
      [500, true],
      [200, false],
    ]);
    expect(server.events()).toHaveLength(1);
  });

  it('replays a success without recording again, and refuses the key with other parameters', async () => {
    const server = await startStripe();
    const stripe = clientFor(server);
    await stripe.billing.meterEvents.create(usage('idem-2', 1), { idempotencyKey: 'k2' });

    const replay = await stripe.billing.meterEvents.create(usage('idem-2', 1), { idempotencyKey: 'k2' });
    expect(replay.lastResponse.headers['idempotent-replayed']).toBe('true');

    const mismatch = await failureOf(stripe.billing.meterEvents.create(usage('idem-2', 2), { idempotencyKey: 'k2' }));
    expect(mismatch).toBeInstanceOf(Stripe.errors.StripeIdempotencyError);
    expect(server.events()).toHaveLength(1);
  });

  it('expires keys after 24 hours', async () => {
    const clock = fakeClock();
    const server = await startStripe({ now: clock.now });
    const stripe = clientFor(server);
    server.failNext(1, 503);
    await failureOf(stripe.billing.meterEvents.create(usage('idem-3', 1), { idempotencyKey: 'k3' }));

    clock.advance(DAY);
    const event = await stripe.billing.meterEvents.create(usage('idem-3', 1), { idempotencyKey: 'k3' });
    expect(event.identifier).toBe('idem-3');
  });
});

describe('fault injection', () => {
  it('failNext(2, 500) fails two calls with api_error, then the next one succeeds', async () => {
    const server = await startStripe();
    const stripe = clientFor(server);
    server.failNext(2, 500);

    const errors = [
      await failureOf(stripe.billing.meterEvents.create(usage('f-1', 1))),
      await failureOf(stripe.billing.meterEvents.create(usage('f-1', 1))),
    ];
    await stripe.billing.meterEvents.create(usage('f-1', 1));

    for (const error of errors) {
      expect(error).toBeInstanceOf(Stripe.errors.StripeAPIError);
      expect(error.rawType).toBe('api_error');
    }
    expect(server.events()).toHaveLength(1);
  });

  it('a 429 carries Retry-After in err.headers', async () => {
    const server = await startStripe();
    server.failNext(1, 429, { retryAfterSeconds: 7 });

    const error = await failureOf(clientFor(server).billing.meterEvents.create(usage('r-1', 1)));

    expect(error).toBeInstanceOf(Stripe.errors.StripeRateLimitError);
    expect(error.headers?.['retry-after']).toBe('7');
    expect(server.events()).toEqual([]);
  });

  it('dropAfterRecord: Stripe keeps the event, the client sees a connection error', async () => {
    const server = await startStripe();
    // Two drops, because stripe-node retries a closed connection once even with maxNetworkRetries 0
    // (same Idempotency-Key): that retry is answered from the idempotency store and lost as well.
    server.dropAfterRecord(2);

    const error = await failureOf(clientFor(server).billing.meterEvents.create(usage('lost-1', 1)));

    expect(error).toBeInstanceOf(Stripe.errors.StripeConnectionError);
    expect(server.events().map((e) => e.identifier)).toEqual(['lost-1']);
    expect(server.requests().map((r) => [r.status, r.replayed, r.dropped])).toEqual([
      [200, false, true],
      [200, true, true],
    ]);
  });

  it('one lost response is hidden by the client\'s own retry, which gets the stored answer', async () => {
    const server = await startStripe();
    server.dropAfterRecord(1);

    const event = await clientFor(server).billing.meterEvents.create(usage('lost-2', 1));

    expect(event.lastResponse.headers['idempotent-replayed']).toBe('true');
    expect(server.events()).toHaveLength(1);
  });

  it('refuseFor cuts API connections for that long, without blocking the control API', async () => {
    const server = await startStripe();
    const stripe = clientFor(server);
    const startedAt = Date.now();
    server.refuseFor(0.8);

    const error = await failureOf(stripe.billing.meterEvents.create(usage('down-1', 1)));
    expect(error).toBeInstanceOf(Stripe.errors.StripeConnectionError);
    const control = await fetch(`${server.url}/_local/events`);
    expect(control.status).toBe(200);
    expect(server.requests()).toEqual([]);

    await sleep(startedAt + 900 - Date.now());
    await stripe.billing.meterEvents.create(usage('down-1', 1));
    expect(server.events()).toHaveLength(1);
  });

  it('setLatency delays the answer but not the recording', async () => {
    const server = await startStripe();
    server.setLatency(150);
    const began = Date.now();
    const call = clientFor(server).billing.meterEvents.create(usage('slow-1', 1));
    await sleep(60);
    expect(server.events()).toHaveLength(1);
    await call;
    expect(Date.now() - began).toBeGreaterThanOrEqual(140);
  });
});

describe('limits', () => {
  it('rate limit: 20 concurrent calls at 5/s yield exactly 5 successes and 429s with Retry-After: 1', async () => {
    const customers = Array.from({ length: 20 }, (_, i) => `cus_rl_${i}`);
    const server = await startStripe({ rateLimitPerSecond: 5, customers });
    const stripe = clientFor(server);

    const results = await Promise.allSettled(
      customers.map((customer, i) =>
        stripe.billing.meterEvents.create({ event_name: METER_EVENT, identifier: `rl-${i}`, payload: { stripe_customer_id: customer, value: '1' } }),
      ),
    );

    const limited = results.flatMap((r) => (r.status === 'rejected' ? [r.reason as Stripe.errors.StripeError] : []));
    expect(results.filter((r) => r.status === 'fulfilled')).toHaveLength(5);
    expect(limited).toHaveLength(15);
    for (const error of limited) {
      expect(error).toBeInstanceOf(Stripe.errors.StripeRateLimitError);
      expect(error.headers?.['retry-after']).toBe('1');
    }
    expect(server.events()).toHaveLength(5);
  });

  it('one concurrent call per customer and meter: the overlapping call gets a 429', async () => {
    const server = await startStripe({ customers: [CUSTOMER, 'cus_other'] });
    const stripe = clientFor(server);
    server.setLatency(150);

    const results = await Promise.allSettled([
      stripe.billing.meterEvents.create(usage('c-1', 1)),
      stripe.billing.meterEvents.create(usage('c-2', 1)),
    ]);
    const other = { event_name: METER_EVENT, payload: { stripe_customer_id: 'cus_other', value: '1' } };
    await stripe.billing.meterEvents.create(other);
    await stripe.billing.meterEvents.create(other);

    const rejected = results.filter((r) => r.status === 'rejected');
    expect(rejected).toHaveLength(1);
    expect((rejected[0] as PromiseRejectedResult).reason).toBeInstanceOf(Stripe.errors.StripeRateLimitError);
    expect(((rejected[0] as PromiseRejectedResult).reason as Error).message).toMatch(/concurrent requests for customer/);
    expect(server.maxConcurrencySeen(CUSTOMER, METER_EVENT)).toBe(2);
    expect(server.maxConcurrencySeen('cus_other', METER_EVENT)).toBe(1);
  });

  it('the concurrency rule can be switched off', async () => {
    const server = await startStripe({ enforcePerCustomerConcurrency: false });
    const stripe = clientFor(server);
    server.setLatency(100);
    await Promise.all([stripe.billing.meterEvents.create(usage('n-1', 1)), stripe.billing.meterEvents.create(usage('n-2', 1))]);
    expect(server.events()).toHaveLength(2);
    expect(server.maxConcurrencySeen(CUSTOMER, METER_EVENT)).toBe(2);
  });
});

describe('summaries and adjustments', () => {
  it('event_summaries sums billable values per hour, newest first, and over a whole range', async () => {
    const clock = fakeClock();
    const server = await startStripe({ now: clock.now, customers: [CUSTOMER, 'cus_other'] });
    const stripe = clientFor(server);
    const hour = Math.floor(T0 / 1000) - 3 * 3600; // three hours ago, on an hour boundary
    await stripe.billing.meterEvents.create(usage('s-1', 3, { timestamp: hour + 60 }));
    await stripe.billing.meterEvents.create(usage('s-2', 4, { timestamp: hour + 3599 }));
    await stripe.billing.meterEvents.create(usage('s-3', 5, { timestamp: hour + 3600 }));
    await stripe.billing.meterEvents.create(usage('s-cancelled', 100, { timestamp: hour + 3600 }));
    await stripe.billing.meterEventAdjustments.create({ event_name: METER_EVENT, type: 'cancel', cancel: { identifier: 's-cancelled' } });
    await stripe.billing.meterEvents.create({
      event_name: METER_EVENT,
      timestamp: hour + 10,
      payload: { stripe_customer_id: 'cus_other', value: '1000' },
    });
    const meterId = server.meters()[0]?.id ?? '';

    const hourly = await stripe.billing.meters.listEventSummaries(meterId, {
      customer: CUSTOMER,
      start_time: hour,
      end_time: hour + 3 * 3600,
      value_grouping_window: 'hour',
    });
    expect(hourly.data.map((s) => [s.start_time, s.end_time, s.aggregated_value])).toEqual([
      [hour + 3600, hour + 7200, 5],
      [hour, hour + 3600, 7],
    ]);
    expect(hourly.data[0]).toMatchObject({ object: 'billing.meter_event_summary', meter: meterId, livemode: false });

    const whole = await stripe.billing.meters.listEventSummaries(meterId, { customer: CUSTOMER, start_time: hour, end_time: hour + 3 * 3600 });
    expect(whole.data.map((s) => s.aggregated_value)).toEqual([12]);

    const unaligned = await failureOf(stripe.billing.meters.listEventSummaries(meterId, { customer: CUSTOMER, start_time: hour + 1, end_time: hour + 3600 }));
    expect(unaligned.param).toBe('start_time');
  });

  it('paginates summaries with limit and starting_after', async () => {
    const server = await startStripe({ now: fakeClock().now });
    const stripe = clientFor(server);
    const start = Math.floor(T0 / 1000) - 3 * 3600;
    for (let h = 0; h < 3; h++) await stripe.billing.meterEvents.create(usage(`p-${h}`, h + 1, { timestamp: start + h * 3600 }));
    const meterId = server.meters()[0]?.id ?? '';
    const params = { customer: CUSTOMER, start_time: start, end_time: start + 3 * 3600, value_grouping_window: 'hour' as const };

    const first = await stripe.billing.meters.listEventSummaries(meterId, { ...params, limit: 2 });
    const rest = await stripe.billing.meters.listEventSummaries(meterId, { ...params, limit: 2, starting_after: first.data[1]?.id });

    expect(first.has_more).toBe(true);
    expect([...first.data, ...rest.data].map((s) => s.aggregated_value)).toEqual([3, 2, 1]);
    expect(rest.has_more).toBe(false);
  });

  it('cancels an event received within 24 hours, but not an older one or an unknown one', async () => {
    const clock = fakeClock();
    const server = await startStripe({ now: clock.now });
    const stripe = clientFor(server);
    await stripe.billing.meterEvents.create(usage('cancel-me', 1));
    await stripe.billing.meterEvents.create(usage('too-old', 1));

    clock.advance(23 * HOUR);
    const adjustment = await stripe.billing.meterEventAdjustments.create({ event_name: METER_EVENT, type: 'cancel', cancel: { identifier: 'cancel-me' } });
    expect(adjustment).toMatchObject({ object: 'billing.meter_event_adjustment', status: 'pending', type: 'cancel', cancel: { identifier: 'cancel-me' } });
    // A second cancel of the same event is refused, for good, not answered as the first was.
    const twice = await failureOf(stripe.billing.meterEventAdjustments.create({ event_name: METER_EVENT, type: 'cancel', cancel: { identifier: 'cancel-me' } }));
    expect(twice).toBeInstanceOf(Stripe.errors.StripeInvalidRequestError);
    expect(twice.message).toBe("The meter event with identifier 'cancel-me' has already been cancelled.");
    expect(twice.headers?.['stripe-should-retry']).toBe('false');

    clock.advance(2 * HOUR);
    const late = await failureOf(stripe.billing.meterEventAdjustments.create({ event_name: METER_EVENT, type: 'cancel', cancel: { identifier: 'too-old' } }));
    expect(late).toBeInstanceOf(Stripe.errors.StripeInvalidRequestError);
    expect(late.message).toMatch(/more than 24 hours ago/);

    const unknown = await failureOf(stripe.billing.meterEventAdjustments.create({ event_name: METER_EVENT, type: 'cancel', cancel: { identifier: 'never-sent' } }));
    expect(unknown.code).toBe('resource_missing');

    expect(server.events().map((e) => [e.identifier, e.cancelled])).toEqual([
      ['cancel-me', true],
      ['too-old', false],
    ]);
  });
});

describe('a cancel under its one Idempotency-Key', () => {
  it("keeps a refusal made while executing under the key, as Stripe does (a malformed request's is not kept)", async () => {
    const server = await startStripe();
    const stripe = clientFor(server);
    const cancel = { event_name: METER_EVENT, type: 'cancel' as const, cancel: { identifier: 'not-yet' } };
    const first = await failureOf(stripe.billing.meterEventAdjustments.create(cancel, { idempotencyKey: 'k-1' }));
    expect(first.code).toBe('resource_missing');
    await stripe.billing.meterEvents.create(usage('not-yet', 1));
    const replayed = await failureOf(stripe.billing.meterEventAdjustments.create(cancel, { idempotencyKey: 'k-1' }));
    expect([replayed.code, replayed.headers?.['idempotent-replayed']]).toEqual(['resource_missing', 'true']);
    const malformed = { event_name: METER_EVENT, type: 'cancel' as const, cancel: {} } as never;
    await failureOf(stripe.billing.meterEventAdjustments.create(malformed, { idempotencyKey: 'k-2' }));
    expect((await failureOf(stripe.billing.meterEventAdjustments.create(malformed, { idempotencyKey: 'k-2' }))).headers?.['idempotent-replayed']).toBeUndefined();
  });

  it('cancelMeterEvent asks again under a fresh key when its key replays a refusal that no longer holds (the event arrived since)', async () => {
    const server = await startStripe();
    const stripe = clientFor(server);
    const event = { eventName: METER_EVENT, identifier: 'arrives-later' };
    expect((await failureOf(cancelMeterEvent(stripe, event))).code).toBe('resource_missing');
    await stripe.billing.meterEvents.create(usage('arrives-later', 1));
    await cancelMeterEvent(stripe, event);
    expect(server.events().map((e) => [e.identifier, e.cancelled])).toEqual([['arrives-later', true]]);
  });
});

describe('asynchronous error reports', () => {
  /** Answers each delivery 200, or the statuses of `refusals` first, one each; `delayMs` late. */
  async function webhookReceiver(refusals: number[] = [], delayMs = 0): Promise<{ url: string; received: { body: string; signature: string }[] }> {
    const received: { body: string; signature: string }[] = [];
    const receiver = http.createServer((req, res) => {
      const chunks: Buffer[] = [];
      req.on('data', (chunk: Buffer) => chunks.push(chunk));
      req.on('end', () => {
        received.push({ body: Buffer.concat(chunks).toString('utf8'), signature: String(req.headers['stripe-signature']) });
        res.statusCode = refusals.shift() ?? 200;
        setTimeout(() => res.end('ok'), delayMs);
      });
    });
    await new Promise<void>((resolve) => receiver.listen(0, '127.0.0.1', resolve));
    cleanups.push(async () => {
      receiver.closeAllConnections();
      await new Promise((resolve) => receiver.close(resolve));
    });
    return { url: `http://127.0.0.1:${(receiver.address() as AddressInfo).port}/webhook`, received };
  }

  it('answers 200, then posts a signed thin event whose full data names the failed identifiers', async () => {
    const secret = 'whsec_local_test';
    const receiver = await webhookReceiver();
    const server = await startStripe({ webhook: { url: receiver.url, secret } });
    const stripe = clientFor(server);
    server.asyncErrorNext(2, 'meter_event_customer_not_found');

    for (const id of ['bad-1', 'bad-2', 'good-1']) await stripe.billing.meterEvents.create(usage(id, 1));
    await server.flushAsyncErrors();

    expect(receiver.received).toHaveLength(1);
    const { body, signature } = receiver.received[0] ?? { body: '', signature: '' };
    expect(signature).toMatch(/^t=\d+,v1=[0-9a-f]{64}$/);
    // Signature verification is the same as for any webhook; a wrong secret fails it.
    expect(() => stripe.webhooks.constructEvent(body, signature, 'whsec_wrong')).toThrow(Stripe.errors.StripeSignatureVerificationError);
    // With the right secret the signature passes, and stripe-node then points at the thin-event API,
    // as it does for Stripe's real v1.billing.meter.error_report_triggered.
    expect(() => stripe.webhooks.constructEvent(body, signature, secret)).toThrow(/thin event notification/);

    const notification = stripe.parseEventNotification(body, signature, secret);
    expect(notification.type).toBe('v1.billing.meter.error_report_triggered');
    const meterId = server.meters()[0]?.id;
    expect(notification).toMatchObject({ object: 'v2.core.event', related_object: { id: meterId, type: 'billing.meter' } });

    const event = (await notification.fetchEvent()) as Stripe.Events.V1BillingMeterErrorReportTriggeredEvent;
    const errorTypes = event.data.reason.error_types;
    expect(event.data.reason.error_count).toBe(2);
    expect(errorTypes.map((t) => t.code)).toEqual(['meter_event_customer_not_found']);
    expect(errorTypes[0]?.sample_errors.map((s) => s.request.identifier)).toEqual(['bad-1', 'bad-2']);

    expect(server.events().map((e) => [e.identifier, e.asyncError?.code])).toEqual([
      ['bad-1', 'meter_event_customer_not_found'],
      ['bad-2', 'meter_event_customer_not_found'],
      ['good-1', undefined],
    ]);
    const summaries = await stripe.billing.meters.listEventSummaries(meterId ?? '', {
      customer: CUSTOMER,
      start_time: Math.floor(Date.now() / 60000) * 60 - 600,
      end_time: Math.floor(Date.now() / 60000) * 60 + 600,
    });
    expect(summaries.data[0]?.aggregated_value).toBe(1);
  });

  it('delivers to a receiver set after it started (a stack whose API listens later) what failed before', async () => {
    const receiver = await webhookReceiver();
    const server = await startStripe();
    await clientFor(server).billing.meterEvents.create({ event_name: METER_EVENT, identifier: 'early-1', payload: { stripe_customer_id: 'cus_nobody', value: '1' } });
    await server.flushAsyncErrors();
    server.setWebhook({ url: receiver.url, secret: 'whsec_later' });
    await server.flushAsyncErrors();
    expect(receiver.received).toHaveLength(1);
    expect(server.webhookDeliveries()).toEqual([expect.objectContaining({ status: 200 })]);
  });

  it('delivers a report again, later, until its receiver takes it (a 2xx), as Stripe does', async () => {
    const receiver = await webhookReceiver([503]);
    const server = await startStripe({ webhook: { url: receiver.url, secret: 'whsec_again' } });
    server.asyncErrorNext(1, 'meter_event_customer_not_found');
    await clientFor(server).billing.meterEvents.create(usage('again-1', 1));
    await server.flushAsyncErrors();
    expect(server.webhookDeliveries()).toEqual([expect.objectContaining({ status: 503 })]);
    for (let i = 0; i < 150 && server.webhookDeliveries().length < 2; i++) await sleep(20);
    expect(server.webhookDeliveries()).toEqual([expect.objectContaining({ status: 503 }), expect.objectContaining({ status: 200 })]);
    // The same report both times; taken, it is not sent again.
    expect(new Set(receiver.received.map((r) => (JSON.parse(r.body) as { id: string }).id)).size).toBe(1);
    await sleep(2_500);
    expect(receiver.received).toHaveLength(2);
  });

  it('forgets, on reset, a report whose delivery was under way: no redelivery, no entry in the delivery log', async () => {
    const receiver = await webhookReceiver([503], 300);
    const server = await startStripe({ webhook: { url: receiver.url, secret: 'whsec_reset' } });
    server.asyncErrorNext(1, 'meter_event_customer_not_found');
    await clientFor(server).billing.meterEvents.create(usage('reset-1', 1));
    const flushed = server.flushAsyncErrors();
    for (let i = 0; i < 100 && receiver.received.length === 0; i++) await sleep(10);
    server.reset();
    await flushed;
    expect(server.webhookDeliveries()).toEqual([]);
    expect(server.snapshot().undeliveredReports).toEqual([]);
    await sleep(1_500);
    expect(receiver.received).toHaveLength(1);
  });

  it('keeps the reports no receiver took in its snapshot, and delivers them from the next instance', async () => {
    const first = await startStripe();
    await clientFor(first).billing.meterEvents.create({ event_name: METER_EVENT, identifier: 'kept-1', payload: { stripe_customer_id: 'cus_nobody', value: '1' } });
    const state = first.snapshot();
    expect(state.undeliveredReports).toHaveLength(1);
    await first.close();

    const receiver = await webhookReceiver();
    const next = await startStripe({ state });
    expect((await fetch(`${next.url}/v2/core/events`, { headers: { authorization: 'Bearer sk_test_local' } }).then((r) => r.json()) as { data: unknown[] }).data).toHaveLength(1);
    next.setWebhook({ url: receiver.url, secret: 'whsec_next' });
    await next.flushAsyncErrors();
    expect(receiver.received).toHaveLength(1);
    expect(next.snapshot().undeliveredReports).toEqual([]);
  });

  it("refuses every call naming a refused customer with the status and code it was given, others' as usual, until admitted", async () => {
    const server = await startStripe({ customers: [CUSTOMER, 'cus_other'], refuseCustomers: { cus_other: { status: 400, code: 'resource_missing', message: 'refused here' } } });
    const stripe = clientFor(server);
    const refused = await failureOf(stripe.billing.meterEvents.create({ event_name: METER_EVENT, identifier: 'o-1', payload: { stripe_customer_id: 'cus_other', value: '1' } }));
    expect(refused).toMatchObject({ statusCode: 400, code: 'resource_missing', message: 'refused here' });
    await stripe.billing.meterEvents.create(usage('c-1', 1));
    server.admitCustomer('cus_other');
    await stripe.billing.meterEvents.create({ event_name: METER_EVENT, identifier: 'o-2', payload: { stripe_customer_id: 'cus_other', value: '1' } });
    expect(server.events().map((e) => e.identifier)).toEqual(['c-1', 'o-2']);
  });

  it('delivers on its own shortly after the failure', async () => {
    const receiver = await webhookReceiver();
    const server = await startStripe({ webhook: { url: receiver.url, secret: 'whsec_x' } });
    server.asyncErrorNext(1, 'no_meter');
    await clientFor(server).billing.meterEvents.create(usage('bad-3', 1));

    // The receiver has the request before the server has its answer: wait for both.
    for (let i = 0; i < 500 && server.webhookDeliveries().length === 0; i++) await sleep(20);
    expect(receiver.received).toHaveLength(1);
    expect(server.webhookDeliveries()).toEqual([expect.objectContaining({ status: 200 })]);
  });
});

describe('customers, meters and the control API', () => {
  it('serves customers and meters in Stripe\'s shapes', async () => {
    const server = await startStripe({ meters: ['api_requests', 'tokens'] });
    const stripe = clientFor(server);

    const created = await stripe.customers.create({ name: 'Ada' });
    expect(created).toMatchObject({ id: 'cus_local_1', object: 'customer', name: 'Ada' });
    expect((await stripe.customers.retrieve(CUSTOMER)).id).toBe(CUSTOMER);
    expect((await stripe.customers.list()).data.map((c) => c.id)).toEqual(['cus_local_1', CUSTOMER]);
    const missing = await failureOf(stripe.customers.retrieve('cus_missing'));
    expect(missing.statusCode).toBe(404);

    const meters = await stripe.billing.meters.list();
    expect(meters.data.map((m) => [m.id, m.event_name, m.status])).toEqual([
      ['mtr_local_1', 'api_requests', 'active'],
      ['mtr_local_2', 'tokens', 'active'],
    ]);
    expect(meters.data[0]).toMatchObject({
      default_aggregation: { formula: 'sum' },
      customer_mapping: { event_payload_key: 'stripe_customer_id', type: 'by_id' },
      value_settings: { event_payload_key: 'value' },
    });
  });

  it('drives faults, setup and reads over HTTP', async () => {
    const server = await startStripe();
    const stripe = clientFor(server);
    const post = (path: string, body: unknown) =>
      fetch(`${server.url}${path}`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body) });

    expect((await post('/_local/customers', { id: 'cus_ctl' })).status).toBe(200);
    expect(await (await post('/_local/meters', { eventName: 'tokens' })).json()).toEqual({ id: 'mtr_local_2' });
    expect((await post('/_local/faults', { failNext: { count: 1, status: 502 } })).status).toBe(200);
    expect((await post('/_local/faults', { failNext: { count: 'x' } })).status).toBe(400);

    const failed = await failureOf(stripe.billing.meterEvents.create({ event_name: 'tokens', payload: { stripe_customer_id: 'cus_ctl', value: '2' } }));
    expect(failed.statusCode).toBe(502);
    await stripe.billing.meterEvents.create({ event_name: 'tokens', identifier: 'ctl-1', payload: { stripe_customer_id: 'cus_ctl', value: '2' } });
    // A fault it does not know is refused, not taken without effect.
    const unknown = await post('/_local/faults', { refuseCustomer: 'cus_ctl' });
    expect(unknown.status).toBe(400);
    expect(await unknown.text()).toContain('unknown fault refuseCustomer');
    expect((await post('/_local/faults', { refuseCustomers: { cus_ctl: { status: 400, code: 'resource_missing' } } })).status).toBe(200);
    expect(server.faultState().refusedCustomers).toEqual([{ customer: 'cus_ctl', status: 400 }]);
    expect(await failureOf(stripe.billing.meterEvents.create({ event_name: 'tokens', payload: { stripe_customer_id: 'cus_ctl', value: '2' } }))).toMatchObject({ statusCode: 400, code: 'resource_missing' });
    server.admitCustomer('cus_ctl');

    const events = (await (await fetch(`${server.url}/_local/events`)).json()) as { identifier: string }[];
    expect(events.map((e) => e.identifier)).toEqual(['ctl-1']);
    const requests = (await (await fetch(`${server.url}/_local/requests`)).json()) as { status: number }[];
    expect(requests.map((r) => r.status)).toEqual([502, 200, 400]);

    const advanced = (await (await post('/_local/clock', { advanceMs: DAY })).json()) as { now: number };
    expect(advanced.now).toBeGreaterThan(Date.now() + DAY - 60_000);
    await post('/_local/reset', {});
    expect(server.events()).toEqual([]);
    expect(server.requests()).toEqual([]);
    expect(server.meters()).toHaveLength(2);

    // Not from a web page in the developer's browser: a POST carrying Origin, or a request addressed
    // to another name (DNS rebinding) changes nothing and reads nothing.
    const fromPage = await fetch(`${server.url}/_local/faults`, { method: 'POST', headers: { origin: 'https://evil.example', 'content-type': 'application/json' }, body: JSON.stringify({ failNext: { count: 5, status: 500 } }) });
    expect(fromPage.status).toBe(403);
    expect(server.faultState().failNext).toEqual([]);
    const rebound = await new Promise<number>((resolve, reject) => {
      const req = http.request({ host: '127.0.0.1', port: server.port, path: '/_local/events', headers: { host: `evil.example:${server.port}` } }, (res) => resolve(res.statusCode ?? 0));
      req.on('error', reject).end();
    });
    expect(rebound).toBe(403);
    expect((await fetch(`${server.url.replace('127.0.0.1', 'localhost')}/_local/events`)).status).toBe(200);

    // Listening on every address, it is reached (and driven) by loopback from this machine.
    const everywhere = await startStripe({ host: '0.0.0.0' });
    expect(everywhere.url).toBe(`http://127.0.0.1:${everywhere.port}`);
    expect((await fetch(`${everywhere.url}/_local/events`)).status).toBe(200);
  });

  it('`npm run stripe -- status` shows queued failures and `heal` ends them with the outage and the latency', async () => {
    const server = await startStripe();
    const stripe = clientFor(server);
    const root = fileURLToPath(new URL('..', import.meta.url));
    const cli = (...args: string[]) =>
      new Promise<string>((resolve, reject) => {
        const child = spawn(process.execPath, ['--import', 'tsx', 'src/bin/stripe.ts', ...args], {
          cwd: root,
          env: { ...process.env, LOCAL_STRIPE_URL: server.url },
          stdio: ['ignore', 'pipe', 'inherit'],
        });
        let out = '';
        child.stdout.on('data', (b: Buffer) => (out += b.toString()));
        child.once('error', reject);
        child.once('exit', (code) => (code === 0 ? resolve(out) : reject(new Error(`exit ${code}: ${out}`))));
      });

    server.failNext(3, 503);
    server.setLatency(50);
    server.refuseFor(60);
    server.refuseCustomer(CUSTOMER, 400);
    expect(await cli('status')).toMatch(
      /faults: every connection refused for [\d.]+ s more; every meter-event call answered 50 ms late; the next 3 meter-event calls answer 503; every v1 meter-event call for cus_test_1 answers 400/,
    );
    expect(await cli('heal')).toMatch(/^healed: no outage, no latency, no queued failures \(ended: .*the next 3 meter-event calls answer 503.*cus_test_1 answers 400\)/);
    expect(server.faultState()).toEqual({ refusingForMs: 0, latencyMs: 0, failNext: [], dropAfterRecord: 0, garbleNext: 0, asyncErrorNext: [], refusedCustomers: [] });
    expect(await cli('status')).toContain('faults: none, it answers normally');
    // Healed means the very next call is answered normally, not the fourth.
    await stripe.billing.meterEvents.create(usage('after-heal', 1));
    expect(server.requests().map((r) => r.status)).toEqual([200]);
  });

  it('runs standalone: prints its URL, serves the client, exits on SIGTERM', async () => {
    const root = fileURLToPath(new URL('..', import.meta.url));
    const child = spawn(process.execPath, ['--import', 'tsx', 'src/bin/stripe-local.ts', '--port', '0', '--customer', CUSTOMER], {
      cwd: root,
      stdio: ['ignore', 'pipe', 'inherit'],
    });
    cleanups.push(async () => {
      if (child.exitCode === null) child.kill('SIGKILL');
    });
    const [line] = (await once(createInterface({ input: child.stdout }), 'line')) as [string];
    const { localStripe } = JSON.parse(line) as { localStripe: string };
    expect(localStripe).toMatch(/^http:\/\/127\.0\.0\.1:\d+$/);

    const port = Number(new URL(localStripe).port);
    const stripe = new Stripe('sk_test_main', { host: '127.0.0.1', port, protocol: 'http', maxNetworkRetries: 0 });
    await stripe.billing.meterEvents.create(usage('main-1', 1));
    const events = (await (await fetch(`${localStripe}/_local/events`)).json()) as { identifier: string }[];
    expect(events.map((e) => e.identifier)).toEqual(['main-1']);

    child.kill('SIGTERM');
    const [code] = (await once(child, 'exit')) as [number | null];
    expect(code).toBe(0);
  });
});
