/**
 * The v2 batcher (`MeterEventStream`) on its own, against the local Stripe through the real
 * `stripe` client: how it keeps its session (sessions shorter than a minute, a worker clock far
 * from Stripe's, session requests that fail) and how one event that breaks every request it is in
 * is kept from taking its batch-mates with it. No PostgreSQL, no Temporal: the pipeline around it
 * is in stream.test.ts.
 */
import { Registry } from 'prom-client';
import Stripe from 'stripe';
import { afterEach, describe, expect, it, vi } from 'vitest';
import { LocalStripe, type LocalStripeOptions } from '../src/embedded/stripe/server.js';
import { createMetrics } from '../src/metrics.js';
import type { MeterEvent } from '../src/stripe/meters.js';
import { MeterEventStream, stripeStream, type MeterEventStreamOptions, type StreamStripe } from '../src/stripe/stream.js';
import { StreamSessionError } from '../src/stripe/errors.js';

const CUSTOMER = 'cus_batcher';
const MINUTE = 60_000;

const started: LocalStripe[] = [];
afterEach(async () => {
  await Promise.all(started.splice(0).map((s) => s.close()));
});

async function startStripe(opts: LocalStripeOptions = {}): Promise<LocalStripe> {
  const server = await LocalStripe.start({ customers: [CUSTOMER], ...opts });
  started.push(server);
  return server;
}

function client(server: LocalStripe, key = 'sk_test_batcher'): Stripe {
  return new Stripe(key, { host: '127.0.0.1', port: server.port, protocol: 'http', maxNetworkRetries: 0 });
}

function batcher(server: LocalStripe, opts: MeterEventStreamOptions = {}): MeterEventStream {
  return new MeterEventStream(
    stripeStream(client(server), (token) => client(server, token)),
    opts,
  );
}

function event(identifier: string, at = new Date()): MeterEvent {
  return {
    eventName: 'api_requests',
    keys: { customerKey: 'stripe_customer_id', valueKey: 'value' },
    stripeCustomerId: CUSTOMER,
    quantity: 1,
    identifier,
    occurredAt: at,
  };
}

/** Settles within `ms`, or says what did not. */
async function within<T>(ms: number, what: string, p: Promise<T>): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const timeout = new Promise<never>((_, reject) => (timer = setTimeout(() => reject(new Error(`${what}: not settled within ${ms} ms`)), ms)));
  try {
    return await Promise.race([p, timeout]);
  } finally {
    clearTimeout(timer);
  }
}

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

describe('sessions', () => {
  it('45-second sessions: each used, replaced by its own lifetime, a handful of session requests', async () => {
    // One simulated clock for Stripe and the worker, so three minutes pass at once.
    let now = Date.parse('2026-03-10T12:00:00Z');
    const server = await startStripe({ now: () => now, sessionLifetimeMs: 45_000 });
    const stream = batcher(server, { now: () => now });

    const ids: string[] = [];
    for (let step = 0; step <= 18; step++) {
      const batch = [0, 1, 2].map((i) => `short-${step}-${i}`);
      ids.push(...batch);
      await within(5_000, `batch at ${step * 10} s`, Promise.all(batch.map((id) => stream.send(event(id, new Date(now))))));
      now += 10_000;
    }

    await server.flushAsyncErrors();
    expect(server.events().map((e) => e.identifier).sort()).toEqual([...ids].sort());
    // 180 s of 45 s sessions, each replaced after three quarters of its life (33.75 s): 5 or 6.
    expect(server.sessionsIssued()).toBeLessThanOrEqual(7);
    expect(stream.sessionRequests).toBe(server.sessionsIssued());
    // Replaced before Stripe would refuse it: no request met an expired session.
    expect(server.streamRequests().map((r) => r.status)).toEqual(Array(19).fill(200));
  });

  it('a worker clock 14 minutes ahead of Stripe: sessions still used, the skew reported once', async () => {
    const server = await startStripe();
    const metrics = createMetrics(new Registry());
    const warn = vi.fn();
    const skew = 14 * MINUTE;
    const stream = batcher(server, { now: () => Date.now() + skew, metrics, log: { warn } as never });

    for (let i = 0; i < 5; i++) {
      await within(5_000, `batch ${i}`, Promise.all([0, 1].map((j) => stream.send(event(`skew-${i}-${j}`)))));
    }

    await server.flushAsyncErrors();
    expect(server.events()).toHaveLength(10);
    expect(server.sessionsIssued()).toBe(1);
    // Stripe's clock minus ours: 14 minutes behind, within the request's round trip.
    expect(Math.abs((await stream.clockSkewMs())! + skew)).toBeLessThan(5_000);
    const gauge = (await metrics.stripeClockSkew.get()).values[0]?.value;
    expect(Math.round(gauge!)).toBe(-840);
    expect(warn).toHaveBeenCalledTimes(1);
    expect(warn.mock.calls[0]?.[0]).toEqual({ clockSkewSeconds: -840 });
  });

  it('a worker clock 14 minutes behind: the same, and no warning below 30 s of skew', async () => {
    const server = await startStripe();
    const warn = vi.fn();
    const behind = batcher(server, { now: () => Date.now() - 14 * MINUTE, log: { warn } as never });
    await within(5_000, 'behind', behind.send(event('behind-1')));
    expect(warn.mock.calls[0]?.[0]).toEqual({ clockSkewSeconds: 840 });

    const quiet = vi.fn();
    const close = batcher(server, { now: () => Date.now() + 10_000, log: { warn: quiet } as never });
    await within(5_000, 'close', close.send(event('close-1')));
    expect(quiet).not.toHaveBeenCalled();
    expect(server.sessionsIssued()).toBe(2);
  });

  it('asked for the skew before any event was sent: one session measures it, and the first request uses that session', async () => {
    const server = await startStripe();
    const stream = batcher(server, { now: () => Date.now() - 70 * MINUTE });
    const skew = await within(5_000, 'skew', stream.clockSkewMs());
    expect(Math.abs(skew! - 70 * MINUTE)).toBeLessThan(5_000);
    expect(await stream.clockSkewMs()).toBe(skew);
    await within(5_000, 'send', stream.send(event('measured-1')));
    expect(server.sessionsIssued()).toBe(1);
    expect(stream.sessionRequests).toBe(1);
  });

  it('asked for the skew while no session can be had: the session failure, as a request would have met it', async () => {
    const server = await startStripe();
    server.refuseFor(60);
    const stream = batcher(server);
    await expect(within(5_000, 'skew', stream.clockSkewMs())).rejects.toBeInstanceOf(StreamSessionError);
    expect(stream.sessionRequests).toBe(1);
  });

  it('session requests that fail are backed off (exponential, bounded), shared by every caller; success resets it', async () => {
    let sessionCalls = 0;
    let failing = true;
    const sent: string[] = [];
    const fake: StreamStripe = {
      createSession() {
        sessionCalls++;
        if (failing) return Promise.reject(new Stripe.errors.StripeAPIError({ message: 'session service down', statusCode: 500 } as never));
        const created = new Date();
        return Promise.resolve({ token: `tok_${sessionCalls}`, created, expiresAt: new Date(created.getTime() + 15 * MINUTE) });
      },
      sendEvents(_token, events) {
        sent.push(...events.map((e) => e.identifier!));
        return Promise.resolve();
      },
    };
    const stream = new MeterEventStream(fake, { sessionBackoff: { initialMs: 50, maxMs: 400 } });

    // Two seconds of a busy worker: a batch every 10 ms, each wanting a session.
    const outcomes: Promise<unknown>[] = [];
    const until = Date.now() + 2_000;
    for (let i = 0; Date.now() < until; i++) {
      outcomes.push(stream.send(event(`down-${i}`)).then(() => 'sent', (err: unknown) => err));
      await sleep(10);
    }
    const settled = await within(5_000, 'the batches during the outage', Promise.all(outcomes));

    // Without backoff: one session request per batch (about 150). With it: waits of 25-50, 50-100,
    // 100-200, 200-400 ms, then 200-400 ms each: at most 5 + 1 + 1600 / 200 = 14 in two seconds.
    expect(outcomes.length).toBeGreaterThan(100);
    expect(sessionCalls).toBeGreaterThanOrEqual(4);
    expect(sessionCalls).toBeLessThanOrEqual(14);
    expect(settled.every((o) => o instanceof StreamSessionError && o.cause instanceof Stripe.errors.StripeAPIError)).toBe(true);
    expect(sent).toEqual([]);

    // The service back: the next session request (after at most one more wait) works, and events flow.
    failing = false;
    await within(2_000, 'after the outage', stream.send(event('up-1')));
    expect(sent).toEqual(['up-1']);
    const callsAfter = sessionCalls;
    await within(2_000, 'next', stream.send(event('up-2')));
    expect(sessionCalls).toBe(callsAfter);
  });
});

describe('one event that fails every request it is in', () => {
  it('a 500 for every request carrying X: its 20 batch-mates are accepted, X fails alone, in a few requests', async () => {
    const server = await startStripe();
    server.failStreamRequestsWith('poison', 500);
    const stream = batcher(server);

    const ids = ['poison', ...Array.from({ length: 20 }, (_, i) => `mate-${i}`)];
    const outcomes = await within(
      10_000,
      'the batch',
      Promise.all(ids.map((id) => stream.send(event(id)).then(() => 'accepted', (err: unknown) => err))),
    );

    expect(outcomes.slice(1)).toEqual(Array(20).fill('accepted'));
    expect(outcomes[0]).toBeInstanceOf(Stripe.errors.StripeAPIError);
    expect((outcomes[0] as Stripe.errors.StripeError).statusCode).toBe(500);
    await server.flushAsyncErrors();
    expect(server.events().map((e) => e.identifier).sort()).toEqual(ids.slice(1).sort());
    // One batch of 21, then halves down to X alone: 1 + 2 × ceil(log2 21) = 11 requests at most.
    const requests = server.streamRequests();
    expect(requests.length).toBeLessThanOrEqual(11);
    expect(requests.filter((r) => r.identifiers.length === 1 && r.identifiers[0] === 'poison').map((r) => r.status)).toEqual([500]);
    expect(requests.filter((r) => r.status === 500).every((r) => r.identifiers.includes('poison'))).toBe(true);
  });

  it("one customer's events that each break every request they are in: the other customers' events in the same requests are accepted", async () => {
    const customers = ['cus_a', 'cus_b', 'cus_c', 'cus_d', 'cus_e'];
    const server = await startStripe({ customers });
    // cus_a's events come one per turn with the others' (the queue serves customers in turn), so
    // they sit in every part of the request: halves cut in the middle failed both, and everyone.
    const sends: { customer: string; id: string }[] = [];
    for (let i = 0; i < 8; i++) for (const customer of customers) sends.push({ customer, id: `${customer}-${i}` });
    for (const s of sends) if (s.customer === 'cus_a') server.failStreamRequestsWith(s.id, 500);
    const stream = batcher(server);

    const outcomes = await within(
      10_000,
      'the batch',
      Promise.all(sends.map((s) => stream.send(eventOf(s.customer, s.id)).then(() => 'accepted', (err: unknown) => (err as Stripe.errors.StripeError).statusCode))),
    );
    const byCustomer = (customer: string) => outcomes.filter((_, i) => sends[i]!.customer === customer);
    expect(byCustomer('cus_a')).toEqual(Array(8).fill(500));
    for (const customer of customers.slice(1)) expect(byCustomer(customer), customer).toEqual(Array(8).fill('accepted'));
    // Halved between customers, level by level, down to cus_a's own halves (9 requests here): at
    // most 1 + 2 × ceil(log2 5) for the customers, and the two halves of cus_a's own.
    expect(server.streamRequests().length).toBeLessThanOrEqual(9);
    expect(server.streamRequests().filter((r) => r.status === 200).flatMap((r) => r.identifiers).filter((id) => String(id).startsWith('cus_a'))).toEqual([]);
  });

  it("a customer whose event failed alone goes in requests of its own for a while: the others' next events are not split again with its next poison", async () => {
    const customers = ['cus_a', 'cus_b', 'cus_c', 'cus_d', 'cus_e'];
    const server = await startStripe({ customers });
    for (const id of ['cus_a-0', 'cus_a-1']) server.failStreamRequestsWith(id, 500);
    const stream = batcher(server);
    const round = (i: number) =>
      within(10_000, `round ${i}`, Promise.all(customers.map((c) => stream.send(eventOf(c, `${c}-${i}`)).then(() => 'accepted', (err: unknown) => (err as Stripe.errors.StripeError).statusCode))));
    expect(await round(0)).toEqual([500, 'accepted', 'accepted', 'accepted', 'accepted']);
    const splitting = server.streamRequests().length;
    expect(splitting).toBeGreaterThan(2);
    // Its retried (still poison) event and the others' next: one request for the others, one for it.
    expect(await round(1)).toEqual([500, 'accepted', 'accepted', 'accepted', 'accepted']);
    const after = server.streamRequests().slice(splitting);
    expect(after.map((r) => ({ status: r.status, ids: [...r.identifiers].sort() }))).toEqual(
      expect.arrayContaining([
        { status: 500, ids: ['cus_a-1'] },
        { status: 200, ids: ['cus_b-1', 'cus_c-1', 'cus_d-1', 'cus_e-1'] },
      ]),
    );
    expect(after).toHaveLength(2);
  });

  it('an event that breaks requests beside one Stripe refuses as malformed: each meets its own fate', async () => {
    const server = await startStripe();
    server.failStreamRequestsWith('poison', 503);
    const stream = batcher(server);
    const malformed = { ...event('x'.repeat(101)) };

    const ids = ['poison', ...Array.from({ length: 9 }, (_, i) => `ok-${i}`)];
    const sends = [...ids.map((id) => stream.send(event(id))), stream.send(malformed)];
    const outcomes = await within(10_000, 'the batch', Promise.all(sends.map((p) => p.then(() => 'accepted', (err: unknown) => err))));

    expect(outcomes.slice(1, 10)).toEqual(Array(9).fill('accepted'));
    expect((outcomes[0] as Stripe.errors.StripeError).statusCode).toBe(503);
    expect(outcomes[10]).toBeInstanceOf(Stripe.errors.StripeInvalidRequestError);
  });

  it("one customer's event Stripe refuses as malformed: the other customers' events go in a few requests, not one each", async () => {
    const customers = ['cus_a', 'cus_b', 'cus_c', 'cus_d', 'cus_e'];
    const server = await startStripe({ customers });
    const sends: { customer: string; id: string }[] = [];
    for (let i = 0; i < 8; i++) for (const customer of customers) sends.push({ customer, id: `${customer}-${i}` });
    // An identifier over Stripe's 100 characters: the whole request carrying it is refused (400).
    sends[5] = { customer: 'cus_a', id: 'x'.repeat(101) };
    const stream = batcher(server);

    const outcomes = await within(
      10_000,
      'the batch',
      Promise.all(sends.map((s) => stream.send(eventOf(s.customer, s.id)).then(() => 'accepted', (err: unknown) => (err as Stripe.errors.StripeError).statusCode))),
    );
    expect(outcomes.filter((o) => o !== 'accepted')).toEqual([400]);
    expect(outcomes[5]).toBe(400);
    // Halved between customers down to cus_a's eight, then those one by one: at most
    // 1 + 2 × ceil(log2 5) + 8 requests, not 1 + 40.
    expect(server.streamRequests().length).toBeLessThanOrEqual(15);
  });

  it('a failure before any request (the session, the pace) says nothing about the events: no split', async () => {
    let sessionCalls = 0;
    let paceCalls = 0;
    const fake: StreamStripe = {
      createSession() {
        sessionCalls++;
        return Promise.reject(new Stripe.errors.StripeAPIError({ message: 'session service down', statusCode: 500 } as never));
      },
      sendEvents: () => Promise.reject(new Error('no request expected')),
    };
    const stream = new MeterEventStream(fake, { pace: () => Promise.resolve(void paceCalls++) });
    const outcomes = await within(
      5_000,
      'the batch',
      Promise.all(Array.from({ length: 10 }, (_, i) => stream.send(event(`pre-${i}`)).then(() => 'sent', (err: unknown) => err))),
    );
    expect(outcomes.every((o) => o instanceof StreamSessionError && o.cause instanceof Stripe.errors.StripeAPIError)).toBe(true);
    expect([sessionCalls, paceCalls, stream.requests]).toEqual([1, 1, 0]);
  });

  it('a session Stripe no longer knows (401, not expired): a new one at once, and the request again, not a key refused until the session would end', async () => {
    const tokens: string[] = [];
    const fake: StreamStripe = {
      createSession() {
        const created = new Date();
        return Promise.resolve({ token: `tok_${tokens.length + 1}`, created, expiresAt: new Date(created.getTime() + 15 * MINUTE) });
      },
      sendEvents(token) {
        tokens.push(token);
        if (token === 'tok_1') return Promise.reject(new Stripe.errors.StripeAuthenticationError({ message: 'this token is not one', statusCode: 401 } as never));
        return Promise.resolve();
      },
    };
    const stream = new MeterEventStream(fake, { sessionBackoff: { initialMs: 1, maxMs: 1 } });
    await within(5_000, 'the event', stream.send(event('after-restart')));
    expect(tokens).toEqual(['tok_1', 'tok_2']);
  });

  it("a refused key after a request that may have reached Stripe: the events take that request's failure, not the key's (their attempt is not taken back)", async () => {
    let sessionCalls = 0;
    let sends = 0;
    const keyRefused = () => new Stripe.errors.StripeAuthenticationError({ message: 'Expired API Key provided: sk_test_****', statusCode: 401, code: 'api_key_expired' } as never);
    const fake: StreamStripe = {
      createSession() {
        // The key is rolled and expired after the first session.
        if (++sessionCalls > 1) return Promise.reject(keyRefused());
        const created = new Date();
        return Promise.resolve({ token: 'tok_1', created, expiresAt: new Date(created.getTime() + 15 * MINUTE) });
      },
      sendEvents() {
        // The first request's answer is lost (Stripe may have taken it); then the session is over.
        if (++sends === 1) return Promise.reject(new Stripe.errors.StripeConnectionError({ message: 'socket hang up' } as never));
        return Promise.reject(Object.assign(new Stripe.errors.StripeInvalidRequestError({ message: 'session expired', statusCode: 401 } as never), { code: 'billing_meter_event_session_expired' }));
      },
    };
    const stream = new MeterEventStream(fake, { sessionBackoff: { initialMs: 1, maxMs: 1 } });
    const outcomes = await within(5_000, 'the batch', Promise.all(Array.from({ length: 4 }, (_, i) => stream.send(event(`rolled-${i}`)).then(() => 'sent', (err: unknown) => err))));
    expect(outcomes.map((o) => o?.constructor.name)).toEqual(Array(4).fill('StripeConnectionError'));

    // Events no request of which went out take the key's refusal (no session for them): nothing was sent.
    const fresh = await within(5_000, 'the next batch', stream.send(event('fresh')).then(() => 'sent', (err: unknown) => err));
    expect(fresh).toBeInstanceOf(StreamSessionError);
    expect((fresh as StreamSessionError).cause).toBeInstanceOf(Stripe.errors.StripeAuthenticationError);
  });

  it('a plain outage (every request fails): at most three requests per batch, every event takes the error', async () => {
    const server = await startStripe();
    server.failNext(10_000, 500);
    const stream = batcher(server);

    const outcomes = await within(
      10_000,
      'the batches',
      Promise.all(Array.from({ length: 250 }, (_, i) => stream.send(event(`out-${i}`)).then(() => 'accepted', (err: unknown) => err))),
    );

    expect(outcomes.every((o) => o instanceof Stripe.errors.StripeAPIError)).toBe(true);
    // Three batches (100, 100, 50): each, then its two halves, and no further (the whole level failed).
    expect(server.streamRequests()).toHaveLength(9);
    expect(stream.requests).toBe(9);
  });
});

/** The real stream to `server`, counting the requests in flight at once. */
function countingStream(server: LocalStripe): { stripe: StreamStripe; peak: () => number } {
  const real = stripeStream(client(server), (token) => client(server, token));
  let now = 0;
  let peak = 0;
  return {
    stripe: {
      createSession: () => real.createSession(),
      async sendEvents(token, events) {
        peak = Math.max(peak, ++now);
        try {
          await real.sendEvents(token, events);
        } finally {
          now--;
        }
      },
    },
    peak: () => peak,
  };
}

function eventOf(customer: string, identifier: string): MeterEvent {
  return { ...event(identifier), stripeCustomerId: customer };
}

describe('batching and turns', () => {
  it('events arriving one every 10 ms (retries, a slow backlog) share requests instead of one request each', async () => {
    const server = await startStripe();
    const stream = batcher(server);
    const sends: Promise<void>[] = [];
    for (let i = 0; i < 100; i++) {
      sends.push(stream.send(event(`spread-${i}`)));
      await sleep(10);
    }
    await within(10_000, 'the spread events', Promise.all(sends));
    await server.flushAsyncErrors();
    expect(server.events()).toHaveLength(100);
    // A 5 ms linger sent about one request per event here; at 100 events/s a request waits for
    // company (200 ms), after the first few while the rate is being learnt.
    expect(stream.requests).toBeLessThanOrEqual(20);
  });

  it('a quiet worker does not hold a lone event back for company that is not coming', async () => {
    const server = await startStripe();
    const stream = batcher(server, { maxLingerMs: 1_000 });
    for (let i = 0; i < 2; i++) {
      // An event every 1.5 s: about one expected within a linger of a second, not worth the wait.
      await within(900, `lone event ${i}`, stream.send(event(`lone-${i}`)));
      await sleep(1_500);
    }
    expect(stream.requests).toBe(2);
  });

  it('requests take their events once they have their slot of the pace: a tight pace fills them', async () => {
    const server = await startStripe();
    // One request every 100 ms, whatever is waiting.
    let nextSlot = 0;
    const pace = async () => {
      const at = Math.max(Date.now(), nextSlot);
      nextSlot = at + 100;
      await sleep(at - Date.now());
    };
    const stream = batcher(server, { pace, lingerMs: 1, maxLingerMs: 1 });
    const sends: Promise<void>[] = [];
    for (let i = 0; i < 500; i++) {
      sends.push(stream.send(event(`paced-${i}`)));
      if (i % 5 === 4) await sleep(5);
    }
    await within(20_000, 'the paced events', Promise.all(sends));
    const sizes = server.streamRequests().map((r) => r.eventCount);
    expect(sizes.reduce((a, b) => a + b, 0)).toBe(500);
    // A batch formed before the pace would carry what 1 ms gathers (5 events); taken after it, 100 ms worth.
    expect(sizes.length).toBeLessThanOrEqual(25);
  });

  it("another customer's event goes in the next request, not behind a flood already queued", async () => {
    const server = await startStripe({ customers: [CUSTOMER, 'cus_flood', 'cus_quiet'] });
    server.setLatency(50);
    const stream = batcher(server, { maxInFlight: 1 });
    const flood = Array.from({ length: 1_000 }, (_, i) => stream.send(eventOf('cus_flood', `flood-${i}`)));
    // The first request is on its way with 100 of the flood; 900 wait.
    await sleep(20);
    const quiet = stream.send(eventOf('cus_quiet', 'quiet-1'));
    await within(20_000, 'all', Promise.all([...flood, quiet]));

    const requests = server.streamRequests();
    expect(requests).toHaveLength(11);
    const carrying = requests.findIndex((r) => r.identifiers.includes('quiet-1'));
    // A FIFO batcher sent it in the last request, after the whole flood.
    expect(carrying).toBe(1);
    // The flood's turn, then the quiet customer's.
    expect(requests[1]!.identifiers.slice(0, 2)).toEqual(['flood-100', 'quiet-1']);
  });

  it('at most maxInFlight requests at once; the backlog waits in the queue and leaves in full requests', async () => {
    const server = await startStripe();
    server.setLatency(50);
    const counted = countingStream(server);
    const stream = new MeterEventStream(counted.stripe, { maxInFlight: 2 });
    await within(20_000, 'the backlog', Promise.all(Array.from({ length: 1_000 }, (_, i) => stream.send(event(`cap-${i}`)))));
    expect(counted.peak()).toBe(2);
    expect(stream.peakInFlight).toBe(2);
    expect(server.streamRequests().map((r) => r.eventCount)).toEqual(Array(10).fill(100));
  });

  it('the same identifier sent again while it waits travels once, and both sends settle', async () => {
    const server = await startStripe();
    const stream = batcher(server);
    await within(5_000, 'both', Promise.all([stream.send(event('twice')), stream.send(event('other')), stream.send(event('twice'))]));
    expect(server.streamRequests().map((r) => r.identifiers)).toEqual([['twice', 'other']]);
  });
});
