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
// 'heap' is billed as a customer Stripe does not have until the test adds it: its events die at once.
const t = usePipeline({ customers: { heap: 'cus_heap' }, stripe: { meters: [METER], customers: [] } });

it("retries a tenant's dead letters at its lane's pace: never more than LANE_MAX_IN_FLIGHT of them in flight", async () => {
  const keys = await t.backlog('heap', 12);
  for (const key of keys) await t.waitStatus(key, 'dead', 30_000);
  for (const key of keys) {
    await waitFor(`${key} waiting as a dead letter`, async () => (await t.client.workflow.getHandle(key).query(stateQuery)).status === 'dead' || undefined);
  }
  t.stripe.addCustomer('cus_heap');
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
