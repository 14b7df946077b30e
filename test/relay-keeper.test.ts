/**
 * The relay workflows kept running: one terminated or cancelled (an operator's batch operation in
 * the Web UI, `temporal workflow terminate`) is started again by the workers within
 * RELAY_CHECK_EVERY_MS, saying so. Before, the events committed after the last relay closed waited,
 * pending and unexplained, until a worker restarted. The reconcile schedule likewise: one deleted
 * is created again (a paused one is left paused).
 */
import { randomUUID } from 'node:crypto';
import { WorkflowNotFoundError } from '@temporalio/client';
import { expect, it } from 'vitest';
import type { Config } from '../src/config.js';
import { withTransaction } from '../src/db.js';
import { recordUsage } from '../src/outbox/enqueue.js';
import { createStripeClient } from '../src/stripe/client.js';
import { reconcileScheduleId } from '../src/temporal/reconcile-schedule.js';
import { connectTemporal } from '../src/temporal/connection.js';
import { startWorker, type WorkerDeps } from '../src/temporal/worker.js';
import { relayWorkflowId } from '../workflows/shared.js';
import { createTestDb, workflowBundle } from './helpers.js';
import { usePipeline, waitFor } from './hooks.js';

const t = usePipeline({ customers: { acme: 'cus_acme' }, stripe: { meters: ['api_requests'] }, env: { RELAY_COUNT: '2' }, worker: false });

/** A worker whose keeper looks every 500 ms. */
const startKept = (config: Config, log: object, extra: Partial<WorkerDeps> = {}) =>
  startWorker({
    config,
    databaseUrl: t.db.url,
    pool: t.pool,
    stripe: createStripeClient(config.stripe),
    connection: t.pipeline.connection,
    client: t.client,
    workflowBundle: workflowBundle(),
    relayRunForMs: 5_000,
    workerOptions: { shutdownGraceTime: '1 second', shutdownForceTime: '5 seconds' },
    relayCheckEveryMs: 500,
    log: log as never,
    ...extra,
  });

it('relay workflows terminated or cancelled are started again, and the events committed after are billed', async () => {
  const warnings: { workflowId?: string; was?: string; msg: string }[] = [];
  const log = { warn: (fields: object, msg: string) => warnings.push({ ...fields, msg }), info: () => undefined, debug: () => undefined, error: () => undefined };
  const worker = await startKept(t.config, log);
  const billed = async (label: string) => {
    const key = (await withTransaction(t.pool, (c) => recordUsage(c, { usageId: `${label}-${randomUUID()}`, tenantId: 'acme', quantity: 1 }))).entry.idempotencyKey;
    await waitFor(`${key} billed`, async () => t.stripe.events().some((e) => e.identifier === key), 30_000);
  };
  try {
    await billed('before');
    const relays = [0, 1].map((i) => t.client.workflow.getHandle(relayWorkflowId(t.config.temporal.taskQueue, i)));
    const runsBefore = await Promise.all(relays.map(async (h) => (await h.describe()).runId));
    await relays[0]!.terminate('an operator terminated every running workflow');
    await relays[1]!.cancel();
    const closedRuns = relays.map((h, i) => t.client.workflow.getHandle(h.workflowId, runsBefore[i]));
    await waitFor('both relay runs closed', async () => (await Promise.all(closedRuns.map(async (h) => (await h.describe()).status.name))).every((s) => s !== 'RUNNING'), 30_000);

    // Each has a new run (without the keeper: none until a worker restarts, and the events
    // committed after the closed runs' last claims wait, pending).
    await waitFor('both relays running again, each a new run', async () => {
      const now = await Promise.all(relays.map((h) => h.describe()));
      return now.every((d, i) => d.status.name === 'RUNNING' && d.runId !== runsBefore[i]);
    }, 30_000);
    await billed('after');
    const said = warnings.filter((w) => w.msg === 'a relay workflow was not running; started it again');
    expect(said.map((w) => w.was).sort()).toEqual(['CANCELLED', 'TERMINATED']);
  } finally {
    await worker.shutdown();
  }
}, 120_000);

it('a relay workflow paused by an operator is left paused, and said once: not "started again" at every look', async () => {
  const warnings: { workflowId?: string; was?: string; msg: string }[] = [];
  const log = { warn: (fields: object, msg: string) => warnings.push({ ...fields, msg }), info: () => undefined, debug: () => undefined, error: () => undefined };
  const worker = await startKept(t.config, log);
  const workflowId = relayWorkflowId(t.config.temporal.taskQueue, 0);
  const relay = t.client.workflow.getHandle(workflowId);
  try {
    await waitFor('relay 0 running', async () => (await relay.describe()).status.name === 'RUNNING', 30_000);
    const { runId } = await relay.describe();
    await t.client.workflowService.pauseWorkflowExecution({ namespace: t.config.temporal.namespace, workflowId, identity: 'test-operator', reason: 'incident', requestId: randomUUID() });
    try {
      await waitFor('relay 0 paused', async () => (await relay.describe()).status.name === 'PAUSED', 30_000);
      // Several of the keeper's looks (every 500 ms).
      await new Promise((resolve) => setTimeout(resolve, 2_500));
      expect((await relay.describe()).runId).toBe(runId);
      expect(warnings.filter((w) => w.msg === 'a relay workflow was not running; started it again')).toEqual([]);
      expect(warnings.filter((w) => w.msg.startsWith('a relay workflow is paused'))).toEqual([expect.objectContaining({ workflowId })]);
    } finally {
      await t.client.workflowService.unpauseWorkflowExecution({ namespace: t.config.temporal.namespace, workflowId, identity: 'test-operator', reason: 'incident over', requestId: randomUUID() });
    }
    await waitFor('relay 0 running again, the same run', async () => {
      const d = await relay.describe();
      return d.status.name === 'RUNNING' && d.runId === runId;
    }, 30_000);
  } finally {
    await worker.shutdown();
  }
}, 120_000);

it('a reconcile schedule deleted by hand is created again, and one paused is left paused', async () => {
  const warnings: { scheduleId?: string; msg: string }[] = [];
  const log = { warn: (fields: object, msg: string) => warnings.push({ ...fields, msg }), info: () => undefined, debug: () => undefined, error: () => undefined };
  const config = { ...t.config, temporal: { ...t.config.temporal, taskQueue: `keeper-${randomUUID()}` } };
  const handle = t.client.schedule.getHandle(reconcileScheduleId(config.temporal.taskQueue));
  const worker = await startKept(config, log, { keepReconcileSchedule: true });
  const exists = async () => handle.describe().then(() => true, () => false);
  try {
    // Never made (this worker was started without launchWorker's ensure): the keeper makes it.
    await waitFor('the schedule created', exists, 30_000);
    await handle.delete();
    await waitFor('the schedule created again', exists, 30_000);
    expect(warnings.filter((w) => w.msg === 'the reconcile schedule was gone; created it again').map((w) => w.scheduleId)).toEqual([handle.scheduleId, handle.scheduleId]);
    await handle.pause('operator: holding reconciliation');
    await new Promise((resolve) => setTimeout(resolve, 2_000));
    expect((await handle.describe()).state).toMatchObject({ paused: true, note: 'operator: holding reconciliation' });
    expect(warnings.filter((w) => w.msg.includes('schedule'))).toHaveLength(2);
  } finally {
    await worker.shutdown();
    await handle.delete().catch(() => undefined);
    for await (const wf of t.client.workflow.list({ query: `TaskQueue = "${config.temporal.taskQueue}" AND ExecutionStatus = "Running"` })) {
      await t.client.workflow.getHandle(wf.workflowId).terminate('test finished').catch(() => undefined);
    }
  }
}, 120_000);

it("a second deployment (another database) on this task queue is refused before it polls; one that starts while this one's relays are closed is said by the keeper", async () => {
  const errors: { workflowId?: string; msg: string }[] = [];
  const log = { warn: () => undefined, info: () => undefined, debug: () => undefined, error: (fields: object, msg: string) => errors.push({ ...fields, msg }) };
  const config = { ...t.config, temporal: { ...t.config.temporal, taskQueue: `shared-${randomUUID()}` } };
  const ours = (await t.pool.query<{ id: string }>('SELECT id FROM billing_outbox.deployment')).rows[0]!.id;
  const other = await createTestDb();
  const otherDeps = { databaseUrl: other.url, pool: other.pool };
  const worker = await startKept(config, log);
  try {
    // With a relay more than this deployment runs: refused before it starts any.
    const refused = startKept({ ...config, relay: { ...config.relay, count: 3 } }, log, otherDeps);
    await expect(refused).rejects.toThrow(`TEMPORAL_TASK_QUEUE "${config.temporal.taskQueue}" in the namespace "${config.temporal.namespace}" is another billing-outbox deployment's`);
    await expect(refused).rejects.toThrow(`started for the deployment ${ours}`);
    await expect(t.client.workflow.getHandle(relayWorkflowId(config.temporal.taskQueue, 2)).describe()).rejects.toBeInstanceOf(WorkflowNotFoundError);
    // The relays are still this deployment's, and still running.
    const relay = t.client.workflow.getHandle(relayWorkflowId(config.temporal.taskQueue, 0));
    expect((await relay.describe()).memo).toEqual({ billingOutboxDeployment: ours });

    // Closed by an operator, then the other deployment starts first and takes the task queue: this one's keeper says so.
    const relays = [relay, t.client.workflow.getHandle(relayWorkflowId(config.temporal.taskQueue, 1))];
    const runs = await Promise.all(relays.map(async (h) => (await h.describe()).runId));
    await Promise.all(relays.map((h) => h.terminate('an operator terminated every running workflow')));
    await waitFor('relays closed', async () => (await Promise.all(relays.map(async (h, i) => (await t.client.workflow.getHandle(h.workflowId, runs[i]).describe()).status.name))).every((s) => s !== 'RUNNING'), 30_000);
    // Its own connection: one connection polls a task queue with one worker.
    const own = await connectTemporal(config.temporal);
    try {
      const intruder = await startKept(config, { warn: () => undefined, info: () => undefined, debug: () => undefined, error: () => undefined }, { ...otherDeps, connection: own.connection, client: own.client, relayCheckEveryMs: 60_000 });
      try {
        await waitFor('the keeper said it', async () => errors.some((e) => e.workflowId === relay.workflowId && e.msg.startsWith("a relay workflow of this task queue is another deployment's")), 30_000);
      } finally {
        await intruder.shutdown();
      }
    } finally {
      await own.close?.();
    }
  } finally {
    await worker.shutdown();
    for await (const wf of t.client.workflow.list({ query: `TaskQueue = "${config.temporal.taskQueue}" AND ExecutionStatus = "Running"` })) {
      await t.client.workflow.getHandle(wf.workflowId).terminate('test finished').catch(() => undefined);
    }
    await other.drop();
  }
}, 120_000);
