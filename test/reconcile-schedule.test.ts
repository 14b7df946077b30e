/**
 * Reconciliation that runs by itself: the schedule every worker ensures, its runs (triggered here
 * with `handle.trigger()` rather than waited for), what they record (the result, the memo,
 * `billing-outbox status`, the metrics), on the real dev server, PostgreSQL and the local Stripe.
 * Events go through the whole pipeline (relay, usage workflow, Stripe), so "sent" means what it
 * means in production.
 */
import { Client, Connection, ScheduleOverlapPolicy, type ScheduleHandle } from '@temporalio/client';
import { MockActivityEnvironment } from '@temporalio/testing';
import { randomUUID } from 'node:crypto';
import { Registry } from 'prom-client';
import { afterAll, describe, expect, inject, it } from 'vitest';
import { runCli } from '../src/cli/run.js';
import { createReconcileActivities } from '../activities/reconcile.js';
import { createMetrics } from '../src/metrics.js';
import { schemaFor } from '../src/outbox/sql/schema.js';
import { createStripeClient } from '../src/stripe/client.js';
import { reconcileWindowAt, type ReconcileRunResult } from '../src/ops/reconcile.js';
import type { ReconcileStatus } from '../src/ops/status.js';
import { ensureReconcileSchedule, reconcileScheduleId } from '../src/temporal/reconcile-schedule.js';
import { createWorker, type WorkerHandle } from '../src/worker.js';
import { usePipeline, waitFor, workflowBundle } from './hooks.js';

const HOUR = 3_600_000;
// A day's window ending at the last whole hour at least ten minutes old: usage two to four hours
// old is inside it whenever the test runs.
const env = { RECONCILE_INTERVAL_MS: String(24 * HOUR), RECONCILE_LAG_MS: '600000' };
const t = usePipeline({ stripe: { meters: ['api_requests'] }, env, metrics: (pool) => createMetrics(new Registry(), { db: pool }) });

const schedules: ScheduleHandle[] = [];
afterAll(async () => {
  for (const s of schedules.splice(0)) await s.delete().catch(() => undefined);
});

/** A tenant of the test's own, billed as a Stripe customer of its own. */
async function tenant(): Promise<{ id: string; customer: string }> {
  const suffix = randomUUID().slice(0, 8);
  const tn = { id: `t-${suffix}`, customer: `cus_${suffix}` };
  t.stripe.addCustomer(tn.customer);
  await t.addCustomers({ [tn.id]: tn.customer });
  return tn;
}

/** Usage `hoursAgo` old, delivered by the pipeline: the row ends `sent` (Stripe answered 200). */
async function delivered(tenantId: string, quantity: number, hoursAgo: number): Promise<string> {
  const key = await t.enqueue(tenantId, quantity, { occurredAt: new Date(Date.now() - hoursAgo * HOUR) });
  await t.waitStatus(key, 'sent');
  return key;
}

async function schedule(): Promise<ScheduleHandle> {
  await ensureReconcileSchedule(t.client, t.config);
  const handle = t.client.schedule.getHandle(reconcileScheduleId(t.config.temporal.taskQueue));
  if (!schedules.some((s) => s.scheduleId === handle.scheduleId)) schedules.push(handle);
  return handle;
}

/** Triggers a run now and waits for its result. */
async function runNow(handle: ScheduleHandle): Promise<{ workflowId: string; result: ReconcileRunResult }> {
  const before = new Set((await handle.describe()).info.recentActions.map((a) => a.action.workflow.workflowId));
  // A schedule names each run by its scheduled time, to the second: a trigger in the same second as
  // the previous test's would name the same workflow and start nothing. Into the next second first.
  await new Promise((r) => setTimeout(r, 1050 - (Date.now() % 1000)));
  await handle.trigger();
  const action = await waitFor('the triggered run', async () => (await handle.describe()).info.recentActions.find((a) => !before.has(a.action.workflow.workflowId)));
  const { workflowId, firstExecutionRunId } = action.action.workflow;
  const result = (await t.client.workflow.getHandle(workflowId, firstExecutionRunId).result()) as ReconcileRunResult;
  return { workflowId, result };
}

async function status(): Promise<{ json: { reconcile: ReconcileStatus }; text: string }> {
  const run = async (argv: string[]) => {
    let out = '';
    const code = await runCli(argv, {
      config: t.config,
      db: async () => t.pool,
      temporal: async () => t.client,
      out: { write: (s: string) => (out += s) },
      err: { write: () => undefined },
    });
    expect(code).toBe(0);
    return out;
  };
  return { json: JSON.parse(await run(['status', '--json'])) as { reconcile: ReconcileStatus }, text: await run(['status']) };
}

describe('the reconcile schedule', () => {
  it('a clean window: every pair matches, recorded in the result, the memo, status and the metrics', async () => {
    const clean = await tenant();
    await delivered(clean.id, 3, 2);
    await delivered(clean.id, 4, 3);

    const handle = await schedule();
    const slot = async () => (await t.pool.query<{ next_slot: Date }>(`SELECT next_slot FROM rate_limits WHERE bucket = 'stripe_calls'`)).rows[0]!.next_slot.getTime();
    const before = await slot();
    const { workflowId, result } = await runNow(handle);
    // Its Stripe calls (the meter list, the pair's summaries) took slots in the deliveries' pace.
    expect(await slot()).toBeGreaterThan(before);
    const window = reconcileWindowAt(Date.now(), { intervalMs: 24 * HOUR, lagMs: 600_000 });
    expect(result).toMatchObject({ from: window.from.toISOString(), to: window.to.toISOString(), match: true, pairs: 1, ours: 7, stripe: 7 });
    expect(result.drift).toEqual({ stripeMore: 0, stripeLess: 0 });
    expect(result.drifting).toEqual([]);

    const run = await t.client.workflow.getHandle(workflowId).describe();
    expect(run.memo?.summary).toMatch(/matched, 1 customer\/meter pair/);
    expect(await run.staticSummary()).toContain('Reconcile');

    const s = await status();
    expect(s.json.reconcile).toMatchObject({ exists: true, paused: false, lastSuccess: { workflowId, result: { match: true } } });
    expect(s.text).toMatch(/reconcile schedule: billing-outbox-reconcile:\S+, next run /);
    expect(s.text).toMatch(/last completed: \S+ over .*: matched \(1 customer\/meter pair\(s\)\)/);

    const metrics = await t.metrics!.registry.metrics();
    expect(metrics).toMatch(/^billing_outbox_reconcile_drift\{direction="stripe_less"\} 0$/m);
    expect(metrics).toMatch(/^billing_outbox_reconcile_last_success_timestamp_seconds [1-9]/m);
  });

  it('an event Stripe rejected after its 200, with no webhook to tell us: drift, naming the customer', async () => {
    const broken = await tenant();
    await delivered(broken.id, 2, 2);
    // Stripe answers 200 and rejects it later; no webhook reaches us, so the row stays sent.
    t.stripe.asyncErrorNext(1, 'meter_event_customer_not_found');
    const rejected = await delivered(broken.id, 5, 2);
    expect((await t.row(rejected))!.status).toBe('sent');
    // Usage Stripe holds for this customer that no row of ours accounts for, hours before.
    await createStripeClient(t.config.stripe).billing.meterEvents.create({
      event_name: 'api_requests',
      payload: { stripe_customer_id: broken.customer, value: '6' },
      identifier: `elsewhere-${randomUUID()}`,
      timestamp: Math.floor((Date.now() - 5 * HOUR) / 1000),
    });

    const { result } = await runNow(await schedule());
    expect(result.match).toBe(false);
    expect(result.drift).toEqual({ stripeMore: 6, stripeLess: 5 });
    expect(result.stripeOnly).toEqual({ windows: 1, quantity: 6 });
    expect(result.driftingCustomers).toBe(1);
    expect(result.drifting).toEqual([
      expect.objectContaining({ stripeCustomerId: broken.customer, tenantIds: [broken.id], eventName: 'api_requests', ours: 7, stripe: 8, stripeMore: 6, stripeLess: 5 }),
    ]);

    const s = await status();
    expect(s.json.reconcile.lastSuccess?.result.drift).toEqual({ stripeMore: 6, stripeLess: 5 });
    expect(s.text).toContain('DRIFT in 2 of');
    expect(s.text).toContain(`${broken.customer} (${broken.id}) api_requests: ours 7, Stripe 8`);
    expect(s.text).toContain('Stripe counts 6 in 1 hour(s) with no row of ours');

    const metrics = await t.metrics!.registry.metrics();
    expect(metrics).toMatch(/^billing_outbox_reconcile_drift\{direction="stripe_less"\} 5$/m);
    expect(metrics).toMatch(/^billing_outbox_reconcile_drift\{direction="stripe_more"\} 6$/m);
    expect(metrics).toMatch(/^billing_outbox_reconcile_drifting_customers 1$/m);
  });

  it('is ensured idempotently: many at once create it once, the rest find it', async () => {
    const config = t.configWith({ RECONCILE_INTERVAL_MS: String(2 * HOUR), RECONCILE_LAG_MS: String(HOUR) });
    const handle = t.client.schedule.getHandle(reconcileScheduleId(config.temporal.taskQueue));
    schedules.push(handle);
    const outcomes = await Promise.all([1, 2, 3].map(() => ensureReconcileSchedule(t.client, config)));
    expect(outcomes.sort()).toEqual(['created', 'unchanged', 'unchanged']);
    expect(await ensureReconcileSchedule(t.client, config)).toBe('unchanged');
    const described = await handle.describe();
    expect(described.spec.intervals).toMatchObject([{ every: 2 * HOUR }]);
    expect(described.action).toMatchObject({ type: 'startWorkflow', workflowType: 'reconcileWorkflow', taskQueue: config.temporal.taskQueue, args: [{ intervalMs: 2 * HOUR, lagMs: HOUR }] });
    expect(described.memo?.description).toContain(config.temporal.taskQueue);
    // Runs due while one is going all wait for it: none is skipped, and no hour left uncompared.
    expect(described.policies.overlap).toBe(ScheduleOverlapPolicy.BUFFER_ALL);

    // Paused by an operator: ensured again with the same settings, it stays paused with its note.
    await handle.pause('operator: investigating');
    expect(await ensureReconcileSchedule(t.client, config)).toBe('unchanged');
    expect((await handle.describe()).state).toMatchObject({ paused: true, note: 'operator: investigating' });
    // A changed interval rolls out to it, still paused.
    expect(await ensureReconcileSchedule(t.client, { ...config, reconcile: { ...config.reconcile, intervalMs: 3 * HOUR } })).toBe('updated');
    const updated = await handle.describe();
    expect(updated.spec.intervals).toMatchObject([{ every: 3 * HOUR }]);
    expect(updated.state.paused).toBe(true);
    // What the Web UI shows of it says so too (a memo would not: an update cannot change one).
    expect((updated.action as { staticDetails?: string }).staticDetails).toMatch(/^Every 3 h: /);
  });

  it('says which hours a shorter lag leaves to no scheduled run, so an operator can compare them by hand', async () => {
    // A task queue of its own, polled by no worker: the triggered run only has to be recorded.
    const taskQueue = `reconcile-gap-${randomUUID()}`;
    const config = t.configWith({ TEMPORAL_TASK_QUEUE: taskQueue, RECONCILE_INTERVAL_MS: String(HOUR), RECONCILE_LAG_MS: String(3 * HOUR) });
    const handle = t.client.schedule.getHandle(reconcileScheduleId(taskQueue));
    schedules.push(handle);
    expect(await ensureReconcileSchedule(t.client, config)).toBe('created');
    await handle.trigger();
    const lastRun = await waitFor('the triggered run to be recorded', async () => (await handle.describe()).info.recentActions.at(-1), 10_000);
    try {
      const told: { from: Date; to: Date }[] = [];
      const shorter = { ...config, reconcile: { ...config.reconcile, lagMs: HOUR } };
      expect(await ensureReconcileSchedule(t.client, shorter, (hours) => told.push(hours))).toBe('updated');
      // The last run (lag 3 h) compared up to three hours before it; the next (lag 1 h) starts two hours later.
      const before = reconcileWindowAt(lastRun.scheduledAt.getTime(), { intervalMs: HOUR, lagMs: 3 * HOUR }).to;
      expect(told).toHaveLength(1);
      expect(told[0]!.from).toEqual(before);
      expect(told[0]!.to.getTime() - before.getTime()).toBeGreaterThanOrEqual(2 * HOUR);
      // Back to the longer lag: its windows overlap what was compared, nothing is skipped.
      const again: unknown[] = [];
      expect(await ensureReconcileSchedule(t.client, config, (hours) => again.push(hours))).toBe('updated');
      expect(again).toEqual([]);
    } finally {
      await t.client.workflow.getHandle(lastRun.action.workflow.workflowId).terminate('test over').catch(() => undefined);
    }
  });

  it('exists once a worker has started; a second worker starts beside it without a second schedule or a warning', async () => {
    const taskQueue = `reconcile-schedule-${randomUUID()}`;
    const connection = await Connection.connect({ address: inject('temporalAddress') });
    const client = new Client({ connection });
    const handle = client.schedule.getHandle(reconcileScheduleId(taskQueue));
    const warnings: unknown[] = [];
    const log = { info: () => undefined, debug: () => undefined, error: (...a: unknown[]) => warnings.push(a), warn: (...a: unknown[]) => warnings.push(a) };
    const workers: WorkerHandle[] = [];
    const runs: Promise<void>[] = [];
    const start = async () => {
      const worker = await createWorker({
        database: t.pool,
        temporal: { address: inject('temporalAddress') },
        taskQueue,
        migrate: false,
        stripe: { apiKey: 'sk_test_reconcile', apiBase: t.stripe.url },
        tuning: { relayCount: 1 },
        log: log as never,
        workflowBundle: workflowBundle(),
        workerOptions: { shutdownGraceTime: '1 second' },
      });
      workers.push(worker);
      runs.push(worker.run());
      await waitFor('the worker running', async () => (await worker.health()).worker === 'running' || undefined, 60_000);
    };
    try {
      await start();
      expect((await handle.describe()).action).toMatchObject({ workflowType: 'reconcileWorkflow', taskQueue });
      await start();
      // The list is eventually consistent: wait for it to show the schedule, then count.
      const listed = await waitFor('the schedule listed', async () => {
        const ids: string[] = [];
        for await (const s of client.schedule.list()) if (s.scheduleId.startsWith(handle.scheduleId)) ids.push(s.scheduleId);
        return ids.length > 0 && ids;
      });
      expect(listed).toEqual([handle.scheduleId]);
      expect(warnings).toEqual([]);
    } finally {
      for (const w of workers) await w.shutdown();
      await Promise.allSettled(runs);
      for await (const wf of client.workflow.list({ query: `TaskQueue = "${taskQueue}" AND ExecutionStatus = "Running"` })) {
        await client.workflow.getHandle(wf.workflowId).terminate('test finished').catch(() => undefined);
      }
      await handle.delete().catch(() => undefined);
      await connection.close();
    }
  });
});

describe('the reconcile activity', () => {
  it('cancelled (its attempt timed out, the worker stopping) stops at the next pair instead of going on through every one', async () => {
    const tenants = [await tenant(), await tenant(), await tenant()];
    for (const tn of tenants) await delivered(tn.id, 2, 3);
    const mock = new MockActivityEnvironment();
    let paced = 0;
    const { reconcileWindow } = createReconcileActivities({
      db: t.pool,
      schema: schemaFor(),
      stripe: createStripeClient(t.config.stripe),
      pace: async () => {
        // The first slot is the meter list's, the second the first pair's: cancelled there.
        if (++paced === 2) mock.cancel();
      },
    });
    const run = mock.run(reconcileWindow, { at: Date.now(), intervalMs: 24 * HOUR, lagMs: 600_000 });
    await expect(run).rejects.toThrow();
    // The meter list, the first pair, then the check that found the cancellation: no more pairs.
    expect(paced).toBe(2);
  });
});

describe('the reconcile activity over an outage', () => {
  it('keeps counts only: the rows of windows holding unsettled events are not loaded into the worker', async () => {
    const tn = await tenant();
    await delivered(tn.id, 1, 3);
    // Forty dead letters in the same hour, as after an outage: unsettled, so listed by a report.
    await t.pool.query(
      `INSERT INTO outbox (tenant_id, event_name, quantity, occurred_at, idempotency_key, usage_id, status, dead_at, last_error_code, last_error_message)
       SELECT $1, 'api_requests', 1, now() - interval '3 hours', $1 || ':dead:' || g, 'dead-' || g, 'dead', now(), 'stripe_unavailable', 'test'
         FROM generate_series(1, 40) g`,
      [tn.id],
    );
    let rowsRead = 0;
    const counting = {
      query: async (...args: Parameters<typeof t.pool.query>) => {
        const result = await (t.pool.query as (...a: unknown[]) => Promise<{ rows: unknown[] }>)(...args);
        rowsRead += result.rows.length;
        return result;
      },
    } as unknown as typeof t.pool;
    const { reconcileWindow } = createReconcileActivities({ db: counting, schema: schemaFor(), stripe: createStripeClient(t.config.stripe), pace: async () => undefined });
    const result = (await new MockActivityEnvironment().run(reconcileWindow, { at: Date.now(), intervalMs: 24 * HOUR, lagMs: 600_000 })) as ReconcileRunResult;
    expect(result.unsettledRows).toBeGreaterThanOrEqual(40);
    // The windows and their counts: a few rows. Listing the dead letters would read forty more.
    expect(rowsRead).toBeLessThan(20);
  });
});
