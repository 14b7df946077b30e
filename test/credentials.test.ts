/**
 * Stripe refusing the deployment's API key (an expired or rolled key: 401; a restricted key
 * without the permission: 403) is the deployment's problem, not the events': delivery holds, the
 * alarm is raised where operators look, and it goes on by itself once the key works again. No
 * event is dead-lettered for it, and none is billed twice.
 */
import { expect, it } from 'vitest';
import { outboxStatus } from '../src/ops/status.js';
import { CREDENTIALS_REFUSED } from '../src/stripe/errors.js';
import { Registry } from 'prom-client';
import { createMetrics } from '../src/metrics.js';
import { runCliWithoutTemporal, useStripe, waitFor } from './hooks.js';

const t = useStripe({ customers: { acme: 'cus_acme', globex: 'cus_globex' }, stripe: { meters: ['api_requests'] } });

it.each([401, 403])('a %i for every call holds delivery with an alarm, and it resumes by itself when the key works', async (status) => {
  // Short for the test: how soon a held delivery asks again (15 s in production).
  const config = { ...t.config, timings: { ...t.config.timings, credentialsRetryMs: 300 } };
  const before = t.stripe.requests().length;
  t.stripe.failNext(100_000, status);
  const metrics = createMetrics(new Registry(), { db: t.pool });
  // Stopped at the end: the next case's events must meet its own worker, counted in its own metrics.
  const pipeline = await t.startPipeline(config, { metrics });
  const keys = [...(await t.backlog('acme', 4)), ...(await t.backlog('globex', 4))];

  // Every event meets the refusal; none dies, each says why it waits, and status raises the alarm.
  // (Events of one customer meet it one lease at a time: on a loaded machine that took over 30 s once.)
  const report = await waitFor('every event held with the alarm', async () => {
    const r = await outboxStatus(t.pool, t.schema);
    return r.inFlightByLastError.find((e) => e.code === CREDENTIALS_REFUSED)?.count === keys.length ? r : undefined;
  }, 60_000);
  expect(report.counts.dead).toBe(0);
  expect(report.alarms).toEqual([expect.stringMatching(/^8 event\(s\) held: Stripe refused the API key \(401\/403\)\. Fix STRIPE_API_KEY/)]);
  // Where operators look: the first line of `billing-outbox status`, and the worker's counter.
  const printed = await runCliWithoutTemporal(['status'], t.config, t.db);
  expect(printed.out).toMatch(/^ALARM: 8 event\(s\) held: Stripe refused the API key/);
  const refused = (await metrics.registry.getSingleMetricAsString('billing_outbox_stripe_errors_total')).match(/\{class="credentials"\} (\d+)/);
  expect(Number(refused?.[1])).toBeGreaterThanOrEqual(keys.length);
  // Well past the retry policy's attempts (4 here): still held, nothing dead, no attempt counted.
  await waitFor('refusals past the retry budget', async () => t.stripe.requests().length - before > 4 * keys.length * 2);
  // Each row as it stands between two tries: a try in progress has begun its attempt until the
  // refusal takes it back (a window of milliseconds, wider on a loaded machine, where a single read
  // caught one once). An attempt that were counted would stay counted, and this would time out.
  for (const key of keys) {
    await waitFor(`${key} held with no attempt counted`, async () => {
      const row = await t.row(key);
      return row?.status === 'dispatched' && row.attempt_count === 0 && row.first_attempted_at === null && row.last_error_code === CREDENTIALS_REFUSED;
    });
  }

  // The key is fixed: everything goes through, once each.
  t.stripe.heal();
  for (const key of keys) await t.waitStatus(key, 'sent');
  for (const key of keys) expect(t.eventsFor(key)).toHaveLength(1);
  expect((await outboxStatus(t.pool, t.schema)).alarms).toEqual([]);
  await pipeline.stop();
}, 150_000);
