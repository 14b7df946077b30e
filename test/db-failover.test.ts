/**
 * PostgreSQL failing over under a busy worker: the connections it had go silent (no answer, no
 * reset: the old server's address is gone) while new ones reach the new server. Nothing may wait on
 * a silent connection for long: each statement of a delivery or a claim unanswered for
 * `statementAnswerMs` (5 s) is taken for PostgreSQL away and its connection dropped, so the event
 * whose Stripe call was under way, those in flight and those committed after are billed once each,
 * none dead, and no attempt is spent on it (measured: all billed 12.5 s after the failover, 43.8 s
 * before the timeout, when each hung delivery failed an attempt at its attempt timeout). The API's
 * requests are answered 503 (the client tries again) instead of hanging on a silent connection.
 */
import { randomUUID } from 'node:crypto';
import { afterAll, expect, inject, it } from 'vitest';
import { freePort } from '../src/embedded/postgres.js';
import { withTransaction } from '../src/db.js';
import { recordUsage } from '../src/outbox/enqueue.js';
import { cleanUpAway, failingOver, startProcess, untilSaid } from './away.js';
import { usePipeline, waitFor } from './hooks.js';

const ENV = { STRIPE_API_KEY: 'sk_test_failover', RELAY_COUNT: '1', LOG_LEVEL: 'info' };
const TENANTS = Array.from({ length: 10 }, (_, i) => `t${i}`);
const t = usePipeline({ customers: Object.fromEntries(TENANTS.map((id) => [id, `cus_${id}`])), stripe: { meters: ['api_requests'] }, env: ENV, worker: false });
afterAll(cleanUpAway);

it('a running worker whose PostgreSQL connections go silent carries on over new ones: nothing lost, nothing billed twice, nothing dead', async () => {
  const proxy = await failingOver(t.db.url);
  const worker = startProcess({
    ...ENV,
    DATABASE_URL: proxy.url,
    TEMPORAL_ADDRESS: inject('temporalAddress'),
    TEMPORAL_TASK_QUEUE: t.config.temporal.taskQueue,
    STRIPE_API_BASE: t.stripe.url,
  });
  await untilSaid(worker, 'worker running', 90_000);
  const record = async (usageId: string, tenantId = 't0') => (await withTransaction(t.pool, (c) => recordUsage(c, { usageId, tenantId, quantity: 5 }))).entry.idempotencyKey;
  const warm = await record(`failover-warm-${randomUUID()}`);
  await waitFor('the first event billed', async () => t.stripe.events().some((e) => e.identifier === warm), 60_000);

  t.stripe.setLatency(2_000);
  const inFlight = await record(`failover-in-flight-${randomUUID()}`);
  await waitFor('its Stripe call under way', async () => t.stripe.callsInFlight() > 0, 30_000);
  // Busy: every connection of the worker's pool opened and in use.
  const busy: string[] = [];
  for (let i = 0; i < 40; i++) busy.push(await record(`failover-busy-${i}-${randomUUID()}`, TENANTS[i % TENANTS.length]));
  await new Promise((r) => setTimeout(r, 1_000));
  proxy.failOver();
  expect(proxy.silenced()).toBeGreaterThan(0);
  const after: string[] = [];
  for (let i = 0; i < 3; i++) after.push(await record(`failover-after-${i}-${randomUUID()}`));
  t.stripe.setLatency(0);

  for (const key of [inFlight, ...busy, ...after]) {
    await waitFor(`${key} billed and its row sent`, async () => {
      const { rows } = await t.pool.query<{ status: string }>('SELECT status FROM outbox WHERE idempotency_key = $1', [key]);
      return rows[0]?.status === 'sent' || (worker.child.exitCode !== null && Promise.reject(new Error(worker.output())));
    }, 180_000);
    expect(t.stripe.events().filter((e) => e.identifier === key)).toHaveLength(1);
  }
  const { rows } = await t.pool.query<{ status: string; n: number }>('SELECT status, count(*)::int AS n FROM outbox GROUP BY status');
  expect(rows).toEqual([{ status: 'sent', n: 2 + busy.length + after.length }]);
  // A statement on a silent connection is given up on within seconds, as PostgreSQL away: the
  // delivery waits and comes back, spending no attempt. Without that it hung until the attempt's
  // timeout, which failed the attempt (a local activity's marker, or an activity, with a failure).
  for (const key of [inFlight, ...busy, ...after]) {
    const { events } = await t.client.workflow.getHandle(key).fetchHistory();
    const failed = (events ?? []).filter((e) => e.markerRecordedEventAttributes?.failure || e.activityTaskFailedEventAttributes || e.activityTaskTimedOutEventAttributes);
    expect(failed, key).toEqual([]);
  }
  expect(worker.child.exitCode).toBeNull();
  worker.child.kill('SIGTERM');
}, 300_000);

it('the API whose PostgreSQL connections go silent answers 503 within seconds, not never, and takes usage again over new ones', async () => {
  const proxy = await failingOver(t.db.url);
  const apiPort = await freePort();
  const token = `tok_${randomUUID().replace(/-/g, '')}`;
  const api = startProcess(
    { DATABASE_URL: proxy.url, TEMPORAL_ADDRESS: inject('temporalAddress'), API_PORT: String(apiPort), API_TOKENS: JSON.stringify([{ name: 'app', token, tenants: ['*'], scopes: ['usage:write'] }]) },
    'src/bin/api.ts',
  );
  await untilSaid(api, 'API listening', 60_000);
  // Each request is answered, one way or the other, well within this.
  const post = (usageId: string) =>
    fetch(`http://127.0.0.1:${apiPort}/v1/usage`, {
      method: 'POST',
      headers: { authorization: `Bearer ${token}`, 'content-type': 'application/json' },
      body: JSON.stringify({ tenant_id: 't0', usage_id: usageId, quantity: 1 }),
      signal: AbortSignal.timeout(20_000),
    });
  // Several connections open in the API's pool, then all of them silent.
  await Promise.all(Array.from({ length: 5 }, () => post(`failover-api-warm-${randomUUID()}`)));
  proxy.failOver();
  expect(proxy.silenced()).toBeGreaterThan(1);

  const ids = Array.from({ length: 5 }, (_, i) => `failover-api-${i}-${randomUUID()}`);
  const answers: number[] = [];
  for (const id of ids) {
    // As a client does: 503 means try again with the same usage_id.
    for (;;) {
      const res = await post(id);
      answers.push(res.status);
      if (res.status !== 503) break;
    }
  }
  expect(answers.filter((s) => s !== 503)).toEqual(ids.map(() => 201));
  const { rows } = await t.pool.query('SELECT id FROM usage_logs WHERE id = ANY($1::text[])', [ids]);
  expect(rows).toHaveLength(ids.length);
  api.child.kill('SIGTERM');
}, 300_000);
