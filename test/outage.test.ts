/**
 * Stripe down for everyone for longer than the retry policy lasts: deliveries wait it out without
 * spending attempts, saying why on the row, and once Stripe is back every event is billed once.
 * None is dead for it. A single customer whose calls fail is that customer's: its events spend
 * their attempts and go dead as before (src/stripe/outage.ts).
 */
import { Registry } from 'prom-client';
import { expect, it } from 'vitest';
import { createMetrics } from '../src/metrics.js';
import { statusCounts, useStripe, waitFor } from './hooks.js';

const t = useStripe({ customers: { acme: 'cus_acme', globex: 'cus_globex', initech: 'cus_initech' }, stripe: { meters: ['api_requests'] } });

/** Judged down after 200 ms of failures (15 s in production), tried again every 200–500 ms. */
function outageConfig(env: Record<string, string>) {
  const config = t.configWith({ RETRY_MAX_OUTAGE_MS: '600000', ...env });
  return { ...config, timings: { ...config.timings, outageAfterMs: 200, outageRetryMinMs: 200, outageRetryMaxMs: 500 } };
}

it.each(['v1', 'v2'])('%s: every call failing (503) well past the retry budget: nothing dead, each event waits with the reason on its row, then is billed once', async (api) => {
  const config = outageConfig({ STRIPE_METER_API: api });
  t.stripe.failNext(1_000_000, 503);
  const metrics = createMetrics(new Registry());
  const downFor = async () => Number(/^billing_outbox_stripe_down_seconds (\S+)$/m.exec(await metrics.registry.metrics())?.[1]);
  const pipeline = await t.startPipeline(config, { metrics });
  expect(await downFor()).toBe(0);
  // Three customers: judged down from their failures alone (two would each have to fail twice, a second apart).
  const keys = [...(await t.backlog('acme', 2)), ...(await t.backlog('globex', 2)), ...(await t.backlog('initech', 2))];

  // Calls for each event past its 4 attempts (each call counted on the row), none dead.
  for (const key of keys) {
    await waitFor(`${key} past its attempts, waiting`, async () => {
      const row = await t.row(key);
      return row?.status === 'dispatched' && row.attempt_count > config.retry.maximumAttempts + 1 && /Stripe down since .+: waiting, no attempt spent/.test(row.last_error_message ?? '');
    }, 60_000);
  }
  expect((await statusCounts(t.pool)).dead ?? 0).toBe(0);
  // The worker's metrics say it takes Stripe for down, and since when.
  await waitFor('the worker to say Stripe is down', async () => (await downFor()) > 0, 10_000, 50);
  t.stripe.heal();
  const billed = api === 'v1' ? 'sent' : 'accepted';
  for (const key of keys) await t.waitStatus(key, billed);
  for (const key of keys) expect(t.eventsFor(key), key).toHaveLength(1);
  expect(await downFor()).toBe(0);
  await pipeline.stop();
}, 120_000);

it("v1: one customer's calls failing (503), however long, spend its events' attempts: dead as before, with Stripe's error", async () => {
  const config = outageConfig({ STRIPE_METER_API: 'v1' });
  t.stripe.refuseCustomer('cus_acme', 503);
  const pipeline = await t.startPipeline(config);
  const keys = await t.backlog('acme', 2);
  for (const key of keys) {
    const row = await t.waitStatus(key, 'dead', 60_000);
    expect(row).toMatchObject({ attempt_count: config.retry.maximumAttempts, last_error_code: 'http_503' });
  }
  t.stripe.heal();
  await pipeline.stop();
}, 120_000);
