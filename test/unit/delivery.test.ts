/**
 * The delivery activity's decisions, in milliseconds: the real activity in Temporal's
 * MockActivityEnvironment, with its parts (the row's statements, the lease, the pace, the sender,
 * the meters) replaced by fakes. What crosses processes (PostgreSQL, a real Stripe client, workers
 * dying) is tested end to end in pipeline, lanes, stream and faults.
 */
import { ApplicationFailure } from '@temporalio/common';
import { MockActivityEnvironment } from '@temporalio/testing';
import Stripe from 'stripe';
import { StreamSessionError } from '../../src/stripe/errors.js';
import { describe, expect, it, vi } from 'vitest';
import { createDeliveryActivities, type DeliveryDeps } from '../../activities/delivery.js';
import { resolveTimings } from '../../src/config.js';
import type { AttemptRow, DeliveryStore, Marked } from '../../src/outbox/sql/delivery.js';
import type { Lease, LeaseWait } from '../../src/stripe/meter-lease.js';
import type { MeterEvent } from '../../src/stripe/meters.js';
import { outageWatch } from '../../src/stripe/outage.js';
import { tracedSender, type MeterEventSender } from '../../src/stripe/sender.js';
import type { OutageHold } from '../../workflows/shared.js';

const timings = resolveTimings(20_000, 30_000);
const KEY = 'u:acme:1';
const KEYS = { meterId: 'mtr_1', customerKey: 'stripe_customer_id', valueKey: 'value' };
const silent = { log() {}, trace() {}, debug() {}, info() {}, warn() {}, error() {} };

const row = (over: Partial<AttemptRow> = {}): AttemptRow => ({
  status: 'dispatched',
  attempt_count: 1,
  event_name: 'api_requests',
  quantity: 3,
  occurred_at: new Date(Date.now() - 60_000),
  first_attempted_at: new Date(),
  stripe_customer_id: 'cus_a',
  created_at: new Date(Date.now() - 1_000),
  dispatched_at: new Date(Date.now() - 1_000),
  identifier: KEY,
  identifier_revision: 0,
  ...over,
});

/** Fakes for every part; each records what it was asked. */
function parts(opts: { api?: 'v1' | 'v2'; row?: AttemptRow | undefined; send?: (e: MeterEvent) => Promise<void>; waits?: LeaseWait[]; granted?: boolean; leaseHeld?: boolean[]; clockSkewMs?: number } = {}) {
  const sent: MeterEvent[] = [];
  const waits = [...(opts.waits ?? ['acquired'])];
  const leaseHeld = [...(opts.leaseHeld ?? [true])];
  const store = {
    beginAttempt: vi.fn(async () => ({ leaseHeld: leaseHeld.shift() ?? true, row: 'row' in opts ? opts.row : row() })),
    undoAttempt: vi.fn(async () => undefined),
    findRow: vi.fn(async () => undefined),
    recordAttemptError: vi.fn(async () => undefined),
    markDelivered: vi.fn(async (): Promise<Marked> => ({ attempts: 1, first: true })),
    markSentAndHandOff: vi.fn(async (): Promise<Marked & { handOffs: { lease: string; nextHolder: string | null }[] }> => ({ attempts: 1, first: true, handOffs: [{ lease: 'cus_a\u001fapi_requests', nextHolder: 'next' }] })),
    markRowDead: vi.fn(async () => ({ attempts: 1, firstAttemptedAt: null })),
    markRowReopened: vi.fn(async () => undefined),
  } satisfies DeliveryStore;
  const lease = {
    wait: vi.fn(async () => waits.shift() ?? 'acquired'),
    renew: vi.fn(async () => true),
    handOff: vi.fn(async () => undefined),
    hold: vi.fn(async () => undefined),
    handedOff: vi.fn(),
  } satisfies Lease;
  const pacer = {
    take: vi.fn(async () => (opts.granted === false ? { granted: false, waitMs: 5_000 } : { granted: true, waitMs: 0 })),
    keepPace: vi.fn(async () => undefined),
  };
  const sender: MeterEventSender = {
    api: opts.api ?? 'v1',
    ...(opts.clockSkewMs === undefined ? {} : { clockSkewMs: async () => opts.clockSkewMs! }),
    send: async (e) => {
      sent.push(e);
      await opts.send?.(e);
    },
  };
  const deps: DeliveryDeps = { store, lease, pacer, sender, meters: { keysFor: async () => KEYS }, config: { timings } };
  return { deps, store, lease, pacer, sent };
}

async function deliver(
  deps: DeliveryDeps,
  info: { attempt?: number; isLocal?: boolean; heldByOutage?: OutageHold } = {},
  env = new MockActivityEnvironment({ attempt: info.attempt ?? 1, isLocal: info.isLocal ?? false }, { logger: silent }),
) {
  return env.run(createDeliveryActivities(deps).deliverUsage, { key: KEY, ...(info.heldByOutage ? { heldByOutage: info.heldByOutage } : {}) });
}

const stripeError = {
  connection: () => new Stripe.errors.StripeConnectionError({ message: 'socket hang up' } as never),
  rateLimited: (retryAfter?: string) =>
    new Stripe.errors.StripeRateLimitError({ type: 'rate_limit_error', message: 'slow down', statusCode: 429, ...(retryAfter ? { headers: { 'retry-after': retryAfter } } : {}) } as never),
  duplicate: () => new Stripe.errors.StripeInvalidRequestError({ type: 'invalid_request_error', statusCode: 400, message: `An event already exists with identifier ${KEY}.` } as never),
  rejected: () => new Stripe.errors.StripeInvalidRequestError({ type: 'invalid_request_error', statusCode: 400, code: 'resource_missing', message: 'No such customer' } as never),
};

describe('v1: under the (customer, meter) lease', () => {
  it('sends the event once, with the key as identifier, and marks it sent handing the lease on in the same statement', async () => {
    const { deps, store, lease, sent } = parts();
    expect(await deliver(deps)).toEqual({ outcome: 'sent', attempts: 1 });
    expect(sent).toEqual([{ eventName: 'api_requests', keys: KEYS, stripeCustomerId: 'cus_a', quantity: 3, identifier: KEY, occurredAt: expect.any(Date) }]);
    expect(store.beginAttempt).toHaveBeenCalledWith(KEY, expect.objectContaining({ lease: { holder: expect.any(String), leaseMs: timings.leaseMs } }));
    expect(store.markSentAndHandOff).toHaveBeenCalledWith(KEY, expect.any(String), timings.handOffMs, 0);
    expect(lease.handedOff).toHaveBeenCalledWith([{ lease: 'cus_a\u001fapi_requests', nextHolder: 'next' }]);
    // Handed on already: not again, and not held.
    expect(lease.handOff).not.toHaveBeenCalled();
    expect(lease.hold).not.toHaveBeenCalled();
  });

  it("marks the row under the identifier revision it sent; a row rebilled meanwhile is left as it is and the call not counted", async () => {
    for (const api of ['v1', 'v2'] as const) {
      const { deps, store } = parts({ api, row: row({ identifier: `r1:${KEY}`, identifier_revision: 1 }) });
      store.markSentAndHandOff.mockResolvedValueOnce({ attempts: null, first: false, handOffs: [] });
      store.markDelivered.mockResolvedValueOnce({ attempts: null, first: false });
      const metrics = { eventsSent: { inc: vi.fn() }, commitToAck: { observe: vi.fn() }, stripeErrors: { inc: vi.fn() }, watchStripeDown: vi.fn() };
      expect(await deliver({ ...deps, metrics: metrics as never })).toEqual({ outcome: api === 'v1' ? 'sent' : 'accepted', attempts: 1 });
      if (api === 'v1') expect(store.markSentAndHandOff).toHaveBeenCalledWith(KEY, expect.any(String), timings.handOffMs, 1);
      else expect(store.markDelivered).toHaveBeenCalledWith(KEY, 'accepted', 1);
      expect(metrics.eventsSent.inc).not.toHaveBeenCalled();
    }
  });

  it('a row rejected by an error report or cancelled while its call was at Stripe: the attempt says so, for the run to end listed as that', async () => {
    for (const api of ['v1', 'v2'] as const) {
      for (const status of ['rejected_async', 'cancelled'] as const) {
        const { deps, store } = parts({ api });
        store.markSentAndHandOff.mockResolvedValueOnce({ attempts: null, first: false, handOffs: [] });
        store.markDelivered.mockResolvedValueOnce({ attempts: null, first: false });
        store.findRow.mockResolvedValueOnce({ status, first_attempted_at: new Date() } as never);
        expect(await deliver(deps)).toEqual({ outcome: 'already_sent', attempts: 1, status });
      }
      // The row unreadable then (our database away): the call's answer stands.
      const away = parts({ api });
      away.store.markSentAndHandOff.mockResolvedValueOnce({ attempts: null, first: false, handOffs: [] });
      away.store.markDelivered.mockResolvedValueOnce({ attempts: null, first: false });
      away.store.findRow.mockRejectedValueOnce(new Error('connection terminated'));
      expect(await deliver(away.deps)).toEqual({ outcome: api === 'v1' ? 'sent' : 'accepted', attempts: 1 });
    }
  });

  it('counts an event once: the mark of a row another attempt already made delivered (v2: a timed-out attempt and its retry in one request) is not a second event', async () => {
    for (const api of ['v1', 'v2'] as const) {
      const { deps, store } = parts({ api });
      store.markSentAndHandOff.mockResolvedValueOnce({ attempts: 2, first: false, handOffs: [] });
      store.markDelivered.mockResolvedValueOnce({ attempts: 2, first: false });
      const metrics = { eventsSent: { inc: vi.fn() }, commitToAck: { observe: vi.fn() }, stripeErrors: { inc: vi.fn() }, watchStripeDown: vi.fn() };
      expect(await deliver({ ...deps, metrics: metrics as never })).toEqual({ outcome: api === 'v1' ? 'sent' : 'accepted', attempts: 2 });
      expect(metrics.eventsSent.inc).not.toHaveBeenCalled();
      expect(metrics.commitToAck.observe).not.toHaveBeenCalled();
      const once = parts({ api });
      expect(await deliver({ ...once.deps, metrics: metrics as never })).toMatchObject({ attempts: 1 });
      expect(metrics.eventsSent.inc).toHaveBeenCalledTimes(1);
    }
  });

  it("sends the identifier the row's attempt read (a namespaced or rebilled one), never the bare key", async () => {
    for (const api of ['v1', 'v2'] as const) {
      const { deps, sent } = parts({ api, row: row({ identifier: `eu/r2:${KEY}` }) });
      await deliver(deps);
      expect(sent.map((e) => e.identifier)).toEqual([`eu/r2:${KEY}`]);
    }
  });

  it("its pace statement failing on our PostgreSQL (too many connections): nothing sent, deferred as database_unavailable, no attempt spent, nothing recorded as the event's error", async () => {
    const { deps, store, pacer, sent } = parts();
    pacer.keepPace.mockRejectedValueOnce(Object.assign(new Error('sorry, too many clients already'), { code: '53300' }));
    expect(await deliver(deps)).toMatchObject({ outcome: 'deferred', reason: 'database_unavailable' });
    expect(store.recordAttemptError).not.toHaveBeenCalled();
    expect(sent).toEqual([]);
  });

  it('a new lease holder for every execution, even of the same attempt number', async () => {
    const { deps, lease } = parts();
    await deliver(deps, { attempt: 1 });
    await deliver(deps, { attempt: 1 });
    const [a, b] = lease.wait.mock.calls.map((c) => (c as unknown[])[1] as string);
    expect(a).toMatch(/\/1\/[0-9a-f-]{36}$/);
    expect(a).not.toBe(b);
  });

  it('a lease still busy after the wait: deferred as lease_busy, nothing begun or sent, its place handed on', async () => {
    const { deps, store, lease, sent } = parts({ waits: ['gave_up'] });
    // Not begun: a forced retry's force stands for the attempt that begins.
    expect(await deliver(deps)).toEqual({ outcome: 'deferred', reason: 'lease_busy', waitMs: timings.leaseBusyRetryMs, attempts: 0, failedBefore: 0, begun: false });
    // On Temporal's third try of this activity: the two that failed before are reported, to be spent.
    expect(await deliver(parts({ waits: ['gave_up'] }).deps, { attempt: 3 })).toMatchObject({ outcome: 'deferred', failedBefore: 2 });
    expect(store.beginAttempt).not.toHaveBeenCalled();
    expect(sent).toEqual([]);
    expect(lease.handOff).toHaveBeenCalledTimes(1);
  });

  it('a lease that lapsed before the attempt began (or is the customer of before a remap): handed on, back in the queue, then sent', async () => {
    const { deps, lease, store, sent } = parts({ leaseHeld: [false, true] });
    expect(await deliver(deps)).toMatchObject({ outcome: 'sent' });
    expect(lease.wait).toHaveBeenCalledTimes(2);
    // What the holder still had goes to the next waiter before it queues again, not left to lapse.
    expect(lease.handOff).toHaveBeenCalledTimes(1);
    expect(lease.handOff.mock.invocationCallOrder[0]).toBeLessThan(lease.wait.mock.invocationCallOrder[1]!);
    expect(store.markSentAndHandOff).toHaveBeenCalledTimes(1);
    expect(sent).toHaveLength(1);
  });

  it('a lease that lapsed before the attempt began, then still busy: deferred as not begun (the row was not touched)', async () => {
    const { deps } = parts({ leaseHeld: [false], waits: ['acquired', 'gave_up'] });
    expect(await deliver(deps)).toMatchObject({ outcome: 'deferred', reason: 'lease_busy', begun: false });
  });

  it('no slot in the account-wide pace soon enough: deferred as paced, the counted attempt undone', async () => {
    const { deps, store, sent } = parts({ granted: false });
    const result = await deliver(deps);
    expect(result).toMatchObject({ outcome: 'deferred', reason: 'paced', attempts: 0 });
    expect(store.undoAttempt).toHaveBeenCalledWith(KEY, { wasFirst: true });
    expect(sent).toEqual([]);
  });

  it('no answer from Stripe: the lease is held (handed to nobody), and the attempt fails retryable', async () => {
    const { deps, lease, store } = parts({ send: async () => Promise.reject(stripeError.connection()) });
    await expect(deliver(deps)).rejects.toMatchObject({ type: 'StripeRetryable', nonRetryable: false });
    expect(lease.hold).toHaveBeenCalledTimes(1);
    expect(lease.handOff).not.toHaveBeenCalled();
    expect(store.recordAttemptError).toHaveBeenCalledWith(KEY, 'connection_error', expect.any(String), { refused: false });
  });

  it('a connection refused (nothing sent): the lease is handed on at once, not held', async () => {
    const refused = new Stripe.errors.StripeConnectionError({ message: 'An error occurred with our connection to Stripe.', detail: Object.assign(new Error('connect ECONNREFUSED'), { code: 'ECONNREFUSED' }) } as never);
    const { deps, lease } = parts({ send: async () => Promise.reject(refused) });
    await expect(deliver(deps)).rejects.toMatchObject({ type: 'StripeRetryable' });
    expect(lease.hold).not.toHaveBeenCalled();
    expect(lease.handOff).toHaveBeenCalledTimes(1);
  });

  it("a 429 is deferred for Stripe's Retry-After plus at most the jitter, keeping the attempt count", async () => {
    const { deps } = parts({ send: async () => Promise.reject(stripeError.rateLimited('2')) });
    const result = await deliver(deps);
    expect(result).toMatchObject({ outcome: 'deferred', reason: 'rate_limited', attempts: 1 });
    const waitMs = (result as { waitMs: number }).waitMs;
    expect(waitMs).toBeGreaterThanOrEqual(2_000);
    expect(waitMs).toBeLessThan(2_000 + timings.rateLimitJitterMs);
  });

  it('a 429 without Retry-After waits rateLimitedWaitMs (plus jitter)', async () => {
    const { deps } = parts({ send: async () => Promise.reject(stripeError.rateLimited()) });
    const { waitMs } = (await deliver(deps)) as { waitMs: number };
    expect(waitMs).toBeGreaterThanOrEqual(timings.rateLimitedWaitMs);
    expect(waitMs).toBeLessThan(timings.rateLimitedWaitMs + timings.rateLimitJitterMs);
  });

  it("Stripe's duplicate-identifier answer is delivered: marked sent, outcome duplicate", async () => {
    const { deps, store } = parts({ send: async () => Promise.reject(stripeError.duplicate()) });
    expect(await deliver(deps)).toEqual({ outcome: 'duplicate', attempts: 1 });
    expect(store.markSentAndHandOff).toHaveBeenCalledTimes(1);
  });

  it("Stripe's refusal for good is a non-retryable StripeRejected, recorded on the row", async () => {
    const { deps, store } = parts({ send: async () => Promise.reject(stripeError.rejected()) });
    const err = await deliver(deps).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(ApplicationFailure);
    expect(err).toMatchObject({ type: 'StripeRejected', nonRetryable: true, details: ['resource_missing'] });
    // Nothing of it is at Stripe: the customer it named is forgotten (a retry after a remap names the new one).
    expect(store.recordAttemptError).toHaveBeenCalledWith(KEY, 'resource_missing', 'No such customer', { refused: true });
  });

  it('an event already at Stripe is not sent again', async () => {
    const { deps, sent } = parts({ row: row({ status: 'sent', attempt_count: 2 }) });
    expect(await deliver(deps)).toEqual({ outcome: 'already_sent', attempts: 2, status: 'sent' });
    expect(sent).toEqual([]);
    // Rejected by Stripe's error report (or cancelled) meanwhile: said, for the run to end as that.
    const rejected = parts({ row: row({ status: 'rejected_async', attempt_count: 1 }) });
    expect(await deliver(rejected.deps)).toEqual({ outcome: 'already_sent', attempts: 1, status: 'rejected_async' });
    expect(rejected.sent).toEqual([]);
  });

  it('a refusal of the check before sending is recorded and thrown, nothing sent', async () => {
    const { deps, store, sent } = parts({ row: row({ stripe_customer_id: null }) });
    await expect(deliver(deps)).rejects.toMatchObject({ type: 'OutboxRowMissing', nonRetryable: true, details: ['customer_mapping_missing'] });
    expect(store.recordAttemptError).toHaveBeenCalledWith(KEY, 'customer_mapping_missing', expect.any(String));
    expect(sent).toEqual([]);
    // No call was made: the attempt is taken back, and with it the start of the 23 h window.
    expect(store.undoAttempt).toHaveBeenCalledWith(KEY, { wasFirst: true });
  });

  it('usage stamped ahead of Stripe\'s window by clock skew: deferred until it is in, the attempt taken back, nothing sent', async () => {
    const { deps, store, sent } = parts({ row: row({ occurred_at: new Date(Date.now() + 6 * 60_000) }) });
    const result = await deliver(deps);
    expect(result).toMatchObject({ outcome: 'deferred', reason: 'stamped_ahead' });
    const waitMs = (result as { waitMs: number }).waitMs;
    // Until it is 5 minutes ahead less SEND_MARGIN_MS (a minute), plus a second.
    expect(waitMs).toBeGreaterThan(120_000);
    expect(waitMs).toBeLessThanOrEqual(121_000 + 1_000);
    expect(store.undoAttempt).toHaveBeenCalledWith(KEY, { wasFirst: true });
    expect(sent).toEqual([]);
  });

  it("v2, Stripe's clock measured 10 minutes behind ours: usage stamped now is ahead by Stripe's, deferred until it is in, not sent for the stream to drop", async () => {
    const { deps, sent } = parts({ api: 'v2', clockSkewMs: -10 * 60_000, row: row({ occurred_at: new Date(Date.now()) }) });
    const result = await deliver(deps);
    expect(result).toMatchObject({ outcome: 'deferred', reason: 'stamped_ahead' });
    // Until Stripe's clock is 4 minutes short of it (5 less SEND_MARGIN_MS), plus a second: 6 minutes.
    expect((result as { waitMs: number }).waitMs).toBeGreaterThan(6 * 60_000);
    expect((result as { waitMs: number }).waitMs).toBeLessThanOrEqual(6 * 60_000 + 2_000);
    expect(sent).toEqual([]);
    // The same with tracing on: the traced sender reads the stream's measure through.
    const traced = parts({ api: 'v2', clockSkewMs: -10 * 60_000, row: row({ occurred_at: new Date(Date.now()) }) });
    traced.deps.sender = tracedSender(traced.deps.sender, () => KEY);
    expect(await deliver(traced.deps)).toMatchObject({ outcome: 'deferred', reason: 'stamped_ahead' });
    expect(traced.sent).toEqual([]);
    // Stripe's clock ahead of ours: a usage 34 days 23 hours 30 minutes old by ours is too old by Stripe's.
    const old = parts({ api: 'v2', clockSkewMs: 40 * 60_000, row: row({ occurred_at: new Date(Date.now() - (35 * 86_400_000 - 30 * 60_000)) }) });
    await expect(deliver(old.deps)).rejects.toMatchObject({ type: 'UnsafeToSend', details: ['timestamp_too_far_in_past'] });
    expect(old.sent).toEqual([]);
  });

  it('a meter being replaced (deactivated a moment ago, none active yet): the delivery waits for it, the attempt taken back, nothing sent; past the swap window, no_meter', async () => {
    const { deps, store, sent } = parts();
    deps.meters = { keysFor: async () => undefined, swapLeftMs: () => 10 * 60_000 };
    const result = await deliver(deps);
    expect(result).toMatchObject({ outcome: 'deferred', reason: 'meter_replacing' });
    expect((result as { waitMs: number }).waitMs).toBeLessThanOrEqual(16_000);
    expect(store.undoAttempt).toHaveBeenCalledWith(KEY, { wasFirst: true });
    expect(store.recordAttemptError).toHaveBeenCalledWith(KEY, 'meter_replacing', expect.stringContaining('waiting for its replacement'));
    expect(sent).toEqual([]);
    deps.meters = { keysFor: async () => undefined, swapLeftMs: () => 0 };
    await expect(deliver(deps)).rejects.toMatchObject({ type: 'StripeRejected', details: ['no_meter'] });
  });

  it("Stripe's no_meter for a meter this worker's list still had: read again; waited for while being replaced, sent to a new one soon, dead only when the list still names the same meter", async () => {
    const noMeter = () => new Stripe.errors.StripeInvalidRequestError({ type: 'invalid_request_error', statusCode: 400, code: 'no_meter', message: "No active meter was found for event name 'api_requests'." } as never);
    const run = async (after: { lastRead?: typeof KEYS; swapLeftMs?: number; refresh?: () => Promise<void> }) => {
      const p = parts({ send: async () => Promise.reject(noMeter()) });
      p.deps.meters = { keysFor: async () => KEYS, refresh: after.refresh ?? (async () => undefined), lastRead: () => after.lastRead, swapLeftMs: () => after.swapLeftMs ?? 0 };
      return { p, result: deliver(p.deps) };
    };
    const swapping = await run({ swapLeftMs: 10 * 60_000 });
    expect(await swapping.result).toMatchObject({ outcome: 'deferred', reason: 'meter_replacing' });
    expect(swapping.p.store.undoAttempt).toHaveBeenCalled();
    const replaced = await run({ lastRead: { ...KEYS, meterId: 'mtr_2' } });
    const soon = (await replaced.result) as { reason: string; waitMs: number };
    expect(soon.reason).toBe('meter_replacing');
    expect(soon.waitMs).toBeLessThanOrEqual(2_000);
    await expect((await run({ lastRead: KEYS })).result).rejects.toMatchObject({ type: 'StripeRejected', details: ['no_meter'] });
    await expect((await run({})).result).rejects.toMatchObject({ type: 'StripeRejected', details: ['no_meter'] });
    // The list not readable now: another attempt will tell (this one counted), not dead.
    const unread = await run({ refresh: async () => Promise.reject(new Error('list unavailable')) });
    await expect(unread.result).rejects.toMatchObject({ type: 'StripeRetryable', nonRetryable: false, details: ['no_meter'] });
    expect(unread.p.store.undoAttempt).not.toHaveBeenCalled();
  });

  it('a meter Stripe does not have: StripeRejected no_meter, nothing sent', async () => {
    const { deps, sent } = parts();
    deps.meters = { keysFor: async () => undefined };
    await expect(deliver(deps)).rejects.toMatchObject({ type: 'StripeRejected', details: ['no_meter'] });
    expect(sent).toEqual([]);
    expect(deps.store.undoAttempt).toHaveBeenCalledWith(KEY, { wasFirst: true });
  });

  it("the meter list unreadable (Stripe's 500, a refused key): no meter event sent, so the attempt is taken back once, and the failure classified as a call's", async () => {
    const failing = (err: Error) => {
      const p = parts();
      p.deps.meters = { keysFor: async () => Promise.reject(err) };
      return p;
    };
    const down = failing(new Stripe.errors.StripeAPIError({ type: 'api_error', statusCode: 500, message: 'boom' } as never));
    await expect(deliver(down.deps)).rejects.toMatchObject({ type: 'StripeRetryable' });
    expect(down.sent).toEqual([]);
    expect(down.store.undoAttempt).toHaveBeenCalledTimes(1);
    expect(down.store.undoAttempt).toHaveBeenCalledWith(KEY, { wasFirst: true });
    const refusedKey = failing(new Stripe.errors.StripeAuthenticationError({ type: 'invalid_request_error', statusCode: 401, message: 'Invalid API Key provided' } as never));
    expect(await deliver(refusedKey.deps)).toMatchObject({ outcome: 'deferred', reason: 'stripe_credentials' });
    expect(refusedKey.store.undoAttempt).toHaveBeenCalledTimes(1);
    // A 400 for the list refuses the attempt for good, but no meter event was sent: the customer an
    // earlier call named (Stripe may hold the event there) is kept.
    const refusedList = failing(new Stripe.errors.StripeInvalidRequestError({ type: 'invalid_request_error', statusCode: 400, message: 'bad list' } as never));
    await expect(deliver(refusedList.deps)).rejects.toMatchObject({ type: 'StripeRejected' });
    expect(refusedList.store.recordAttemptError).toHaveBeenCalledWith(KEY, 'http_400', 'bad list', { refused: false });
  });

  it('PostgreSQL away: deferred as database_unavailable, no attempt spent', async () => {
    const { deps, store } = parts();
    store.beginAttempt.mockRejectedValueOnce(Object.assign(new Error('connect ECONNREFUSED'), { code: 'ECONNREFUSED' }));
    const result = await deliver(deps);
    expect(result).toMatchObject({ outcome: 'deferred', reason: 'database_unavailable', attempts: 0 });
    expect((result as { waitMs: number }).waitMs).toBeGreaterThanOrEqual(timings.databaseRetryMs);
    // Its beginAttempt was sent (and may have committed before the answer was lost): begun.
    expect(result).not.toHaveProperty('begun');
  });

  it('PostgreSQL away before the attempt began (the lease could not be waited for): deferred as not begun', async () => {
    const { deps, lease, store } = parts();
    lease.wait.mockRejectedValueOnce(Object.assign(new Error('connect ECONNREFUSED'), { code: 'ECONNREFUSED' }));
    expect(await deliver(deps)).toMatchObject({ outcome: 'deferred', reason: 'database_unavailable', begun: false });
    expect(store.beginAttempt).not.toHaveBeenCalled();
  });
});

describe('v2: the meter event stream', () => {
  it('no lease and no per-event pace; the row becomes accepted, and the outcome says so', async () => {
    const { deps, store, lease, pacer, sent } = parts({ api: 'v2' });
    expect(await deliver(deps)).toEqual({ outcome: 'accepted', attempts: 1 });
    expect(store.markDelivered).toHaveBeenCalledWith(KEY, 'accepted', 0);
    expect(sent.map((e) => e.identifier)).toEqual([KEY]);
    expect(lease.wait).not.toHaveBeenCalled();
    expect(pacer.take).not.toHaveBeenCalled();
    expect(store.beginAttempt).toHaveBeenCalledWith(KEY, expect.not.objectContaining({ lease: expect.anything() }));
  });

  it("its batch's pace statement failing on our PostgreSQL (too many connections): deferred as database_unavailable, no attempt spent, nothing recorded as the event's error", async () => {

    const { deps, store } = parts({ api: 'v2', send: async () => Promise.reject(Object.assign(new Error('sorry, too many clients already'), { code: '53300' })) });
    expect(await deliver(deps)).toMatchObject({ outcome: 'deferred', reason: 'database_unavailable' });
    expect(store.recordAttemptError).not.toHaveBeenCalled();
  });

  it('no session for the stream (the session request refused: the stream not enabled, a base URL without it): nothing sent, the attempt taken back, retried with the reason on the row', async () => {
    const refused = new Stripe.errors.StripeInvalidRequestError({ type: 'invalid_request_error', statusCode: 400, message: 'Meter event streams are not enabled for this account.' } as never);
    const { deps, store } = parts({ api: 'v2', send: async () => Promise.reject(new StreamSessionError(refused)) });
    await expect(deliver(deps)).rejects.toMatchObject({ type: 'StripeRetryable', nonRetryable: false, details: ['stream_session_failed'] });
    expect(store.undoAttempt).toHaveBeenCalledWith(KEY, { wasFirst: true });
    expect(store.recordAttemptError).toHaveBeenCalledWith(KEY, 'stream_session_failed', expect.stringContaining('not enabled for this account'), { refused: false });
  });

  it("Stripe's clock not measurable before the first event (no session to be had): the time is not judged on ours, nothing sent, the attempt taken back with the reason, no second session asked for", async () => {
    // 69 minutes ahead of this worker's clock: judged on it, the event would be dead as timestamp_in_future.
    const { deps, store, sent } = parts({ api: 'v2', row: row({ occurred_at: new Date(Date.now() + 69 * 60_000) }) });
    const refused = new Stripe.errors.StripeAPIError({ type: 'api_error', statusCode: 503, message: 'session service unavailable' } as never);
    const measure = vi.fn(async (): Promise<number> => Promise.reject(new StreamSessionError(refused)));
    deps.sender = { ...deps.sender, clockSkewMs: measure };
    await expect(deliver(deps)).rejects.toMatchObject({ type: 'StripeRetryable', nonRetryable: false, details: ['http_503'] });
    expect(measure).toHaveBeenCalledTimes(1);
    expect(sent).toEqual([]);
    expect(store.undoAttempt).toHaveBeenCalledWith(KEY, { wasFirst: true });
    expect(store.recordAttemptError).toHaveBeenCalledWith(KEY, 'http_503', expect.stringContaining('session service unavailable'), { refused: false });
    // A row already at Stripe is decided without the time: not held back by a session it does not need.
    const atStripe = parts({ api: 'v2', row: row({ status: 'accepted' }) });
    const unneeded = vi.fn(async (): Promise<number> => Promise.reject(new StreamSessionError(refused)));
    atStripe.deps.sender = { ...atStripe.deps.sender, clockSkewMs: unneeded };
    expect(await deliver(atStripe.deps)).toMatchObject({ outcome: 'already_sent' });
    expect(unneeded).not.toHaveBeenCalled();
  });

  it("Stripe's duplicate answer on the stream marks the row accepted", async () => {
    const { deps, store } = parts({ api: 'v2', send: async () => Promise.reject(stripeError.duplicate()) });
    expect(await deliver(deps)).toEqual({ outcome: 'duplicate', attempts: 1 });
    expect(store.markDelivered).toHaveBeenCalledWith(KEY, 'accepted', 0);
  });
});

describe('an attempt answered after its time ran out', () => {
  const run = async (sendMs: number, startToCloseTimeoutMs: number, api: 'v1' | 'v2' = 'v2') => {
    const p = parts({ api, send: () => new Promise((r) => setTimeout(r, sendMs)) });
    const told: string[] = [];
    p.deps.tellRunDeliveredLate = async (key) => void told.push(key);
    const result = await deliver(p.deps, {}, new MockActivityEnvironment({ attempt: 1, isLocal: false, startToCloseTimeoutMs }, { logger: silent }));
    return { result, told };
  };

  it('tells its run the event was delivered (the run may have made the row dead meanwhile)', async () => {
    for (const api of ['v1', 'v2'] as const) {
      const { result, told } = await run(1_200, 2_000, api);
      expect((result as { outcome: string }).outcome).toBe(api === 'v1' ? 'sent' : 'accepted');
      expect(told).toEqual([KEY]);
    }
  });

  it('tells its run when the attempt was given up by Temporal before its time ran out (a heartbeat answered: gone), and it delivered after all', async () => {
    const env = new MockActivityEnvironment({ attempt: 1, isLocal: false, startToCloseTimeoutMs: 60_000 }, { logger: silent });
    const p = parts({
      api: 'v2',
      send: async () => {
        env.cancel('TIMED_OUT');
        await new Promise((r) => setTimeout(r, 10));
      },
    });
    const told: string[] = [];
    p.deps.tellRunDeliveredLate = async (key) => void told.push(key);
    const result = await deliver(p.deps, {}, env);
    expect((result as { outcome: string }).outcome).toBe('accepted');
    expect(told).toEqual([KEY]);
  });

  it('tells nobody when the attempt ended in time', async () => {
    const { told } = await run(0, 10_000);
    expect(told).toEqual([]);
  });

  it('delivered all the same when its run cannot be told (Temporal away): logged, the outcome stands', async () => {
    const p = parts({ api: 'v2', send: () => new Promise((r) => setTimeout(r, 1_200)) });
    p.deps.tellRunDeliveredLate = async () => {
      throw new Error('14 UNAVAILABLE');
    };
    const result = await deliver(p.deps, {}, new MockActivityEnvironment({ attempt: 1, isLocal: false, startToCloseTimeoutMs: 2_000 }, { logger: silent }));
    expect((result as { outcome: string }).outcome).toBe('accepted');
  });
});

describe('heartbeats', () => {
  it.each(['v1', 'v2'] as const)('a regular %s attempt heartbeats for as long as its call takes (a slow Stripe is not a dead worker); one in the workflow task never does', async (api) => {
    vi.useFakeTimers({ toFake: ['setInterval', 'clearInterval', 'setTimeout', 'clearTimeout'] });
    try {
      for (const isLocal of [false, true]) {
        let answer!: () => void;
        const slow = parts({ api, send: () => new Promise<void>((resolve) => (answer = resolve)) });
        const env = new MockActivityEnvironment({ attempt: 2, isLocal }, { logger: silent });
        const beats: unknown[] = [];
        env.on('heartbeat', (d: unknown) => beats.push(d));
        const done = deliver(slow.deps, {}, env);
        await vi.waitFor(() => expect(slow.sent).toHaveLength(1));
        // Stripe takes three heartbeat timeouts to answer.
        await vi.advanceTimersByTimeAsync(3 * timings.heartbeatTimeoutMs);
        answer();
        await expect(done).resolves.toMatchObject({ outcome: api === 'v1' ? 'sent' : 'accepted' });
        if (isLocal) expect(beats).toEqual([]);
        else expect(beats.length).toBeGreaterThanOrEqual((3 * timings.heartbeatTimeoutMs) / timings.heartbeatEveryMs - 1);
        // And none after the attempt.
        const after = beats.length;
        await vi.advanceTimersByTimeAsync(3 * timings.heartbeatEveryMs);
        expect(beats).toHaveLength(after);
      }
    } finally {
      vi.useRealTimers();
    }
  });
});

describe('the first attempt, run in the workflow task (a local activity)', () => {
  it('waits for a busy lease a moment only and never heartbeats; the regular activity waits the full time', async () => {
    vi.useFakeTimers({ toFake: ['setInterval', 'clearInterval'] });
    try {
      const inTask = parts({ waits: ['gave_up'] });
      const env = new MockActivityEnvironment({ attempt: 1, isLocal: true }, { logger: silent });
      const beats: unknown[] = [];
      env.on('heartbeat', (d: unknown) => beats.push(d));
      const waitCtx = inTask.lease.wait.mock.calls as unknown as [string, string, { heartbeat(): void }, number][];
      await expect(deliver(inTask.deps, {}, env)).resolves.toMatchObject({ outcome: 'deferred', reason: 'lease_busy' });
      expect(waitCtx[0]![3]).toBe(timings.inTaskLeaseWaitMs);
      // What the lease is lent to heartbeat with does nothing in the task, and no timer beats either.
      waitCtx[0]![2].heartbeat();
      vi.advanceTimersByTime(10 * timings.heartbeatEveryMs);
      expect(beats).toEqual([]);

      const regular = parts({ waits: ['gave_up'] });
      await deliver(regular.deps, { isLocal: false });
      expect((regular.lease.wait.mock.calls as unknown as unknown[][])[0]![3]).toBe(timings.leaseWaitMs);
      expect(timings.inTaskLeaseWaitMs).toBeLessThan(timings.leaseWaitMs);
    } finally {
      vi.useRealTimers();
    }
  });
});

describe('Stripe down for every customer (src/stripe/outage.ts)', () => {
  const unavailable = () => new Stripe.errors.StripeAPIError({ type: 'api_error', statusCode: 503, message: 'service unavailable' } as never);
  const failing = (err: () => Error) => async () => Promise.reject(err());
  /**
   * Its clock stands still (afterMs 0: as after 15 s of failures). `cus_x` and each of `once` have
   * failed once: a failure that makes three customers takes Stripe for down.
   */
  const watch = (...once: string[]) => {
    const t0 = Date.now();
    const w = outageWatch({ afterMs: 0, quietMs: 3_600_000, now: () => t0 });
    for (const customer of ['cus_x', ...once]) w.failed(customer);
    return w;
  };

  it.each(['v1', 'v2'] as const)(
    '%s: a 5xx once another customer failed so too is waited out: deferred as stripe_down, the call counted on the row, the attempts before it reported, the reason on the row',
    async (api) => {
      const outage = watch();
      // cus_a's failure: two customers so far.
      const first = parts({ api, send: failing(unavailable) });
      await expect(deliver({ ...first.deps, outage })).rejects.toMatchObject({ type: 'StripeRetryable', details: ['http_503'] });
      const second = parts({ api, row: row({ stripe_customer_id: 'cus_b' }), send: failing(unavailable) });
      const result = await deliver({ ...second.deps, outage }, { attempt: 3 });
      expect(result).toMatchObject({ outcome: 'deferred', reason: 'stripe_down', attempts: 1, failedBefore: 2 });
      const { waitMs } = result as { waitMs: number };
      expect(waitMs).toBeGreaterThanOrEqual(timings.outageRetryMinMs);
      expect(waitMs).toBeLessThanOrEqual(timings.outageRetryMinMs * 1.25);
      expect(second.store.undoAttempt).not.toHaveBeenCalled();
      expect(second.store.recordAttemptError).toHaveBeenCalledWith(KEY, 'http_503', expect.stringMatching(/^service unavailable \(Stripe down since .+: waiting, no attempt spent\)$/), { refused: false });
    },
  );

  it('no answer at all (a connection error) counts as down too; a 409 does not, and is an answer', async () => {
    expect(await deliver({ ...parts({ send: failing(stripeError.connection) }).deps, outage: watch('cus_b') })).toMatchObject({ reason: 'stripe_down' });
    const outage = watch('cus_b');
    const conflict = () => new Stripe.errors.StripeIdempotencyError({ type: 'idempotency_error', statusCode: 409, message: 'conflict' } as never);
    await expect(deliver({ ...parts({ row: row({ stripe_customer_id: 'cus_b' }), send: failing(conflict) }).deps, outage })).rejects.toMatchObject({ type: 'StripeRetryable' });
    // The 409 was an answer: judged afresh, cus_a is the one customer failing.
    await expect(deliver({ ...parts({ send: failing(stripeError.connection) }).deps, outage })).rejects.toMatchObject({ type: 'StripeRetryable' });
  });

  it("one customer's failures spend its attempts, however many", async () => {
    const t0 = Date.now();
    const outage = outageWatch({ afterMs: 0, quietMs: 3_600_000, now: () => t0 });
    for (let i = 0; i < 3; i++) {
      await expect(deliver({ ...parts({ send: failing(unavailable) }).deps, outage })).rejects.toMatchObject({ type: 'StripeRetryable' });
    }
  });

  it('an event first attempted longer than RETRY_MAX_OUTAGE_MS ago spends its attempts again', async () => {
    const outage = watch('cus_a');
    const old = parts({ row: row({ stripe_customer_id: 'cus_b', first_attempted_at: new Date(Date.now() - timings.maxOutageMs - 60_000) }), send: failing(unavailable) });
    await expect(deliver({ ...old.deps, outage })).rejects.toMatchObject({ type: 'StripeRetryable' });
    expect(old.store.recordAttemptError).toHaveBeenCalledWith(KEY, 'http_503', 'service unavailable', { refused: false });
    // Nor one put in flight that long ago whose tries made no meter-event call (the meter list
    // refused by the outage): each is taken back, leaving no first attempt to count from.
    const listFails = parts({ row: row({ stripe_customer_id: 'cus_d', dispatched_at: new Date(Date.now() - timings.maxOutageMs - 60_000) }) });
    await expect(deliver({ ...listFails.deps, meters: { keysFor: async () => Promise.reject(unavailable()) }, outage })).rejects.toMatchObject({ type: 'StripeRetryable' });
    expect(listFails.store.undoAttempt).toHaveBeenCalled();
    // RETRY_MAX_OUTAGE_MS=0: never waited out.
    const off = parts({ row: row({ stripe_customer_id: 'cus_c' }), send: failing(unavailable) });
    await expect(deliver({ ...off.deps, config: { timings: { ...timings, maxOutageMs: 0 } }, outage })).rejects.toMatchObject({ type: 'StripeRetryable' });
    // The same failure of an event inside it is waited out (Stripe was down for each above).
    expect(await deliver({ ...parts({ send: failing(unavailable) }).deps, outage: watch('cus_b') })).toMatchObject({ reason: 'stripe_down' });
  });

  it.each(['v1', 'v2'] as const)(
    "%s: a held delivery back on a worker that has not judged Stripe down waits again on the judgement that held it, unless Stripe has answered that worker since, or an hour has passed since a worker judged so",
    async (api) => {
      const hold = { since: Date.now() - 120_000, judgedAt: Date.now() - 60_000 };
      const fresh = () => outageWatch({ afterMs: 15_000, quietMs: 3_600_000 });
      const held = parts({ api, send: failing(unavailable) });
      expect(await deliver({ ...held.deps, outage: fresh() }, { heldByOutage: hold })).toMatchObject({ reason: 'stripe_down', outageHold: hold });
      expect(held.store.recordAttemptError).toHaveBeenCalledWith(KEY, 'http_503', expect.stringContaining(`(Stripe down since ${new Date(hold.since).toISOString()}: waiting`), { refused: false });
      // The meter list failing before the call (Stripe's whole API down): held too.
      const listFails = parts({ api });
      expect(await deliver({ ...listFails.deps, meters: { keysFor: async () => Promise.reject(unavailable()) }, outage: fresh() }, { heldByOutage: hold })).toMatchObject({ reason: 'stripe_down' });
      // Not held before: its failure is this worker's to judge, and spends an attempt.
      await expect(deliver({ ...parts({ api, send: failing(unavailable) }).deps, outage: fresh() })).rejects.toMatchObject({ type: 'StripeRetryable' });
      // Stripe answered this worker since a worker last judged it down: its failure is its own.
      const answered = fresh();
      answered.answered();
      await expect(deliver({ ...parts({ api, send: failing(unavailable) }).deps, outage: answered }, { heldByOutage: hold })).rejects.toMatchObject({ type: 'StripeRetryable' });
      // Nor past outageQuietMs after that judgement (a poison event held through an outage, Stripe back).
      const stale = { since: hold.since, judgedAt: Date.now() - timings.outageQuietMs - 1_000 };
      await expect(deliver({ ...parts({ api, send: failing(unavailable) }).deps, outage: fresh() }, { heldByOutage: stale })).rejects.toMatchObject({ type: 'StripeRetryable' });
      // A refusal is an answer, held or not.
      await expect(deliver({ ...parts({ api, send: failing(stripeError.rejected) }).deps, outage: fresh() }, { heldByOutage: hold })).rejects.toMatchObject({ type: 'StripeRejected' });
    },
  );

  it('a success ends it', async () => {
    const outage = watch('cus_c');
    expect(await deliver({ ...parts({ row: row({ stripe_customer_id: 'cus_b' }) }).deps, outage })).toMatchObject({ outcome: 'sent' });
    await expect(deliver({ ...parts({ row: row({ stripe_customer_id: 'cus_d' }), send: failing(unavailable) }).deps, outage })).rejects.toMatchObject({ type: 'StripeRetryable' });
  });
});
