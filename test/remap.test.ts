/**
 * A tenant remapped to another Stripe customer (`billing-outbox customers set`) while its events
 * are in flight and waiting for the (customer, meter) lease: every event is billed once, those
 * first called after the remap to the new customer, and never under the old customer's lease with
 * the new one (which would make two calls for the new pair at once: Stripe refuses the second).
 * An event already called keeps its customer (Stripe may hold it there), unless Stripe refused it
 * for good.
 */
import { expect, it } from 'vitest';
import { mapTenant } from '../src/ops/customers.js';
import { DeadLetterRetrier } from '../src/ops/retry.js';
import { refusedForGood, runCliWithoutTemporal, usePipeline, waitFor } from './hooks.js';

const METER = 'api_requests';
const t = usePipeline({
  customers: { movers: 'cus_before', losers: 'cus_lost_before', fixers: 'cus_typo' },
  // Every call for cus_typo is refused (a 400): 'fixers' events die at once until remapped.
  stripe: { customers: ['cus_before', 'cus_after', 'cus_lost_before', 'cus_lost_after', 'cus_fixed'], meters: [METER], refuseCustomers: { cus_typo: refusedForGood('cus_typo') } },
  // An unanswered call holds its (customer, meter) lease for about the Stripe timeout: short here.
  env: { STRIPE_RATE_LIMIT_PER_SECOND: '1000', STRIPE_TIMEOUT_MS: '2500' },
});

it("remapped after an attempt whose answer was lost: the next one names the same customer (Stripe may hold it there), and the row says who was billed", async () => {
  // Stripe records the first call, and its answer is lost: the event is at Stripe under
  // cus_lost_before. The tenant is remapped while that call is under way (it takes a second).
  // (Two answers lost: stripe-node sends a call whose connection closed once more, itself.)
  t.stripe.setLatency(1_000);
  t.stripe.dropAfterRecord(2);
  const key = await t.enqueue('losers', 4);
  await waitFor('the first call to be under way', async () => t.stripe.callsInFlight() > 0 || undefined);
  await mapTenant(t.pool, t.schema, 'losers', 'cus_lost_after', 'test');
  t.stripe.setLatency(0);

  const sent = await t.waitStatus(key, 'sent', 30_000);
  // Billed once, to the customer of the first call; the resend named it too ("already exists").
  expect(t.eventsFor(key).map((e) => e.payload.stripe_customer_id)).toEqual(['cus_lost_before']);
  expect(new Set(t.stripe.requests().filter((r) => r.identifier === key).map((r) => r.customer))).toEqual(new Set(['cus_lost_before']));
  expect(sent.attempt_count).toBe(2);
  expect(sent.billed_customer_id).toBe('cus_lost_before');
}, 60_000);

it('remapped after Stripe refused an event for good (a 400 for its customer): the retry names the new customer', async () => {
  const key = await t.enqueue('fixers', 2);
  const dead = await t.waitStatus(key, 'dead', 30_000);
  expect(dead.last_error_code).toBe('resource_missing');
  await mapTenant(t.pool, t.schema, 'fixers', 'cus_fixed', 'test');
  const retried = await new DeadLetterRetrier({ db: t.pool, schema: t.schema, client: t.client, config: t.config, now: Date.now }).retryKey(key, { force: false, requestedBy: 'test' });
  expect(retried.outcome).toBe('signalled');
  await t.waitStatus(key, 'sent', 30_000);
  expect(t.eventsFor(key).map((e) => e.payload.stripe_customer_id)).toEqual(['cus_fixed']);
}, 60_000);

it('remapped mid-backlog: each event billed once, to the new customer from the remap on, one call at a time per pair', async () => {
  // Each call takes a while, so the lane's deliveries queue for the lease behind it, and the remap
  // below commits while the first call is still under way (600 ms: room for a busy CPU's delays).
  t.stripe.setLatency(600);
  // The whole hours the events fall in, from before the first was recorded (the test may cross an hour).
  const firstHour = Math.floor(Date.now() / 3_600_000) * 3_600_000;
  const keys = await t.backlog('movers', 8);
  await waitFor('the first call to be in flight', async () => t.stripe.callsInFlight() > 0 || undefined);
  // Remapped while one call holds cus_before's lease and the others wait for it.
  const calledBefore = new Set(t.stripe.requests().map((r) => r.identifier));
  await mapTenant(t.pool, t.schema, 'movers', 'cus_after', 'test');

  for (const key of keys) await t.waitStatus(key, 'sent', 60_000);
  // Billed once each: to cus_before only if its call was under way before the remap.
  for (const key of keys) {
    const events = t.eventsFor(key);
    expect(events, key).toHaveLength(1);
    expect(events[0]!.payload.stripe_customer_id, key).toBe(calledBefore.has(key) ? 'cus_before' : 'cus_after');
  }
  expect(keys.filter((k) => calledBefore.has(k)).length).toBeLessThan(keys.length);
  // One call at a time per (customer, meter), also across the remap. Without the check in
  // beginAttempt, a delivery handed cus_before's lease calls with cus_after beside the new pair's
  // own holder: two in flight (caught in 3 of 3 runs at 600 ms, 2 of 2 at 400 ms; at 1 s the
  // waiters had moved to the new pair's queue first and it went unseen: the latency stays short).
  expect(t.stripe.maxConcurrencySeen('cus_after', METER)).toBe(1);
  expect(t.stripe.maxConcurrencySeen('cus_before', METER)).toBe(1);
  expect(t.stripe.requests().filter((r) => r.status === 429)).toEqual([]);

  // Reconciled afterwards, each event is compared with the customer Stripe counted it under, not
  // the tenant's mapping of today: both customers match, and nothing is drift.
  const lastHour = Math.floor(Date.now() / 3_600_000) * 3_600_000;
  const run = await runCliWithoutTemporal(['reconcile', '--from', new Date(firstHour).toISOString(), '--to', new Date(lastHour + 3_600_000).toISOString(), '--tenant', 'movers', '--json'], t.config, t.db);
  const report = JSON.parse(run.out) as { match: boolean; groups: { stripeCustomerId: string; ours: number; stripe: number; tenantIds: string[] }[] };
  const billedTo = (customer: string) =>
    keys.map((k) => t.eventsFor(k)[0]!.payload).filter((p) => p.stripe_customer_id === customer).reduce((n, p) => n + Number(p.value), 0);
  expect(report.groups.map((g) => [g.stripeCustomerId, g.ours, g.stripe, g.tenantIds]).sort()).toEqual([
    ['cus_after', billedTo('cus_after'), billedTo('cus_after'), ['movers']],
    ['cus_before', billedTo('cus_before'), billedTo('cus_before'), ['movers']],
  ]);
  expect([run.code, report.match]).toEqual([0, true]);
}, 90_000);
