/**
 * A Stripe key rolled while the workers run. Stripe's "roll key" can expire the old key at once;
 * the deployment's secret (STRIPE_API_KEY_FILE, a Kubernetes secret mounted as a file) is then
 * rewritten with the new one. The running worker reads it again (src/stripe/key-file.ts): the events
 * refused meanwhile are held, not dead, and each is billed once with the new key, with no restart.
 */
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { afterEach, beforeEach, expect, it } from 'vitest';
import { outboxStatus } from '../src/ops/status.js';
import { CREDENTIALS_REFUSED } from '../src/stripe/errors.js';
import { useStripe, waitFor } from './hooks.js';

const t = useStripe({ perTest: true, customers: { acme: 'cus_acme', globex: 'cus_globex' }, stripe: { meters: ['api_requests'] } });

let dir: string;
beforeEach(() => void (dir = mkdtempSync(path.join(tmpdir(), 'key-roll-'))));
afterEach(() => rmSync(dir, { recursive: true, force: true }));

it.each(['v1', 'v2'])('%s: a key rolled in its file is taken up by the running worker; what was refused meanwhile is billed once', async (api) => {
  const file = path.join(dir, 'stripe-api-key');
  writeFileSync(file, 'sk_test_before_roll\n');
  t.stripe.rollApiKey('sk_test_before_roll');
  // v2 sends with a meter event session's token, made with the key: short sessions, so the worker
  // needs a new one (and the key) soon after the roll.
  t.stripe.setSessionLifetime(1_000);
  const config = t.configWith({ STRIPE_API_KEY: '', STRIPE_API_KEY_FILE: file, STRIPE_METER_API: api });
  // Short for the test: how soon a held delivery asks again (15 s in production).
  const pipeline = await t.startPipeline({ ...config, timings: { ...config.timings, credentialsRetryMs: 300 } });
  const delivered = api === 'v1' ? 'sent' : 'accepted';
  const before = await t.backlog('acme', 2);
  for (const key of before) await t.waitStatus(key, delivered);

  // Rolled, the old key expiring at once: every call is refused until the file has the new key.
  t.stripe.rollApiKey('sk_test_after_roll');
  // v2: the session made with the old key lives out its second first (Stripe does not end it).
  if (api === 'v2') await new Promise((resolve) => setTimeout(resolve, 1_500));
  const during = [...(await t.backlog('acme', 3)), ...(await t.backlog('globex', 3))];
  // The first refusals hold their events (the relay holds the rest back while Stripe refuses the key).
  await waitFor('events held by the refused key', async () => {
    const r = await outboxStatus(t.pool, t.schema, new Date());
    return (r.inFlightByLastError.find((e) => e.code === CREDENTIALS_REFUSED)?.count ?? 0) > 0;
  });
  for (const key of during) expect(t.eventsFor(key)).toEqual([]);

  // Taken up within KEY_FILE_RECHECK_MS and a held delivery's next try.
  writeFileSync(file, 'sk_test_after_roll\n');
  for (const key of during) await t.waitStatus(key, delivered);
  for (const key of [...before, ...during]) expect(t.eventsFor(key)).toHaveLength(1);
  const status = await outboxStatus(t.pool, t.schema, new Date());
  expect(status.counts.dead).toBe(0);
  expect(status.alarms).toEqual([]);
  await pipeline.stop();
});
