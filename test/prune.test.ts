/**
 * Retention: delivered and cancelled rows past OUTBOX_RETENTION_DAYS leave the outbox in batches;
 * dead, rejected and unfinished rows never do; workers prune on a timer and count it; a usage id
 * whose row was pruned is still never recorded twice.
 */
import { randomUUID } from 'node:crypto';
import { expect, it } from 'vitest';
import { withTransaction } from '../src/db.js';
import { createMetrics } from '../src/metrics.js';
import { recordUsage } from '../src/outbox/enqueue.js';
import { pruneDelivered } from '../src/ops/prune.js';
import { LocalStripe } from '../src/embedded/stripe/server.js';
import { startTestPipeline } from './helpers.js';
import { runCliWithoutTemporal, testConfig, useDatabase, waitFor } from './hooks.js';

const DAY = 86_400_000;
const t = useDatabase({ customers: { acme: 'cus_acme' } });

/** Writes outbox rows as they would be found: `status`, sent (or died) `ageDays` ago. */
async function rows(spec: [status: string, ageDays: number | null][]): Promise<string[]> {
  const keys: string[] = [];
  for (const [status, ageDays] of spec) {
    // Every row carries a sent_at (as a row reopened after delivery does): only its status may keep it.
    const sent = ageDays;
    const key = await t.enqueue('acme', 1, {
      beforeCommit: (c, k) =>
        c.query(
          `UPDATE outbox SET occurred_at = now() - make_interval(days => $2::int + 1), status = $3, sent_at = now() - make_interval(days => $4::int),
                  dead_at = CASE WHEN $3 = 'dead' THEN now() - make_interval(days => $2::int) END,
                  claim_id = CASE WHEN $3 = 'claimed' THEN gen_random_uuid() END, processing_deadline = CASE WHEN $3 = 'claimed' THEN now() END
            WHERE idempotency_key = $1`,
          [k, ageDays ?? 0, status, sent],
        ),
    });
    keys.push(key);
  }
  return keys;
}

async function present(keys: string[]): Promise<string[]> {
  const { rows: found } = await t.pool.query<{ idempotency_key: string }>(`SELECT idempotency_key FROM outbox WHERE idempotency_key = ANY($1)`, [keys]);
  return keys.filter((k) => found.some((r) => r.idempotency_key === k));
}

it('prunes only delivered and cancelled rows past the age, batch by batch; never dead, rejected or unfinished ones', async () => {
  const old = await rows([['sent', 50], ['sent', 50], ['sent', 60], ['accepted', 50], ['cancelled', 50]]);
  const kept = await rows([['sent', 10], ['dead', 50], ['rejected_async', 50], ['pending', 50], ['dispatched', 50], ['claimed', 50]]);
  const batches: number[] = [];
  const pruned = await pruneDelivered(t.pool, t.schema, { olderThanMs: 45 * DAY, batchSize: 2, pauseMs: 0, onBatch: (n) => batches.push(n) });
  expect(pruned).toBe(5);
  expect(batches).toEqual([2, 2, 1]);
  expect(await present(old)).toEqual([]);
  expect(await present(kept)).toEqual(kept);
});

it('billing-outbox prune: a dry run counts, a run deletes, and less than 36 days is refused', async () => {
  const old = await rows([['sent', 40], ['sent', 40]]);
  const config = testConfig();
  const dry = await runCliWithoutTemporal(['prune', '--older-than-days', '38', '--dry-run', '--json'], config, t.db);
  expect(dry.code).toBe(0);
  expect(JSON.parse(dry.out)).toEqual({ olderThanDays: 38, wouldPrune: 2 });
  expect(await present(old)).toEqual(old);

  const run = await runCliWithoutTemporal(['prune', '--older-than-days', '38', '--by', 'alice'], config, t.db);
  expect(run.code).toBe(0);
  expect(run.out).toBe('pruned 2 delivered row(s) sent more than 38 days ago\n');
  expect(await present(old)).toEqual([]);
  // The run is in the audit log; the dry run is not.
  const { rows: audit } = await t.pool.query("SELECT actor, outcome, detail FROM operator_actions WHERE action = 'prune'");
  expect(audit).toEqual([{ actor: 'alice', outcome: 'pruned', detail: '2 delivered row(s) sent more than 38 days ago' }]);

  const tooSoon = await runCliWithoutTemporal(['prune', '--older-than-days', '30'], config, t.db);
  expect(tooSoon.code).toBe(2);
  expect(tooSoon.err).toContain('--older-than-days must be a whole number from 36');
});

it('workers prune on their timer and count it; a pruned usage id is still refused, never recorded twice', async () => {
  const stripe = await LocalStripe.start({ meters: ['api_requests'], customers: ['cus_acme'] });
  const metrics = createMetrics();
  const pipeline = await startTestPipeline({
    db: t.db,
    metrics,
    config: testConfig({ STRIPE_API_BASE: stripe.url, STRIPE_API_KEY: 'sk_test_retention', OUTBOX_PRUNE_INTERVAL_MS: '1000' }),
  });
  try {
    const usageId = `pruned-${randomUUID()}`;
    const entry = { idempotencyKey: await t.enqueue('acme', 2, { usageId }) };
    await t.waitStatus(entry.idempotencyKey, 'sent');
    // As if it had been sent two months ago.
    await t.pool.query(`UPDATE outbox SET sent_at = now() - interval '60 days' WHERE idempotency_key = $1`, [entry.idempotencyKey]);
    await waitFor('the worker to prune it', async () => (await present([entry.idempotencyKey])).length === 0, 30_000, 200);
    expect((await metrics.prunedRows.get()).values[0]!.value).toBeGreaterThanOrEqual(1);

    const again = await withTransaction(t.pool, (c) => recordUsage(c, { tenantId: 'acme', usageId, quantity: 2 })).catch((e: unknown) => e);
    expect(again).toMatchObject({ code: 'already_recorded' });
    expect(String((again as Error).message)).toContain('pruned after OUTBOX_RETENTION_DAYS');
    expect(await present([entry.idempotencyKey])).toEqual([]);
    expect(stripe.events().filter((e) => e.identifier === entry.idempotencyKey)).toHaveLength(1);
  } finally {
    await pipeline.stop();
    await stripe.close();
  }
});

it("removes the (customer, meter) leases and queue places that crashed workers left, and no live one", async () => {
  // As a worker that died would leave them: held and waited for, expired two hours ago; and live ones.
  await t.pool.query(
    `INSERT INTO meter_leases (stripe_customer_id, event_name, holder, expires_at) VALUES
       ('cus_dead', 'api_requests', 'crashed/1', now() - interval '2 hours'),
       ('cus_live', 'api_requests', 'running/1', now() + interval '30 seconds'),
       ('cus_recent', 'api_requests', 'expired-just-now/1', now() - interval '1 minute')`,
  );
  await t.pool.query(
    `INSERT INTO meter_lease_waiters (stripe_customer_id, event_name, outbox_id, holder, expires_at) VALUES
       ('cus_dead', 'api_requests', 1, 'crashed/2', now() - interval '2 hours'),
       ('cus_live', 'api_requests', 2, 'running/2', now() + interval '30 seconds')`,
  );
  await pruneDelivered(t.pool, t.schema, { olderThanMs: 45 * DAY });
  const left = async (table: string) => (await t.pool.query<{ holder: string }>(`SELECT holder FROM ${table} ORDER BY holder`)).rows.map((r) => r.holder);
  expect(await left('meter_leases')).toEqual(['expired-just-now/1', 'running/1']);
  expect(await left('meter_lease_waiters')).toEqual(['running/2']);
});
