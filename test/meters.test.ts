/** The meter catalog against the local Stripe-compatible server, through the real `stripe` client. */
import Stripe from 'stripe';
import { afterAll, beforeAll, expect, it, vi } from 'vitest';
import { createStripeClient } from '../src/stripe/client.js';
import { LocalStripe } from '../src/embedded/stripe/server.js';
import { MeterCatalog } from '../src/stripe/meters.js';
import { testConfig } from './helpers.js';

let local: LocalStripe;
let stripe: Stripe;
let listCalls = 0;
let listFails = false;
/** The real client, counting its meter-list calls. */
let counted: Pick<Stripe, 'billing'>;

beforeAll(async () => {
  local = await LocalStripe.start({ meters: ['api_requests'] });
  stripe = createStripeClient(testConfig({ STRIPE_API_BASE: local.url, STRIPE_API_KEY: 'sk_test_meters' }).stripe);
  const list: Stripe['billing']['meters']['list'] = (...args: Parameters<Stripe['billing']['meters']['list']>) => {
    listCalls++;
    // Stripe away: the list's first page is not answered.
    if (listFails) {
      const unanswered = () => Promise.reject(new Stripe.errors.StripeConnectionError({ message: 'socket hang up' } as never));
      return { [Symbol.asyncIterator]: () => ({ next: unanswered }) } as never;
    }
    return stripe.billing.meters.list(...args);
  };
  counted = { billing: { ...stripe.billing, meters: Object.assign(Object.create(stripe.billing.meters) as object, { list }) } } as Pick<Stripe, 'billing'>;
});
afterAll(() => local?.close());

it("reads each meter's payload keys, defaults and custom ones", async () => {
  local.addMeter('gpu_seconds', { customerKey: 'account', valueKey: 'seconds' });
  const catalog = new MeterCatalog(counted, { minReloadIntervalMs: 50 });
  expect(await catalog.keysFor('api_requests')).toMatchObject({ customerKey: 'stripe_customer_id', valueKey: 'value' });
  expect(await catalog.keysFor('gpu_seconds')).toMatchObject({ customerKey: 'account', valueKey: 'seconds' });
});

it('finds a meter created after the cache was filled: "no meter" always comes from a read made after the question', async () => {
  const catalog = new MeterCatalog(counted, { minReloadIntervalMs: 200 });
  expect(await catalog.keysFor('api_requests')).toMatchObject({ customerKey: 'stripe_customer_id', valueKey: 'value' });
  // The cache is filled now, without the meter created next.
  expect(await catalog.keysFor('created_later')).toBeUndefined();
  local.addMeter('created_later');
  expect(await catalog.keysFor('created_later')).toMatchObject({ customerKey: 'stripe_customer_id' });
});

it('answers a burst of misses for a meter that does not exist with a read or two, not one per event', async () => {
  const catalog = new MeterCatalog(counted, { minReloadIntervalMs: 1_000 });
  const before = listCalls;
  // Asked over a few milliseconds: the first read answers those asked before it started, the next
  // (a second later at the earliest) all the others.
  const answers = await Promise.all(Array.from({ length: 50 }, () => catalog.keysFor('does_not_exist')));
  expect(answers.every((a) => a === undefined)).toBe(true);
  expect(listCalls - before).toBeGreaterThanOrEqual(1);
  expect(listCalls - before).toBeLessThanOrEqual(2);
});

it('asks Stripe again after a minute: a meter replaced by one with other payload keys is followed', async () => {
  let now = 1_000_000;
  const catalog = new MeterCatalog(counted, { minReloadIntervalMs: 0, now: () => now });
  local.addMeter('replaced_later');
  expect(await catalog.keysFor('replaced_later')).toMatchObject({ customerKey: 'stripe_customer_id', valueKey: 'value' });
  local.replaceMeter('replaced_later', { customerKey: 'account', valueKey: 'units' });
  const before = listCalls;
  // Within the minute: the cache answers, no call.
  now += 59_000;
  expect(await catalog.keysFor('replaced_later')).toMatchObject({ customerKey: 'stripe_customer_id' });
  expect(listCalls).toBe(before);
  // Past it: read again, and the new meter's keys are used.
  now += 2_000;
  expect(await catalog.keysFor('replaced_later')).toMatchObject({ customerKey: 'account', valueKey: 'units' });
  expect(listCalls).toBe(before + 1);
});

it("ages its cache on a monotonic clock: the wall clock stepped back an hour does not keep a replaced meter's keys for that hour", async () => {
  // Both clocks the test's own (the calls to Stripe still real).
  vi.useFakeTimers({ toFake: ['Date', 'performance'] });
  try {
    const catalog = new MeterCatalog(counted, { minReloadIntervalMs: 0 });
    local.addMeter('stepped_back');
    expect(await catalog.keysFor('stepped_back')).toMatchObject({ customerKey: 'stripe_customer_id', valueKey: 'value' });
    local.replaceMeter('stepped_back', { customerKey: 'account', valueKey: 'units' });
    // NTP steps the wall clock back an hour, then a minute and a bit passes.
    vi.setSystemTime(Date.now() - 3_600_000);
    vi.advanceTimersByTime(61_000);
    const before = listCalls;
    expect(await catalog.keysFor('stepped_back')).toMatchObject({ customerKey: 'account', valueKey: 'units' });
    expect(listCalls).toBe(before + 1);
  } finally {
    vi.useRealTimers();
  }
});

it("answers the ingestion door without waiting for Stripe: a known meter from a read however old (one started behind it), a name not read yet let in for a few seconds after a failed read", async () => {
  let now = 2_000_000;
  const catalog = new MeterCatalog(counted, { minReloadIntervalMs: 0, now: () => now });
  expect(catalog.known('api_requests', 1_000)).toBe('ask');
  expect(await catalog.keysFor('api_requests')).toBeDefined();
  expect(catalog.known('api_requests', 1_000)).toBe('active');
  // Not read within the second: a miss said without asking.
  expect(catalog.known('never_made', 1_000)).toBe('missing');
  now += 61_000;
  const before = listCalls;
  listFails = true;
  try {
    // Past the minute, Stripe away: answered from the old read at once, a read started behind it (one for both asks).
    expect(catalog.known('api_requests', 1_000)).toBe('active');
    expect(catalog.known('api_requests', 1_000)).toBe('active');
    await vi.waitFor(() => expect(catalog.known('never_made', 1_000)).toBe('unanswered'), { timeout: 5_000 });
    expect(listCalls).toBe(before + 1);
    // A failed read is taken as such for 5 s; then a name not read yet is asked about again.
    now += 5_000;
    expect(catalog.known('never_made', 1_000)).toBe('ask');
    expect(catalog.known('api_requests', 1_000)).toBe('active');
  } finally {
    listFails = false;
  }
});

it('a meter deactivated with none active since is being replaced for 15 minutes (its usage let in, its delivery waiting), then simply missing', async () => {
  let now = 3_000_000;
  const catalog = new MeterCatalog(counted, { minReloadIntervalMs: 0, now: () => now });
  const id = local.addMeter('swapped');
  expect(await catalog.keysFor('swapped')).toMatchObject({ meterId: id });
  // The operator's first step, through Stripe's API: the meter deactivated, its successor not yet made.
  await stripe.billing.meters.deactivate(id);
  now += 61_000;
  expect(await catalog.keysFor('swapped')).toBeUndefined();
  expect(catalog.swapLeftMs('swapped')).toBeGreaterThan(14 * 60_000);
  expect(catalog.known('swapped', 1_000)).toBe('replacing');
  // Never had a meter: not being replaced.
  expect(catalog.swapLeftMs('never_had_one')).toBe(0);
  // The successor made: its keys, nothing waiting any more.
  local.addMeter('swapped', { customerKey: 'account', valueKey: 'units' });
  now += 61_000;
  expect(await catalog.keysFor('swapped')).toMatchObject({ customerKey: 'account', valueKey: 'units' });
  expect(catalog.swapLeftMs('swapped')).toBe(0);

  // One deactivated 16 minutes ago (by this machine's clock) and never replaced: missing, as any other.
  local.deactivateMeter('swapped');
  vi.useFakeTimers({ toFake: ['Date'], now: Date.now() + 16 * 60_000 });
  try {
    now += 61_000;
    expect(await catalog.keysFor('swapped')).toBeUndefined();
    expect(catalog.swapLeftMs('swapped')).toBe(0);
    expect(catalog.known('swapped', 1_000)).toBe('missing');
  } finally {
    vi.useRealTimers();
  }

  // This machine's clock two hours behind Stripe's: still 15 minutes at most from when the catalog
  // first saw the deactivation, not started again by each read.
  const skewed = local.addMeter('swapped_skewed');
  const fresh = new MeterCatalog(counted, { minReloadIntervalMs: 0, now: () => now });
  expect(await fresh.keysFor('swapped_skewed')).toMatchObject({ meterId: skewed });
  local.deactivateMeter('swapped_skewed');
  vi.useFakeTimers({ toFake: ['Date'], now: Date.now() - 2 * 3_600_000 });
  try {
    now += 61_000;
    expect(await fresh.keysFor('swapped_skewed')).toBeUndefined();
    expect(fresh.swapLeftMs('swapped_skewed')).toBeLessThanOrEqual(15 * 60_000);
    expect(fresh.swapLeftMs('swapped_skewed')).toBeGreaterThan(14 * 60_000);
    now += 10 * 60_000;
    await fresh.keysFor('swapped_skewed');
    expect(fresh.swapLeftMs('swapped_skewed')).toBeLessThanOrEqual(5 * 60_000);
    now += 6 * 60_000;
    await fresh.keysFor('swapped_skewed');
    expect(fresh.swapLeftMs('swapped_skewed')).toBe(0);
  } finally {
    vi.useRealTimers();
  }
});
