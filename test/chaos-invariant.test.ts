/**
 * The chaos runner's invariant check must be able to fail: each way of getting billing wrong is
 * staged here by hand (a lost event, one recorded twice, a wrong value, an event nobody committed,
 * an acknowledged usage that was not committed, a secret in a log) and the check must name it;
 * the demo uses the same check, also without Stripe's record (a real account).
 * The runs themselves (`npm run chaos`) are in scripts/test.sh.
 */
import { randomUUID } from 'node:crypto';
import { mkdtemp, rm, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import Stripe from 'stripe';
import { afterEach, beforeEach, expect, it } from 'vitest';
import { checkInvariant } from '../chaos/invariant.js';
import { usageKey, type Usage } from '../chaos/load.js';
import { countStripeRequests } from '../chaos/requests.js';
import { withTransaction } from '../src/db.js';
import { recordUsage } from '../src/outbox/enqueue.js';
import { idempotencyKeyFor, useStripe } from './hooks.js';

// A database and a Stripe of each test's own: the check reads everything in them.
const t = useStripe({ customers: { t1: 'cus_1' }, stripe: { meters: ['api_requests'] }, perTest: true });
let client: Stripe;
let logDir: string;
const secret = `sk_test_${randomUUID().replace(/-/g, '')}`;

beforeEach(async () => {
  const url = new URL(t.stripe.url);
  client = new Stripe(secret, { host: url.hostname, port: Number(url.port), protocol: 'http', maxNetworkRetries: 0 });
  logDir = await mkdtemp(path.join(os.tmpdir(), 'chaos-invariant-'));
});

afterEach(async () => {
  await rm(logDir, { recursive: true, force: true });
});

const occurredAt = new Date(Math.floor(Date.now() / 1000) * 1000 - 60_000);

/** Commits usages; returns each one's identifier. */
async function commit(...usages: { id: string; quantity: number }[]): Promise<Map<string, string>> {
  const keys = new Map<string, string>();
  await withTransaction(t.pool, async (c) => {
    for (const u of usages) {
      const r = await recordUsage(c, { tenantId: 't1', usageId: u.id, quantity: u.quantity, occurredAt });
      keys.set(u.id, r.entry.idempotencyKey);
    }
  });
  await t.pool.query(`UPDATE outbox SET status = 'sent', sent_at = now()`);
  return keys;
}

function bill(identifier: string, value: number): Promise<unknown> {
  return client.billing.meterEvents.create({
    event_name: 'api_requests',
    identifier,
    timestamp: Math.floor(occurredAt.getTime() / 1000),
    payload: { stripe_customer_id: 'cus_1', value: String(value) },
  });
}

const observed = () => ({ stripe: t.stripe, pool: t.pool, secrets: () => [secret] });
const noLoad = { acknowledged: new Map<string, Usage>(), uncommitted: new Map<string, Usage>() };

it('passes a run where every committed usage is recorded once, as committed', async () => {
  const keys = await commit({ id: 'a', quantity: 5 }, { id: 'b', quantity: 7 });
  for (const [id, key] of keys) await bill(key, id === 'a' ? 5 : 7);
  const { table, violations } = await checkInvariant(observed(), noLoad, logDir);
  expect(violations).toEqual([]);
  expect(table).toMatchObject({ committed: 2, recorded: 2, lost: 0, doubleBilled: 0, wrongFields: 0, billedButUncommitted: 0 });
});

it('names a lost event, a double-billed one, a wrong value and an event nobody committed', async () => {
  const keys = await commit({ id: 'lost', quantity: 1 }, { id: 'twice', quantity: 2 }, { id: 'wrong', quantity: 3 });
  await bill(keys.get('twice')!, 2);
  // Past Stripe's 24 h identifier window the same identifier is counted again: billed twice.
  t.stripe.advanceClock(25 * 3_600_000);
  await bill(keys.get('twice')!, 2);
  await bill(keys.get('wrong')!, 30);
  const neverCommitted = idempotencyKeyFor('t1', 'never-committed');
  await bill(neverCommitted, 4);

  const { table, violations } = await checkInvariant(observed(), noLoad, logDir);
  expect(table).toMatchObject({ committed: 3, lost: 1, doubleBilled: 1, wrongFields: 1, billedButUncommitted: 1 });
  const text = violations.join('\n');
  expect(text).toContain(`${keys.get('lost')} (sent) was committed and never recorded`);
  expect(text).toContain(`${keys.get('twice')} was recorded 2 times`);
  expect(text).toContain(`${keys.get('wrong')}: value 30 ≠ 3`);
  expect(text).toContain(`Stripe recorded ${neverCommitted}, which no committed usage has`);
  expect(text).toMatch(/cus_1 api_requests: committed 6, recorded 38/);
});

it('names an unsettled row, an acknowledged usage that was not committed, a rolled-back one that was, and a secret in a log', async () => {
  const keys = await commit({ id: 'a', quantity: 5 }, { id: 'rolled', quantity: 1 });
  await t.pool.query(`UPDATE outbox SET status = 'dispatched' WHERE idempotency_key = $1`, [keys.get('a')]);
  for (const [id, key] of keys) await bill(key, id === 'a' ? 5 : 1);
  const usage = (id: string): Usage => ({ tenantId: 't1', usageId: id, quantity: 1, eventName: 'api_requests', occurredAt });
  const load = {
    acknowledged: new Map([[usageKey('t1', 'ghost'), usage('ghost')]]),
    uncommitted: new Map([[usageKey('t1', 'rolled'), usage('rolled')]]),
  };
  await writeFile(path.join(logDir, 'worker-0.log'), `{"msg":"calling Stripe","key":"${secret}"}\n`);

  const { table, violations } = await checkInvariant(observed(), load, logDir);
  expect(table.unsettled).toBe(1);
  const text = violations.join('\n');
  expect(text).toContain(`${keys.get('a')} is still dispatched after the drain`);
  expect(text).toContain('usage t1/ghost was acknowledged and is not committed');
  expect(text).toContain('usage t1/rolled was rolled back and is committed');
  expect(text).toContain('worker-0.log contains a secret');
});

it("gives the totals per (customer, meter), and without Stripe's record still names what the database shows", async () => {
  const keys = await commit({ id: 'a', quantity: 5 }, { id: 'b', quantity: 7 });
  await bill(keys.get('a')!, 5);
  await bill(keys.get('b')!, 7);
  const read = await checkInvariant(observed(), noLoad);
  expect(read.violations).toEqual([]);
  expect(read.pairs).toEqual([{ customer: 'cus_1', eventName: 'api_requests', events: 2, committed: 12, recorded: 12 }]);

  // The demo against a real Stripe account: only the database's side can be checked.
  await t.pool.query(`UPDATE outbox SET status = 'dead', last_error_code = 'x', last_error_message = 'y' WHERE idempotency_key = $1`, [keys.get('b')]);
  const { table, violations, pairs } = await checkInvariant({ ...observed(), stripe: undefined }, noLoad);
  expect(table).toMatchObject({ stripeRead: false, committed: 2, recorded: 0, dead: 1, lost: 0, doubleBilled: 0 });
  expect(pairs).toEqual([{ customer: 'cus_1', eventName: 'api_requests', events: 2, committed: 12, recorded: undefined }]);
  expect(violations).toEqual([`${keys.get('b')} is dead (x: y)`]);
});

it("counts what the run cost Stripe in requests: v1 calls, or v2 stream requests (refused ones too), per event recorded", async () => {
  const at = new Date(occurredAt).toISOString();
  const events = (ids: string[]) => ids.map((identifier) => ({ event_name: 'api_requests', payload: { stripe_customer_id: 'cus_1', value: '1' }, identifier, timestamp: at }));
  const session = await client.v2.billing.meterEventSession.create();
  const url = new URL(t.stripe.url);
  const stream = new Stripe(session.authentication_token, { host: url.hostname, port: Number(url.port), protocol: 'http', maxNetworkRetries: 0 });
  t.stripe.failNext(1, 500);
  await expect(stream.v2.billing.meterEventStream.create({ events: events(['s1', 's2', 's3']) })).rejects.toThrow();
  await stream.v2.billing.meterEventStream.create({ events: events(['s1', 's2', 's3']) });
  await stream.v2.billing.meterEventStream.create({ events: events(['s4', 's5']) });
  await client.billing.meterEvents.create({ event_name: 'api_requests', payload: { stripe_customer_id: 'cus_1', value: '1' }, identifier: 'v1-a' });

  expect(countStripeRequests(t.stripe, 'v2', 5)).toEqual({ api: 'v2', requests: 3, failed: 1, recorded: 5, perEvent: 0.6 });
  expect(countStripeRequests(t.stripe, 'v1', 1)).toEqual({ api: 'v1', requests: 1, failed: 0, recorded: 1, perEvent: 1 });
});
