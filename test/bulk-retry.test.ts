/**
 * `retry --all-dead` gives each lane (tenant, meter) no more than its room, as the claim does: a
 * tenant's pile of dead letters goes back at the pace its lane drains, not into Temporal at once,
 * where every other tenant's new events would queue behind it (and, in v1, their deliveries would
 * wait in the worker's activity slots for the one lease of that customer and meter).
 */
import { expect, it } from 'vitest';
import { DeadLetterRetrier, type RetryResult } from '../src/ops/retry.js';
import { laneInFlight } from '../src/outbox/sql/operator.js';
import { stateQuery } from '../workflows/shared.js';
import { usePipeline, waitFor } from './hooks.js';

const METER = 'api_requests';
const t = usePipeline({ customers: { heap: 'cus_heap', jammed: 'cus_jammed', free: 'cus_free' }, stripe: { meters: [METER] } });

it("retries a tenant's dead letters at its lane's pace: never more than LANE_MAX_IN_FLIGHT of them in flight", async () => {
  // Stripe refuses each first call for good (a 400): every event dies at once.
  t.stripe.failNext(12, 400);
  const keys = await t.backlog('heap', 12);
  for (const key of keys) await t.waitStatus(key, 'dead', 30_000);
  for (const key of keys) {
    await waitFor(`${key} waiting as a dead letter`, async () => (await t.client.workflow.getHandle(key).query(stateQuery)).status === 'dead' || undefined);
  }
  // Each call takes a while: the lane stays full while the retry goes on.
  t.stripe.setLatency(300);

  let most = 0;
  let sampling = true;
  const sampler = (async () => {
    while (sampling) {
      most = Math.max(most, await laneInFlight(t.pool, t.schema, 'heap', METER));
      await new Promise((resolve) => setTimeout(resolve, 20));
    }
  })();
  const results: RetryResult[] = [];
  try {
    const retrier = new DeadLetterRetrier({ db: t.pool, schema: t.schema, client: t.client, config: t.config, now: Date.now });
    expect(await retrier.retryAllDead({ tenantId: 'heap' }, { force: false, requestedBy: 'test' }, (r) => results.push(r))).toEqual({});
    for (const key of keys) await t.waitStatus(key, 'sent', 30_000);
  } finally {
    sampling = false;
    await sampler;
    t.stripe.setLatency(0);
  }
  expect(results.map((r) => r.outcome)).toEqual(Array(keys.length).fill('signalled'));
  // A lane's room, not the bulk retry's eight at once.
  expect(most).toBeGreaterThan(0);
  expect(most).toBeLessThanOrEqual(t.config.lanes.maxInFlight);
  for (const key of keys) expect(t.eventsFor(key), key).toHaveLength(1);
}, 120_000);

it("a lane that stays full is reported, its rows untried, and every other lane's dead letters are retried", async () => {
  const insert = (tenant: string, key: string, status: string) =>
    t.pool.query(`INSERT INTO outbox (tenant_id, event_name, quantity, occurred_at, idempotency_key, usage_id, status, last_error_code) VALUES ($1, $2, 1, now(), $3, $3, $4, 'http_500')`, [tenant, METER, key, status]);
  // 'jammed' has its whole lane in flight (runs that never finish), and more dead letters than the
  // retry's eight slots first in line.
  const jammed = Array.from({ length: t.config.lanes.maxInFlight }, (_, i) => `u:jammed:in-flight-${i}`);
  for (const key of jammed) await insert('jammed', key, 'dispatched');
  await insert('jammed', 'u:jammed:dead', 'dead');
  for (let i = 0; i < 10; i++) await insert('jammed', `u:jammed:dead-${i}`, 'dead');
  await insert('free', 'u:free:dead', 'dead');
  try {
    const results: RetryResult[] = [];
    const retrier = new DeadLetterRetrier({ db: t.pool, schema: t.schema, client: t.client, config: t.config, now: Date.now, laneRoomWaitMs: 8_000 });
    expect(await retrier.retryAllDead({}, { force: false, requestedBy: 'test' }, (r) => results.push(r))).toEqual({});
    const by = Object.fromEntries(results.map((r) => [r.key, r]));
    expect(by['u:jammed:dead']).toMatchObject({ outcome: 'refused', message: expect.stringContaining('its lane (tenant jammed, meter api_requests) had its') });
    expect(by['u:free:dead']).toMatchObject({ outcome: 'reopened' });
    // The jammed lane's pile waited in one slot: the free lane's dead letter went back at once,
    // not after the jammed lane's wait for room.
    expect(results.map((r) => r.key).slice(0, 1)).toEqual(['u:free:dead']);
    expect(results.filter((r) => r.key.startsWith('u:jammed:')).map((r) => r.outcome)).toEqual(Array(11).fill('refused'));
    await t.waitStatus('u:free:dead', 'sent', 30_000);
    expect((await t.row('u:jammed:dead'))?.status).toBe('dead');
  } finally {
    await t.pool.query(`UPDATE outbox SET status = 'sent' WHERE tenant_id = 'jammed'`);
  }
}, 60_000);
