/**
 * Faults as faults: a worker process killed with SIGKILL in the middle of delivering, Stripe
 * unreachable for a while. Every committed event must still be billed exactly once.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import { afterAll, beforeAll, expect, inject, it } from 'vitest';
import { withTransaction } from '../src/db.js';
import { recordUsage } from '../src/outbox/enqueue.js';
import { statusCounts, usePipeline, waitFor } from './hooks.js';

/** The configuration of this file's pipeline and of the worker process it spawns. */
const ENV = {
  STRIPE_API_KEY: 'sk_test_faults',
  STRIPE_TIMEOUT_MS: '1500',
  RETRY_INITIAL_INTERVAL_MS: '200',
  RETRY_MAXIMUM_INTERVAL_MS: '1000',
  RETRY_MAXIMUM_ATTEMPTS: '50',
  RELAY_COUNT: '1',
  RELAY_POLL_INTERVAL_MS: '200',
  LOG_LEVEL: 'warn',
};

const t = usePipeline({
  customers: { a: 'cus_a', b: 'cus_b' },
  // Per-customer concurrency is issue #4's subject; here many calls overlap on purpose.
  stripe: { meters: ['api_requests'], enforcePerCustomerConcurrency: false },
  env: ENV,
  worker: false,
});
let env: Record<string, string>;
const children: ChildProcess[] = [];

beforeAll(() => {
  env = { ...ENV, TEMPORAL_ADDRESS: inject('temporalAddress'), TEMPORAL_TASK_QUEUE: t.config.temporal.taskQueue, STRIPE_API_BASE: t.stripe.url };
});

afterAll(() => {
  for (const c of children) if (c.exitCode === null) c.kill('SIGKILL');
});

/** Commits `n` usages, alternating the two tenants, in one transaction. */
async function enqueueMany(n: number, prefix: string): Promise<string[]> {
  return withTransaction(t.pool, async (c) => {
    const keys: string[] = [];
    for (let i = 0; i < n; i++) {
      const r = await recordUsage(c, { usageId: `${prefix}-${i}`, tenantId: i % 2 ? 'a' : 'b', quantity: i + 1 });
      keys.push(r.entry.idempotencyKey);
    }
    return keys;
  });
}

function expectBilledOnce(keys: string[]): void {
  const events = t.stripe.events();
  for (const key of keys) expect(events.filter((e) => e.identifier === key), key).toHaveLength(1);
}

it('a worker process killed with SIGKILL mid-delivery loses nothing and bills nothing twice', async () => {
  // Slow answers keep many deliveries in flight when the process dies.
  t.stripe.setLatency(700);
  const child = spawn(process.execPath, ['--import', 'tsx', 'src/bin/worker.ts'], {
    env: { ...process.env, ...env, DATABASE_URL: t.db.url, LOG_LEVEL: 'info' },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  children.push(child);
  let output = '';
  child.stdout!.on('data', (b: Buffer) => (output += b.toString()));
  child.stderr!.on('data', (b: Buffer) => (output += b.toString()));
  await waitFor('the worker process to start', async () => output.includes('worker running') || (child.exitCode !== null && Promise.reject(new Error(output))), 60_000);

  const keys = await enqueueMany(40, `kill-${randomUUID()}`);
  // Kill it once a few events are through and the rest are dispatched or in flight.
  // The kill lands while Stripe is working on calls of the worker: checked, then killed in the same tick.
  await waitFor('some deliveries, and calls in flight', async () => t.stripe.events().length >= 3 && t.stripe.callsInFlight() > 0, 30_000, 5);
  const callsAtKill = t.stripe.callsInFlight();
  child.kill('SIGKILL');
  expect(callsAtKill).toBeGreaterThan(0);
  await new Promise((r) => child.once('exit', r));
  // What the worker logged never holds the Stripe key or the database password.
  expect(output).not.toContain('sk_test_faults');
  expect(output).not.toContain(new URL(t.db.url).password);
  const atKill = await statusCounts(t.pool);
  expect(atKill.sent ?? 0).toBeLessThan(40);
  // Events the killed worker had taken (dispatched, their workflows open) are left behind.
  expect(atKill.dispatched ?? 0).toBeGreaterThan(0);

  t.stripe.setLatency(0);
  await t.pipeline.addWorker();
  await waitFor('every event sent', async () => (await statusCounts(t.pool)).sent === 40, 90_000, 250);
  expectBilledOnce(keys);
  expect(t.stripe.events().filter((e) => keys.includes(e.identifier)).reduce((s, e) => s + e.value, 0)).toBe((40 * 41) / 2);
}, 150_000);

it('Stripe unreachable for a while: events wait, then all arrive once', async () => {
  if (t.pipeline.workers.length === 0) await t.pipeline.addWorker();
  // Down until the pipeline has visibly hit the outage (the relay of the killed worker above may
  // take its heartbeat timeout to come back), then up again.
  t.stripe.refuseFor(120);
  const keys = await enqueueMany(10, `outage-${randomUUID()}`);
  // Each lane's events in flight hit the outage and are retried; the rest of each lane waits, pending.
  await waitFor('retries during the outage', async () => {
    const { rows } = await t.pool.query<{ tenant_id: string; n: number }>(
      `SELECT tenant_id, count(*)::int AS n FROM outbox
        WHERE idempotency_key = ANY($1) AND last_error_code = 'connection_error' AND status = 'dispatched' GROUP BY tenant_id`,
      [keys],
    );
    return rows.length === 2 && rows.every((r) => r.n >= 1);
  }, 60_000, 100);
  const { rows: sentDuring } = await t.pool.query(`SELECT count(*)::int AS n FROM outbox WHERE idempotency_key = ANY($1) AND status = 'sent'`, [keys]);
  expect(sentDuring[0].n).toBe(0);
  t.stripe.refuseFor(0);
  await waitFor('every event sent', async () => {
    const { rows } = await t.pool.query(`SELECT count(*)::int AS n FROM outbox WHERE idempotency_key = ANY($1) AND status = 'sent'`, [keys]);
    return rows[0].n === 10;
  }, 60_000, 250);
  expectBilledOnce(keys);
}, 150_000);
