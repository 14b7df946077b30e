/**
 * The local Stripe server's v2 meter event stream, exercised through the real `stripe` client: a
 * session bought with the secret key, its token (15 minutes by the simulated clock) sending up to
 * 100 events per request, an empty 200 with validation and dedup done later and silently, failures
 * in the error report, and the faults and account limit of the v1 endpoint.
 */
import http from 'node:http';
import type { AddressInfo } from 'node:net';
import Stripe from 'stripe';
import { describe, expect, it } from 'vitest';
import type { LocalStripe } from '../src/embedded/stripe/server.js';
import { CUSTOMER, DAY, HOUR, METER_EVENT, MINUTE, T0, cleanups, clientFor, startStripe } from './local-stripe.js';

/** stripe 23 does not re-export the stream's parameter types; read them off the method. */
type StreamEvent = Parameters<Stripe['v2']['billing']['meterEventStream']['create']>[0]['events'][number];


/** A session from the secret-key client, and a client that sends with the session's token. */
async function openStream(server: LocalStripe): Promise<{ session: Stripe.V2.Billing.MeterEventSession; stream: Stripe }> {
  const session = await clientFor(server).v2.billing.meterEventSession.create();
  return { session, stream: clientFor(server, session.authentication_token) };
}

function fakeClock(start = T0): { now: () => number; advance: (ms: number) => void } {
  let current = start;
  return { now: () => current, advance: (ms) => (current += ms) };
}

function usage(identifier: string | undefined, value = 1, extra: Partial<StreamEvent> = {}): StreamEvent {
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

async function webhookReceiver(): Promise<{ url: string; received: { body: string; signature: string }[] }> {
  const received: { body: string; signature: string }[] = [];
  const receiver = http.createServer((req, res) => {
    const chunks: Buffer[] = [];
    req.on('data', (chunk: Buffer) => chunks.push(chunk));
    req.on('end', () => {
      received.push({ body: Buffer.concat(chunks).toString('utf8'), signature: String(req.headers['stripe-signature']) });
      res.end('ok');
    });
  });
  await new Promise<void>((resolve) => receiver.listen(0, '127.0.0.1', resolve));
  cleanups.push(async () => {
    receiver.closeAllConnections();
    await new Promise((resolve) => receiver.close(resolve));
  });
  return { url: `http://127.0.0.1:${(receiver.address() as AddressInfo).port}/webhook`, received };
}

describe('POST /v2/billing/meter_event_session', () => {
  it('hands out a token for 15 minutes of the simulated clock, for the secret key only', async () => {
    const server = await startStripe({ now: fakeClock().now, apiKey: 'sk_test_right' });

    const session = await clientFor(server, 'sk_test_right').v2.billing.meterEventSession.create();

    expect(session).toMatchObject({
      id: expect.stringMatching(/^mes_/) as string,
      object: 'v2.billing.meter_event_session',
      authentication_token: expect.stringMatching(/^\S{20,}$/) as string,
      created: new Date(T0).toISOString(),
      expires_at: new Date(T0 + 15 * MINUTE).toISOString(),
      livemode: false,
    });
    // ISO-8601 strings, not unix seconds: `new Date(expires_at * 1000)` would be an invalid date.
    expect(Date.parse(session.expires_at) - Date.parse(session.created)).toBe(15 * MINUTE);

    const wrongKey = await failureOf(clientFor(server, 'sk_test_wrong').v2.billing.meterEventSession.create());
    expect(wrongKey).toBeInstanceOf(Stripe.errors.StripeAuthenticationError);
    // The stream takes the session's token, never the secret key.
    const secretOnStream = await failureOf(clientFor(server, 'sk_test_right').v2.billing.meterEventStream.create({ events: [usage('k-1')] }));
    expect(secretOnStream).toBeInstanceOf(Stripe.errors.StripeAuthenticationError);
    expect(secretOnStream.statusCode).toBe(401);
    expect(server.streamRequests().map((r) => [r.status, r.sessionId])).toEqual([[401, null]]);
  });
});

describe('POST /v2/billing/meter_event_stream', () => {
  it('takes 100 events with an empty 200 and records them afterwards, in the ledger v1 events use', async () => {
    const clock = fakeClock();
    const server = await startStripe({ now: clock.now });
    const { session, stream } = await openStream(server);
    const events = Array.from({ length: 100 }, (_, i) =>
      usage(`s-${i}`, i + 1, { timestamp: new Date(T0 - HOUR + i * 1000).toISOString() }),
    );

    const answer = await stream.v2.billing.meterEventStream.create({ events });

    // Typed `Promise<void>`; in fact the parsed empty body (plus a non-enumerable lastResponse).
    expect(JSON.stringify(answer)).toBe('{}');
    await server.flushAsyncErrors();
    const recorded = server.events();
    expect(recorded).toHaveLength(100);
    expect(recorded[0]).toMatchObject({
      identifier: 's-0',
      eventName: METER_EVENT,
      customer: CUSTOMER,
      value: 1,
      timestamp: Math.floor((T0 - HOUR) / 1000),
      receivedAt: T0,
      cancelled: false,
    });
    expect(recorded.some((e) => e.asyncError)).toBe(false);
    expect(server.streamRequests()).toEqual([
      expect.objectContaining({ at: T0, sessionId: session.id, status: 200, eventCount: 100, dropped: false }),
    ]);
    expect(server.streamRequests()[0]?.identifiers).toEqual(events.map((e) => e.identifier));
    // Summaries read the same ledger: 1 + 2 + … + 100.
    const meterId = server.meters()[0]?.id ?? '';
    const summaries = await clientFor(server).billing.meters.listEventSummaries(meterId, {
      customer: CUSTOMER,
      start_time: Math.floor((T0 - 2 * HOUR) / 1000),
      end_time: Math.floor(T0 / 1000),
    });
    expect(summaries.data[0]?.aggregated_value).toBe(5050);
  });

  it('dates an event without a timestamp at its receipt and names one sent without an identifier', async () => {
    const server = await startStripe({ now: fakeClock().now });
    const { stream } = await openStream(server);

    await stream.v2.billing.meterEventStream.create({ events: [usage(undefined, 3)] });
    await server.flushAsyncErrors();

    const [event] = server.events();
    expect(event?.timestamp).toBe(Math.floor(T0 / 1000));
    expect(event?.identifier).toMatch(/^[0-9a-f-]{36}$/);
    expect(server.streamRequests()[0]?.identifiers).toEqual([null]);
  });

  it('processes events after answering, on its own', async () => {
    const server = await startStripe({ streamProcessingDelayMs: 200 });
    const { stream } = await openStream(server);

    await stream.v2.billing.meterEventStream.create({ events: [usage('later-1')] });
    expect(server.events()).toEqual([]);

    for (let i = 0; i < 50 && server.events().length === 0; i++) await sleep(20);
    expect(server.events().map((e) => e.identifier)).toEqual(['later-1']);
  });

  it('refuses a malformed request as a whole with a 400, recording nothing', async () => {
    const server = await startStripe();
    const { stream } = await openStream(server);
    const many = Array.from({ length: 101 }, (_, i) => usage(`m-${i}`));
    const bad: [string, StreamEvent[]][] = [
      ['101 events', many],
      ['no events', []],
      ['no event_name', [usage('b-1'), { payload: { stripe_customer_id: CUSTOMER, value: '1' } } as unknown as StreamEvent]],
      ['a number in the payload', [usage('b-2'), { ...usage('b-3'), payload: { stripe_customer_id: CUSTOMER, value: 1 } } as unknown as StreamEvent]],
      ['a payload that is not an object', [{ ...usage('b-4'), payload: 'x' } as unknown as StreamEvent]],
      ['a timestamp in unix seconds', [usage('b-5', 1, { timestamp: String(Math.floor(Date.now() / 1000)) })]],
      // stripe-node serialises a Date parameter to unix seconds, so a Date is refused too.
      ['a Date as timestamp', [usage('b-6', 1, { timestamp: new Date() as unknown as string })]],
      ['an identifier over 100 characters', [usage('x'.repeat(101))]],
    ];

    for (const [what, events] of bad) {
      const error = await failureOf(stream.v2.billing.meterEventStream.create({ events }));
      expect(error, what).toBeInstanceOf(Stripe.errors.StripeInvalidRequestError);
      expect(error.statusCode, what).toBe(400);
    }

    await server.flushAsyncErrors();
    expect(server.events()).toEqual([]);
    expect(server.streamRequests().map((r) => [r.status, r.eventCount])).toEqual([
      [400, 101],
      [400, 0],
      [400, 2],
      [400, 2],
      [400, 1],
      [400, 1],
      [400, 1],
      [400, 1],
    ]);
    expect(server.streamRequests()[0]?.errorMessage).toMatch(/at most 100/);
  });

  it('counts a repeated identifier once, silently, within a request and across requests, for 24 hours', async () => {
    const clock = fakeClock();
    const server = await startStripe({ now: clock.now });
    const { stream } = await openStream(server);

    await stream.v2.billing.meterEventStream.create({ events: [usage('d-1', 5), usage('d-1', 7)] });
    await stream.v2.billing.meterEventStream.create({ events: [usage('d-1', 9), usage('d-2', 1)] });
    await server.flushAsyncErrors();
    expect(server.events().map((e) => [e.identifier, e.value])).toEqual([
      ['d-1', 5],
      ['d-2', 1],
    ]);

    // Past the window the identifier is new again (and the session long expired).
    clock.advance(DAY + HOUR);
    const { stream: next } = await openStream(server);
    await next.v2.billing.meterEventStream.create({ events: [usage('d-1', 11)] });
    await server.flushAsyncErrors();
    expect(server.events().map((e) => [e.identifier, e.value])).toEqual([
      ['d-1', 5],
      ['d-2', 1],
      ['d-1', 11],
    ]);
    expect(server.streamRequests().map((r) => r.status)).toEqual([200, 200, 200]);
  });

  it('shares the identifier window with v1 meter events', async () => {
    const server = await startStripe();
    const { stream } = await openStream(server);

    await clientFor(server).billing.meterEvents.create({ event_name: METER_EVENT, identifier: 'both-1', payload: { stripe_customer_id: CUSTOMER, value: '1' } });
    await stream.v2.billing.meterEventStream.create({ events: [usage('both-1', 2)] });
    await server.flushAsyncErrors();

    expect(server.events().map((e) => [e.identifier, e.value])).toEqual([['both-1', 1]]);
  });
});

describe('stream sessions', () => {
  it('an expired session throws TemporarySessionExpiredError; a new session sends again', async () => {
    const server = await startStripe();
    const { stream } = await openStream(server);
    await stream.v2.billing.meterEventStream.create({ events: [usage('e-1')] });

    server.advanceClock(14 * MINUTE);
    await stream.v2.billing.meterEventStream.create({ events: [usage('e-2')] });
    server.advanceClock(2 * MINUTE);
    const expired = await failureOf(stream.v2.billing.meterEventStream.create({ events: [usage('e-3')] }));

    expect(expired).toBeInstanceOf(Stripe.errors.TemporarySessionExpiredError);
    expect(expired).toMatchObject({ statusCode: 401, rawType: 'temporary_session_expired', code: 'billing_meter_event_session_expired' });

    const { stream: fresh } = await openStream(server);
    await fresh.v2.billing.meterEventStream.create({ events: [usage('e-3')] });
    await server.flushAsyncErrors();
    expect(server.events().map((e) => e.identifier)).toEqual(['e-1', 'e-2', 'e-3']);
    expect(server.streamRequests().map((r) => [r.status, r.errorCode ?? null])).toEqual([
      [200, null],
      [200, null],
      [401, 'billing_meter_event_session_expired'],
      [200, null],
    ]);
  });

  it('sessionLifetimeMs (and setSessionLifetime) make a Stripe that issues shorter sessions; sessionsIssued counts them', async () => {
    const clock = fakeClock();
    const server = await startStripe({ now: clock.now, sessionLifetimeMs: 45_000 });
    const { session, stream } = await openStream(server);
    expect(Date.parse(session.expires_at) - Date.parse(session.created)).toBe(45_000);
    clock.advance(45_000);
    const expired = await failureOf(stream.v2.billing.meterEventStream.create({ events: [usage('short-1')] }));
    expect(expired).toBeInstanceOf(Stripe.errors.TemporarySessionExpiredError);

    server.setSessionLifetime(5 * MINUTE);
    const { session: longer } = await openStream(server);
    expect(Date.parse(longer.expires_at) - Date.parse(longer.created)).toBe(5 * MINUTE);
    expect(server.sessionsIssued()).toBe(2);
  });

  it('an unknown token is a plain 401', async () => {
    const server = await startStripe();
    const error = await failureOf(clientFor(server, 'ek_test_made_up').v2.billing.meterEventStream.create({ events: [usage('u-1')] }));
    expect(error).toBeInstanceOf(Stripe.errors.StripeAuthenticationError);
    expect(error).not.toBeInstanceOf(Stripe.errors.TemporarySessionExpiredError);
  });
});

describe('asynchronous validation of stream events', () => {
  it('answers 200 for events that fail later, then reports them by webhook, per meter and for no meter', async () => {
    const secret = 'whsec_stream_test';
    const receiver = await webhookReceiver();
    const server = await startStripe({ webhook: { url: receiver.url, secret } });
    const tokensMeter = server.addMeter('tokens', { customerKey: 'account', valueKey: 'tokens' });
    const { stream } = await openStream(server);
    const tokens = (identifier: string, payload: Record<string, string>, extra: Partial<StreamEvent> = {}): StreamEvent => ({
      event_name: 'tokens',
      identifier,
      payload,
      ...extra,
    });

    await stream.v2.billing.meterEventStream.create({
      events: [
        tokens('ok-1', { account: CUSTOMER, tokens: '40' }),
        tokens('wrong-key', { stripe_customer_id: CUSTOMER, value: '40' }),
        tokens('unknown-customer', { account: 'cus_nobody', tokens: '1' }),
        tokens('fraction', { account: CUSTOMER, tokens: '1.5' }),
        tokens('too-old', { account: CUSTOMER, tokens: '1' }, { timestamp: new Date(Date.now() - 36 * DAY).toISOString() }),
        tokens('too-new', { account: CUSTOMER, tokens: '1' }, { timestamp: new Date(Date.now() + 10 * MINUTE).toISOString() }),
        { event_name: 'no_such_meter', identifier: 'no-meter', payload: { stripe_customer_id: CUSTOMER, value: '1' } },
      ],
    });
    await server.flushAsyncErrors();

    expect(server.events().map((e) => [e.identifier, e.asyncError?.code ?? null])).toEqual([
      ['ok-1', null],
      ['wrong-key', 'meter_event_no_customer_defined'],
      ['unknown-customer', 'meter_event_customer_not_found'],
      ['fraction', 'meter_event_invalid_value'],
      ['too-old', 'timestamp_too_far_in_past'],
      ['too-new', 'timestamp_in_future'],
      ['no-meter', 'no_meter'],
    ]);

    const stripe = clientFor(server);
    const notifications = receiver.received.map(({ body, signature }) => stripe.parseEventNotification(body, signature, secret));
    expect(notifications.map((n) => n.type).sort()).toEqual(['v1.billing.meter.error_report_triggered', 'v1.billing.meter.no_meter_found']);

    const report = notifications.find((n) => n.type === 'v1.billing.meter.error_report_triggered');
    expect(report).toMatchObject({ related_object: { id: tokensMeter, type: 'billing.meter' } });
    const full = (await report?.fetchEvent()) as Stripe.Events.V1BillingMeterErrorReportTriggeredEvent;
    expect(full.data.reason.error_count).toBe(5);
    const byCode = Object.fromEntries(full.data.reason.error_types.map((t) => [t.code, t.sample_errors.map((s) => s.request.identifier)]));
    expect(byCode).toEqual({
      meter_event_no_customer_defined: ['wrong-key'],
      meter_event_customer_not_found: ['unknown-customer'],
      meter_event_invalid_value: ['fraction'],
      timestamp_too_far_in_past: ['too-old'],
      timestamp_in_future: ['too-new'],
    });

    const noMeter = notifications.find((n) => n.type === 'v1.billing.meter.no_meter_found');
    const noMeterEvent = (await noMeter?.fetchEvent()) as Stripe.Events.V1BillingMeterNoMeterFoundEvent;
    expect(noMeterEvent.data.reason.error_types).toEqual([
      expect.objectContaining({ code: 'no_meter', sample_errors: [expect.objectContaining({ request: { identifier: 'no-meter' } })] }),
    ]);

    // Only the valid event counts.
    const now = Math.floor(Date.now() / 60_000) * 60;
    const summary = await stripe.billing.meters.listEventSummaries(tokensMeter, { customer: CUSTOMER, start_time: now - 600, end_time: now + 600 });
    expect(summary.data[0]?.aggregated_value).toBe(40);
  });

  it('delivers the report on its own, without a flush', async () => {
    const receiver = await webhookReceiver();
    const server = await startStripe({ webhook: { url: receiver.url, secret: 'whsec_x' } });
    const { stream } = await openStream(server);

    await stream.v2.billing.meterEventStream.create({ events: [{ ...usage('lonely'), payload: { stripe_customer_id: 'cus_nobody', value: '1' } }] });

    // The receiver has it when the request arrives; the server records the delivery when the answer
    // does, a moment later (under CI load, after the receiver alone was waited for).
    for (let i = 0; i < 50 && (receiver.received.length === 0 || server.webhookDeliveries().length === 0); i++) await sleep(20);
    expect(receiver.received).toHaveLength(1);
    expect(server.webhookDeliveries()).toEqual([expect.objectContaining({ status: 200 })]);
  });

  it('asyncErrorNext fails the next accepted stream events the same way', async () => {
    const server = await startStripe();
    const { stream } = await openStream(server);
    server.asyncErrorNext(1, 'archived_meter');

    await stream.v2.billing.meterEventStream.create({ events: [usage('a-1'), usage('a-2')] });
    await server.flushAsyncErrors();

    expect(server.events().map((e) => [e.identifier, e.asyncError?.code ?? null])).toEqual([
      ['a-1', 'archived_meter'],
      ['a-2', null],
    ]);
  });
});

describe('faults and limits on the stream', () => {
  it('an injected 500 is a StripeAPIError and takes nothing; the next request goes through', async () => {
    const server = await startStripe();
    const { stream } = await openStream(server);
    server.failNext(1, 500);

    const error = await failureOf(stream.v2.billing.meterEventStream.create({ events: [usage('f-1')] }));
    expect(error).toBeInstanceOf(Stripe.errors.StripeAPIError);
    expect(error.statusCode).toBe(500);
    await server.flushAsyncErrors();
    expect(server.events()).toEqual([]);

    await stream.v2.billing.meterEventStream.create({ events: [usage('f-1')] });
    await server.flushAsyncErrors();
    expect(server.events().map((e) => e.identifier)).toEqual(['f-1']);
    expect(server.streamRequests().map((r) => r.status)).toEqual([500, 200]);
  });

  it('failStreamRequestsWith fails every request carrying that identifier, whatever else it carries, until heal()', async () => {
    const server = await startStripe();
    const { stream } = await openStream(server);
    server.failStreamRequestsWith('bad-1', 500);

    const withIt = await failureOf(stream.v2.billing.meterEventStream.create({ events: [usage('good-1'), usage('bad-1')] }));
    expect(withIt).toBeInstanceOf(Stripe.errors.StripeAPIError);
    expect(withIt.statusCode).toBe(500);
    const alone = await failureOf(stream.v2.billing.meterEventStream.create({ events: [usage('bad-1')] }));
    expect(alone.statusCode).toBe(500);
    await stream.v2.billing.meterEventStream.create({ events: [usage('good-1'), usage('good-2')] });
    server.heal();
    await stream.v2.billing.meterEventStream.create({ events: [usage('bad-1')] });

    await server.flushAsyncErrors();
    expect(server.events().map((e) => e.identifier)).toEqual(['good-1', 'good-2', 'bad-1']);
    expect(server.streamRequests().map((r) => r.status)).toEqual([500, 500, 200, 200]);
  });

  it('an injected 429 and the account rate limit are StripeRateLimitErrors with Retry-After', async () => {
    const server = await startStripe({ rateLimitPerSecond: 2 });
    const { stream } = await openStream(server);
    server.failNext(1, 429, { retryAfterSeconds: 3 });

    const injected = await failureOf(stream.v2.billing.meterEventStream.create({ events: [usage('r-0')] }));
    expect(injected).toBeInstanceOf(Stripe.errors.StripeRateLimitError);
    expect(injected.headers?.['retry-after']).toBe('3');

    // One allowance per request, however many events it carries.
    const results = await Promise.allSettled(
      [1, 2, 3].map((n) => stream.v2.billing.meterEventStream.create({ events: [usage(`r-${n}-a`), usage(`r-${n}-b`)] })),
    );
    const limited = results.flatMap((r) => (r.status === 'rejected' ? [r.reason as Stripe.errors.StripeError] : []));
    expect(limited).toHaveLength(1);
    expect(limited[0]).toBeInstanceOf(Stripe.errors.StripeRateLimitError);
    expect(limited[0]?.headers?.['retry-after']).toBe('1');
    await server.flushAsyncErrors();
    expect(server.events()).toHaveLength(4);
  });

  it('a lost response: the events were taken, the client\'s retry resends them, identifiers keep them once', async () => {
    const server = await startStripe();
    const { stream } = await openStream(server);
    // stripe-node retries a closed connection once even with maxNetworkRetries 0. The stream does
    // not replay by Idempotency-Key here, so the retry is processed again: the event with an
    // identifier is deduplicated, the one without is counted twice.
    server.dropAfterRecord(1);

    await stream.v2.billing.meterEventStream.create({ events: [usage('lost-1', 1), usage(undefined, 2)] });
    await server.flushAsyncErrors();

    expect(server.streamRequests().map((r) => [r.status, r.dropped])).toEqual([
      [200, true],
      [200, false],
    ]);
    expect(server.events().map((e) => [e.identifier === 'lost-1' ? 'lost-1' : 'generated', e.value])).toEqual([
      ['lost-1', 1],
      ['generated', 2],
      ['generated', 2],
    ]);
  });

  it('two lost responses: the client sees a connection error, the events were taken', async () => {
    const server = await startStripe();
    const { stream } = await openStream(server);
    server.dropAfterRecord(2);

    const error = await failureOf(stream.v2.billing.meterEventStream.create({ events: [usage('lost-2')] }));
    await server.flushAsyncErrors();

    expect(error).toBeInstanceOf(Stripe.errors.StripeConnectionError);
    expect(server.events().map((e) => e.identifier)).toEqual(['lost-2']);
  });

  it('refuseFor cuts stream connections too', async () => {
    const server = await startStripe();
    const { stream } = await openStream(server);
    // Long enough to cover stripe-node's one retry of a closed connection.
    server.refuseFor(3);

    const error = await failureOf(stream.v2.billing.meterEventStream.create({ events: [usage('down-1')] }));

    expect(error).toBeInstanceOf(Stripe.errors.StripeConnectionError);
    expect(server.streamRequests()).toEqual([]);
  });

  it('has no per-customer concurrency rule: overlapping requests for one customer and meter all succeed', async () => {
    const server = await startStripe();
    const { stream } = await openStream(server);
    server.setLatency(300);

    await Promise.all([1, 2, 3].map((n) => stream.v2.billing.meterEventStream.create({ events: [usage(`c-${n}`)] })));
    // All three arrived while the first was still waiting out its latency, and none was refused.
    const arrivals = server.streamRequests().map((r) => r.at);
    expect(Math.max(...arrivals) - Math.min(...arrivals)).toBeLessThan(300);
    await server.flushAsyncErrors();

    expect(server.streamRequests().map((r) => r.status)).toEqual([200, 200, 200]);
    expect(server.events()).toHaveLength(3);
    // The v1 rule's tracker is not fed by the stream either.
    expect(server.maxConcurrencySeen(CUSTOMER, METER_EVENT)).toBe(0);
  });
});

describe('control API', () => {
  it('reads stream requests and flushes the stream over HTTP', async () => {
    const server = await startStripe({ streamProcessingDelayMs: 60_000 });
    const { stream } = await openStream(server);

    await stream.v2.billing.meterEventStream.create({ events: [usage('ctl-1'), usage('ctl-2')] });
    expect(server.events()).toEqual([]);
    const flushed = await fetch(`${server.url}/_local/flush-stream`, { method: 'POST' });
    expect(flushed.status).toBe(200);
    expect(server.events().map((e) => e.identifier)).toEqual(['ctl-1', 'ctl-2']);

    const requests = (await (await fetch(`${server.url}/_local/stream-requests`)).json()) as { status: number; eventCount: number; identifiers: string[] }[];
    expect(requests).toEqual([expect.objectContaining({ status: 200, eventCount: 2, identifiers: ['ctl-1', 'ctl-2'] })]);
  });
});
