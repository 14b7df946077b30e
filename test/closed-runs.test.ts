/**
 * A row whose run has closed without delivering it must not stay `dispatched` (in flight for good,
 * holding its lane, out of `retry`'s reach): terminated runs are found by the closed-run sweep,
 * closed runs met at start by the relay, cancelled runs mark their row themselves. Each ends dead
 * with the reason, and `retry` reopens it with a new run that bills it once.
 */
import { randomUUID } from 'node:crypto';
import net from 'node:net';
import { Client as TemporalClient, Connection, type Client } from '@temporalio/client';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { Config } from '../src/config.js';
import { withTransaction } from '../src/db.js';
import { LocalStripe } from '../src/embedded/stripe/server.js';
import { sweepClosedRuns } from '../src/ops/closed-runs.js';
import { rebillEvent } from '../src/ops/rebill.js';
import { DeadLetterRetrier, type RetryResult } from '../src/ops/retry.js';
import { outboxStatus } from '../src/ops/status.js';
import { recordUsage } from '../src/outbox/enqueue.js';
import { idempotencyKeyFor } from '../src/outbox/keys.js';
import { createStripeClient } from '../src/stripe/client.js';
import { startWorker, type ClosedRunSweepOptions } from '../src/temporal/worker.js';
import { ErrorTypes, OutboxErrorKey, OutboxStatusKey, stateQuery, TemporalErrorCodes } from '../workflows/shared.js';
import { Context } from '@temporalio/activity';
import { ApplicationFailure } from '@temporalio/common';
import { Worker } from '@temporalio/worker';
import { deliveredLateNotice } from '../activities/index.js';
import { beginAttempt, storedIdentifier, undoAttempt } from '../src/outbox/sql/delivery.js';
import { reopenDeadLetter } from '../src/outbox/sql/operator.js';
import { markStaleDispatchedDead } from '../src/outbox/sql/sweep.js';
import { pauseRelays, resumeRelays } from '../src/outbox/sql/relay.js';
import { SAFE_RESEND_WINDOW_MS } from '../src/stripe/rules.js';
import { addCustomer, createTestDb, startsAnswerLost, startTestPipeline, testConfig, waitFor, workflowBundle, type TestDb, type TestPipeline } from './helpers.js';
import { schemaFor } from '../src/outbox/sql/schema.js';

let db: TestDb;
let stripe: LocalStripe;
let config: Config;
let pipeline: TestPipeline;
let client: Client;
let retrier: DeadLetterRetrier;

beforeAll(async () => {
  db = await createTestDb();
  stripe = await LocalStripe.start({ meters: ['api_requests'], customers: ['cus_acme'] });
  await addCustomer(db.pool, 'acme', 'cus_acme');
  // Enough attempts that an event keeps retrying through the outages below instead of dying.
  // A run cancelled or terminated mid-call leaves its (customer, meter) lease to expire (the Stripe
  // timeout plus 5 s) before the reopened run may call: a short timeout keeps that wait short.
  config = testConfig({ STRIPE_API_BASE: stripe.url, STRIPE_API_KEY: 'sk_test_closed_runs', RETRY_MAXIMUM_ATTEMPTS: '1000', STRIPE_TIMEOUT_MS: '2000' });
  pipeline = await startTestPipeline({ db, config });
  client = pipeline.client;
  retrier = new DeadLetterRetrier({ db: db.pool, schema: schemaFor(), client, config, now: Date.now });
});

afterAll(async () => {
  await pipeline?.stop();
  await stripe?.close();
  await db?.drop();
});

async function enqueue(quantity: number): Promise<string> {
  const r = await withTransaction(db.pool, (c) => recordUsage(c, { usageId: randomUUID(), tenantId: 'acme', quantity }));
  return r.entry.idempotencyKey;
}

async function row(key: string) {
  const { rows } = await db.pool.query('SELECT * FROM outbox WHERE idempotency_key = $1', [key]);
  return rows[0];
}

const waitStatus = (key: string, status: string, timeoutMs = 30_000) =>
  waitFor(`${key} to be ${status}`, async () => ((await row(key))?.status === status ? row(key) : undefined), timeoutMs);
const eventsFor = (key: string) => stripe.events().filter((e) => e.identifier === key);
const sweep = () => sweepClosedRuns({ db: db.pool, schema: schemaFor(), client, taskQueue: config.temporal.taskQueue }, { staleAfterMs: 0, batchSize: 100 });

/**
 * The pipeline's worker makes way (one worker per task queue on a connection) for one whose
 * closed-run sweep runs as `sweep` says (the default: a pass a minute); the pipeline stops it at the end.
 */
async function sweepingWorker(sweep: Partial<ClosedRunSweepOptions>): Promise<void> {
  for (const w of pipeline.workers.splice(0)) await w.shutdown();
  const sweeping = await startWorker({
    config,
    databaseUrl: db.url,
    pool: db.pool,
    stripe: createStripeClient(config.stripe),
    connection: pipeline.connection,
    client,
    workflowBundle: workflowBundle(),
    relayRunForMs: 5_000,
    workerOptions: { shutdownGraceTime: '1 second', shutdownForceTime: '5 seconds' },
    closedRunSweep: sweep,
  });
  pipeline.workers.push(sweeping);
}

/** A usage event whose delivery is retrying against a Stripe that refuses every connection. */
async function inFlightDuringOutage(quantity: number): Promise<string> {
  stripe.refuseFor(600);
  const key = await enqueue(quantity);
  await waitFor(`${key} attempted`, async () => {
    const r = await row(key);
    return r?.status === 'dispatched' && r.attempt_count >= 1;
  });
  return key;
}

/** A port nothing listens on (found free, then let go). */
function closedPort(): Promise<number> {
  return new Promise((resolve) => {
    const probe = net.createServer().listen(0, '127.0.0.1', () => {
      const { port } = probe.address() as net.AddressInfo;
      probe.close(() => resolve(port));
    });
  });
}

// Before the worker below that sweeps every 200 ms: these sweep by hand, and judge what they find.
it('retry from a CLI configured with a task queue no worker polls says so: the run it starts would wait there unseen', async () => {
  // A dead letter with no run (gone past retention): retry starts a new one.
  const key = await withTransaction(db.pool, async (c) => {
    const { entry } = await recordUsage(c, { usageId: randomUUID(), tenantId: 'acme', quantity: 1 });
    await c.query(`UPDATE outbox SET status = 'dead', last_error_code = 'http_500', last_error_message = 'x', dead_at = now() WHERE idempotency_key = $1`, [entry.idempotencyKey]);
    return entry.idempotencyKey;
  });
  const elsewhere = { ...config, temporal: { ...config.temporal, taskQueue: `nobody-polls-${randomUUID().slice(0, 8)}` } };
  const lost = new DeadLetterRetrier({ db: db.pool, schema: schemaFor(), client, config: elsewhere, now: Date.now });
  try {
    const result = await lost.retryKey(key, { force: false, requestedBy: 'test' });
    expect(result.outcome).toBe('reopened');
    expect(result.message).toContain(`WARNING: no worker polls task queue "${elsewhere.temporal.taskQueue}"`);
    // From the workers' own configuration, no warning.
    await client.workflow.getHandle(key).terminate('test over');
    await waitFor('the row dead again', async () => {
      await sweep();
      return (await row(key)).status === 'dead';
    });
    const again = await retrier.retryKey(key, { force: false, requestedBy: 'test' });
    expect(again.outcome).toBe('reopened');
    expect(again.message).not.toContain('WARNING');
    await waitStatus(key, 'sent');
  } finally {
    await client.workflow.getHandle(key).terminate('test over').catch(() => undefined);
  }
});

it('retry --all-dead with Temporal away stops after a few dead letters in a row instead of failing each in turn, and says so', async () => {
  const tenant = `away-${randomUUID().slice(0, 8)}`;
  await addCustomer(db.pool, tenant, 'cus_acme');
  await withTransaction(db.pool, async (c) => {
    for (let i = 0; i < 20; i++) {
      const { entry } = await recordUsage(c, { usageId: randomUUID(), tenantId: tenant, quantity: 1 });
      await c.query(`UPDATE outbox SET status = 'dead', last_error_code = 'http_500', last_error_message = 'x', dead_at = now() WHERE idempotency_key = $1`, [entry.idempotencyKey]);
    }
  });
  // Nothing listens there; without the client's own retries, each call fails at once.
  const away = new TemporalClient({ connection: Connection.lazy({ address: `127.0.0.1:${await closedPort()}`, interceptors: [] }) });
  const results: RetryResult[] = [];
  const lost = new DeadLetterRetrier({ db: db.pool, schema: schemaFor(), client: away, config, now: Date.now });
  const ended = await lost.retryAllDead({ tenantId: tenant }, { force: false, requestedBy: 'test' }, (r) => results.push(r));
  expect(ended.stopped).toMatch(/^Temporal did not answer for 8 dead letters in a row/);
  expect(results.length).toBeGreaterThanOrEqual(8);
  expect(results.length).toBeLessThan(20);
  expect(results.every((r) => r.outcome === 'failed')).toBe(true);
  // Nothing was reopened: every one is still a dead letter, for the same command to go on with.
  const { rows } = await db.pool.query(`SELECT count(*)::int AS n FROM outbox WHERE tenant_id = $1 AND status = 'dead'`, [tenant]);
  expect(rows[0].n).toBe(20);
});

it("retry whose start's answer is lost after the server started the run: the row goes on with that run (not dead again), billed once", async () => {
  const key = await withTransaction(db.pool, async (c) => {
    const { entry } = await recordUsage(c, { usageId: randomUUID(), tenantId: 'acme', quantity: 2 });
    await c.query(`UPDATE outbox SET status = 'dead', last_error_code = 'http_500', last_error_message = 'x', dead_at = now() WHERE idempotency_key = $1`, [entry.idempotencyKey]);
    return entry.idempotencyKey;
  });
  const lost = new DeadLetterRetrier({ db: db.pool, schema: schemaFor(), client: startsAnswerLost(client.connection), config, now: Date.now });
  expect(await lost.retryKey(key, { force: false, requestedBy: 'test' })).toMatchObject({ outcome: 'reopened' });
  expect((await row(key)).status).not.toBe('dead');
  await waitStatus(key, 'sent');
  expect(eventsFor(key)).toHaveLength(1);
});

describe('a sweep pass', () => {
  /** `n` rows dispatched long ago with no run at all, written as such in one transaction (no relay sees them pending). */
  async function dispatchedWithoutRuns(n: number): Promise<string[]> {
    return withTransaction(db.pool, async (c) => {
      const keys: string[] = [];
      for (let i = 0; i < n; i++) keys.push((await recordUsage(c, { usageId: randomUUID(), tenantId: 'acme', quantity: 1 })).entry.idempotencyKey);
      await c.query(`UPDATE outbox SET status = 'dispatched', updated_at = now() - interval '1 hour' WHERE idempotency_key = ANY($1::text[])`, [keys]);
      return keys;
    });
  }

  it('stops after three runs it cannot describe (Temporal away), and the next pass starts where it began; a stopping worker ends it between rows', async () => {
    const keys = await dispatchedWithoutRuns(6);
    const afterId = Number((await row(keys[0]!)).id) - 1;
    const opts = { staleAfterMs: 60_000, batchSize: 100, afterId };
    // A Temporal nothing answers for (and without the client's own retries, each call fails at once).
    const away = new TemporalClient({ connection: Connection.lazy({ address: `127.0.0.1:${await closedPort()}`, interceptors: [] }) });
    expect(await sweepClosedRuns({ db: db.pool, schema: schemaFor(), client: away, taskQueue: config.temporal.taskQueue }, opts)).toEqual({ checked: 3, closed: 0, deadLetters: 0, nextAfterId: afterId });
    const stopping = AbortSignal.abort();
    expect(await sweepClosedRuns({ db: db.pool, schema: schemaFor(), client, taskQueue: config.temporal.taskQueue }, { ...opts, signal: stopping })).toEqual({ checked: 0, closed: 0, deadLetters: 0, nextAfterId: afterId });
    for (const key of keys) expect((await row(key)).status).toBe('dispatched');
    // Temporal back: the pass goes through them all (none has a run: each is dead).
    expect(await sweepClosedRuns({ db: db.pool, schema: schemaFor(), client, taskQueue: config.temporal.taskQueue }, opts)).toMatchObject({ checked: 6, closed: 6 });
    // Out of the way of the tests below, which count and retry this tenant's workflow_closed dead letters.
    await db.pool.query('DELETE FROM outbox WHERE idempotency_key = ANY($1::text[])', [keys]);
  });
});

describe('a key whose workflow id is taken by a run on another task queue (another deployment sharing the namespace)', () => {
  it('the relay makes the row dead saying so, and neither retry nor rebill signals that run', async () => {
    const usageId = randomUUID();
    const key = idempotencyKeyFor('acme', usageId);
    const otherQueue = `other-deployment-${randomUUID().slice(0, 8)}`;
    // The other deployment's run under the same id, open (no worker polls its queue here).
    const foreign = await client.workflow.start('usageWorkflow', { taskQueue: otherQueue, workflowId: key, args: [{ key, tenantId: 'acme', retry: config.retry }] });
    try {
      await withTransaction(db.pool, (c) => recordUsage(c, { usageId, tenantId: 'acme', quantity: 2 }));
      const dead = await waitStatus(key, 'dead');
      expect(dead.last_error_message).toContain(`task queue "${otherQueue}", not this deployment's`);
      const retried = await retrier.retryKey(key, { force: false, requestedBy: 'test' });
      expect(retried).toMatchObject({ outcome: 'refused', message: expect.stringContaining(otherQueue) });
      // And names its own, for an operator whose CLI runs without the workers' TEMPORAL_TASK_QUEUE.
      expect(retried.message).toContain(`this command uses task queue ${JSON.stringify(config.temporal.taskQueue)}`);
      // That run was left alone: still open, never signalled.
      const described = await foreign.describe();
      expect(described.status.name).toBe('RUNNING');
      const signals = ((await foreign.fetchHistory()).events ?? []).filter((e) => e.workflowExecutionSignaledEventAttributes);
      expect(signals).toEqual([]);
      expect(eventsFor(key)).toEqual([]);

      // Nor does rebill signal it, for a row Stripe reported as rejected.
      await db.pool.query(`UPDATE outbox SET status = 'rejected_async', rejected_at = now(), updated_at = now() WHERE idempotency_key = $1`, [key]);
      const before = await row(key);
      const rebilled = await rebillEvent({ db: db.pool, schema: schemaFor(), client, config, now: Date.now }, key, { actor: 'test' });
      expect(rebilled).toMatchObject({ outcome: 'refused', message: expect.stringContaining(`open run on task queue "${otherQueue}", not this deployment's`) });
      expect(await row(key)).toEqual(before);
      expect(((await foreign.fetchHistory()).events ?? []).filter((e) => e.workflowExecutionSignaledEventAttributes)).toEqual([]);
    } finally {
      await foreign.terminate('test over');
      // Out of the way of the tests below, which count this tenant's workflow_closed dead letters.
      await db.pool.query('DELETE FROM outbox WHERE idempotency_key = $1', [key]);
    }
  });
});

it("retry of a dead letter whose run closes between the command's look at it and its signal (its dead-letter wait ending): reopened with a new run, not 'failed'", async () => {
  stripe.failNext(1, 400, { message: 'refused once' });
  const { entry } = await withTransaction(db.pool, (c) => recordUsage(c, { usageId: randomUUID(), tenantId: 'acme', quantity: 3 }));
  const key = entry.idempotencyKey;
  await waitStatus(key, 'dead');
  // The run closes just after the command described it open: here, as it asks the run's state.
  const closing = new TemporalClient({
    connection: client.connection,
    namespace: config.temporal.namespace,
    interceptors: {
      workflow: [
        {
          async query(input, next) {
            await client.workflow.getHandle(input.workflowExecution.workflowId).terminate('its dead-letter wait ended');
            return next(input);
          },
        },
      ],
    },
  });
  const racing = new DeadLetterRetrier({ db: db.pool, schema: schemaFor(), client: closing, config, now: Date.now });
  expect(await racing.retryKey(key, { force: false, requestedBy: 'test' })).toMatchObject({ outcome: 'reopened' });
  await waitStatus(key, 'sent');
  expect(eventsFor(key)).toHaveLength(1);
});

describe('a key whose workflow id was taken by a run on another task queue that has closed (TEMPORAL_TASK_QUEUE changed, its old runs terminated)', () => {
  it('the row is dead saying how that run closed, not to terminate it, and retry starts ours: billed once', async () => {
    const usageId = randomUUID();
    const key = idempotencyKeyFor('acme', usageId);
    const oldQueue = `old-queue-${randomUUID().slice(0, 8)}`;
    const old = await client.workflow.start('usageWorkflow', { taskQueue: oldQueue, workflowId: key, args: [{ key, tenantId: 'acme', retry: config.retry }] });
    await old.terminate('the old queue retired');
    await withTransaction(db.pool, (c) => recordUsage(c, { usageId, tenantId: 'acme', quantity: 2 }));
    const dead = await waitStatus(key, 'dead');
    expect(dead.last_error_code).toBe('workflow_closed');
    expect(dead.last_error_message).toContain(`task queue "${oldQueue}", not this deployment's, which terminated`);
    expect(dead.last_error_message).not.toContain('terminate it');
    expect(await retrier.retryKey(key, { force: false, requestedBy: 'test' })).toMatchObject({ outcome: 'reopened' });
    await waitStatus(key, 'sent');
    expect(eventsFor(key)).toHaveLength(1);
  });

  it("one that completed there (another deployment delivered its own event under the key) is not taken for ours: the row is dead naming that queue, and retry sends ours", async () => {
    const usageId = randomUUID();
    const key = idempotencyKeyFor('acme', usageId);
    const otherQueue = `other-deployment-${randomUUID().slice(0, 8)}`;
    const other = await Worker.create({
      connection: pipeline.connection,
      taskQueue: otherQueue,
      workflowBundle: workflowBundle(),
      activities: { async deliverUsage() { return { outcome: 'sent', attempts: 1 }; }, async markDead() { return { attempts: 0 }; }, async markReopened() {} },
    });
    await other.runUntil(client.workflow.execute('usageWorkflow', { taskQueue: otherQueue, workflowId: key, args: [{ key, tenantId: 'acme', retry: config.retry }] }));
    await withTransaction(db.pool, (c) => recordUsage(c, { usageId, tenantId: 'acme', quantity: 4 }));
    const dead = await waitStatus(key, 'dead');
    expect(dead.last_error_message).toContain(`task queue "${otherQueue}", not this deployment's, which completed`);
    expect(dead.last_error_message).not.toContain('put back by hand');
    // A day later (past the resend window counted from that run's close), still ours to send: it never was.
    const later = new DeadLetterRetrier({ db: db.pool, schema: schemaFor(), client, config, now: () => Date.now() + 25 * 3_600_000 });
    expect(await later.retryKey(key, { force: false, requestedBy: 'test' })).toMatchObject({ outcome: 'reopened' });
    await waitStatus(key, 'sent');
    expect(eventsFor(key)).toHaveLength(1);
  });
});

describe('a row whose run has closed', () => {
  it('terminated during a Stripe outage: the sweep makes it dead (workflow_closed), retry --all-dead reopens it, billed once', async () => {
    const key = await inFlightDuringOutage(7);
    try {
      // Its run is open: the sweep leaves it alone.
      expect((await sweep()).closed).toBe(0);
      expect((await row(key)).status).toBe('dispatched');

      await client.workflow.getHandle(key).terminate('operator terminated it from the Web UI');
      await waitFor('the run to be terminated', async () => (await client.workflow.getHandle(key).describe()).status.name === 'TERMINATED');
      expect((await sweep()).closed).toBe(1);
      const dead = await row(key);
      expect(dead).toMatchObject({ status: 'dead', last_error_code: TemporalErrorCodes.workflowClosed });
      expect(dead.last_error_message).toMatch(/^its workflow run terminated at .* while the row was dispatched/);
      expect((await outboxStatus(db.pool, schemaFor())).deadByErrorCode).toContainEqual({ code: TemporalErrorCodes.workflowClosed, count: 1 });
    } finally {
      stripe.heal();
    }

    const results: RetryResult[] = [];
    await retrier.retryAllDead({ tenantId: 'acme', errorCode: TemporalErrorCodes.workflowClosed }, { force: false, requestedBy: 'test' }, (r) => results.push(r));
    expect(results).toEqual([expect.objectContaining({ key, outcome: 'reopened' })]);
    await waitStatus(key, 'sent');
    expect(eventsFor(key)).toHaveLength(1);
  });

  it("terminated, its row restored with no attempt (a backup older than them): the run's start bounds its first attempt; past the resend window retry is refused, within it the row keeps that start", async () => {
    const key = await inFlightDuringOutage(7);
    try {
      await client.workflow.getHandle(key).terminate('operator terminated it from the Web UI');
      await waitFor('the run to be terminated', async () => (await client.workflow.getHandle(key).describe()).status.name === 'TERMINATED');
      expect((await sweep()).closed).toBe(1);
    } finally {
      stripe.heal();
    }
    await db.pool.query('UPDATE outbox SET first_attempted_at = NULL, attempt_count = 0 WHERE idempotency_key = $1', [key]);
    const { runId, startTime } = await client.workflow.getHandle(key).describe();
    // A day later: its attempts may have reached Stripe, whose dedup has lapsed since: not resent unforced.
    const aDayLater = new DeadLetterRetrier({ db: db.pool, schema: schemaFor(), client, config, now: () => Date.now() + 24 * 3_600_000 });
    const refused = await aDayLater.retryKey(key, { force: false, requestedBy: 'test' });
    expect(refused).toMatchObject({ outcome: 'refused', message: expect.stringContaining('its row records no attempt, but its workflow run (TERMINATED') });
    expect(refused.message).toContain('billing-outbox reconcile');
    expect((await client.workflow.getHandle(key).describe()).runId).toBe(runId);
    expect((await row(key)).status).toBe('dead');

    expect(await retrier.retryKey(key, { force: false, requestedBy: 'test' })).toMatchObject({ outcome: 'reopened' });
    await waitStatus(key, 'sent');
    expect(eventsFor(key)).toHaveLength(1);
    expect((await row(key)).first_attempted_at?.getTime()).toBe(startTime.getTime());
  });

  it('put back to pending after its run completed: dead (workflow_closed, completed), not dispatched; retry resends under the same identifier, one event', async () => {
    const key = await enqueue(3);
    await waitStatus(key, 'sent');
    await waitFor('the run to complete', async () => (await client.workflow.getHandle(key).describe()).status.name === 'COMPLETED');
    // The runbook's "set it back to pending", or a database restored from a backup older than Temporal's state.
    await db.pool.query(`UPDATE outbox SET status = 'pending', sent_at = NULL, updated_at = now() WHERE idempotency_key = $1`, [key]);

    const dead = await waitStatus(key, 'dead');
    expect(dead.last_error_code).toBe(TemporalErrorCodes.workflowClosed);
    expect(dead.last_error_message).toMatch(/^its workflow run completed, yet the row was not delivered/);

    // A day later, with no first attempt on the row (a backup from before it): the run is the only
    // clock left, and a resend past Stripe's dedup could bill twice: refused, unforced.
    await db.pool.query('UPDATE outbox SET first_attempted_at = NULL WHERE idempotency_key = $1', [key]);
    const { runId } = await client.workflow.getHandle(key).describe();
    const aDayLater = new DeadLetterRetrier({ db: db.pool, schema: schemaFor(), client, config, now: () => Date.now() + 24 * 3_600_000 });
    expect(await aDayLater.retryKey(key, { force: false, requestedBy: 'test' })).toMatchObject({ outcome: 'refused', message: expect.stringContaining('reconcile first') });
    expect((await client.workflow.getHandle(key).describe()).runId).toBe(runId);
    expect((await row(key)).status).toBe('dead');

    const { startTime } = await client.workflow.getHandle(key).describe();
    expect(await retrier.retryKey(key, { force: false, requestedBy: 'test' })).toMatchObject({ outcome: 'reopened' });
    await waitStatus(key, 'sent');
    // Stripe already had it: the resend was told "already exists", which is delivered.
    expect(eventsFor(key)).toHaveLength(1);
    // The run's start (its first attempt came after it) is kept as the row's first attempt:
    // PostgreSQL's resend guard counts the window from there by its own clock, whatever the clock of
    // the operator's machine said.
    expect((await row(key)).first_attempted_at?.getTime()).toBe(startTime.getTime());
  });

  it("a dead letter whose row was put back to dispatched while its run waits (the run's mark lost in a failover, a rebill that never reached it): the sweep makes it dead with the run's error, and retry reopens it in that run, billed once", async () => {
    stripe.failNext(1, 400, { code: 'resource_missing', message: 'No such customer' });
    const key = await enqueue(4);
    await waitStatus(key, 'dead');
    await waitFor('the run listed dead', async () => (await client.workflow.getHandle(key).describe()).typedSearchAttributes.get(OutboxStatusKey) === 'dead');
    const { runId, startTime } = await client.workflow.getHandle(key).describe();
    // The row as a replica without the dead mark's commit has it, or a backup from before its first
    // attempt: in flight, for relays and retry alike, with no attempt recorded.
    await db.pool.query(`UPDATE outbox SET status = 'dispatched', dead_at = NULL, first_attempted_at = NULL, attempt_count = 0, updated_at = now() - interval '10 minutes' WHERE idempotency_key = $1`, [key]);

    expect(await sweep()).toMatchObject({ closed: 0, deadLetters: 1 });
    const dead = await row(key);
    expect(dead).toMatchObject({ status: 'dead', last_error_code: 'resource_missing' });
    expect(dead.last_error_message).toMatch(/^its workflow run waits as a dead letter \(resource_missing\) while the row said dispatched/);
    // The run's start bounds the attempt the row lost: a day later retry is refused (a resend could
    // be past Stripe's dedup), not signalled on a row that says nothing was ever sent.
    expect(dead.first_attempted_at?.getTime()).toBe(startTime.getTime());
    // Counted as an attempt, as a reopen's stamp is: a later try taken back cannot clear it.
    expect(dead.attempt_count).toBe(1);
    const aDayLater = new DeadLetterRetrier({ db: db.pool, schema: schemaFor(), client, config, now: () => Date.now() + 24 * 3_600_000 });
    expect(await aDayLater.retryKey(key, { force: false, requestedBy: 'test' })).toMatchObject({ outcome: 'refused' });
    // An open run still delivering is left alone, as before.
    expect(await sweep()).toMatchObject({ deadLetters: 0 });

    expect(await retrier.retryKey(key, { force: false, requestedBy: 'test' })).toMatchObject({ outcome: 'signalled' });
    await waitStatus(key, 'sent');
    expect(eventsFor(key)).toHaveLength(1);
    expect((await client.workflow.getHandle(key).describe()).runId).toBe(runId);
  });

  it("the sweep's stamp on a row that records no attempt keeps the identifier the run sent (STRIPE_IDENTIFIER_NAMESPACE), as a reopen's does; a row that records one keeps its own", async () => {
    // Rows no relay takes meanwhile: the statement alone is judged.
    await pauseRelays(db.pool, schemaFor(), 'test', 'the sweep statement alone');
    try {
      const [restored, attempted] = [await enqueue(1), await enqueue(2)];
      await db.pool.query(`UPDATE outbox SET status = 'dispatched', updated_at = now() - interval '10 minutes' WHERE idempotency_key = ANY($1)`, [[restored, attempted]]);
      await db.pool.query(`UPDATE outbox SET first_attempted_at = now() - interval '1 hour', attempt_count = 3 WHERE idempotency_key = $1`, [attempted]);
      const by = new Date(Date.now() - 2 * 3_600_000);
      for (const key of [restored, attempted]) {
        const { id } = await row(key);
        expect(await markStaleDispatchedDead(db.pool, schemaFor(), id, { staleAfterMs: 60_000, code: 'http_500', message: 'x', firstAttempt: { by, identifier: storedIdentifier(key, 0, 'east') } })).toBe(true);
      }
      expect(await row(restored)).toMatchObject({ status: 'dead', first_attempted_at: by, attempt_count: 1, stripe_identifier: storedIdentifier(restored, 0, 'east') });
      expect(await row(attempted)).toMatchObject({ status: 'dead', attempt_count: 3, stripe_identifier: null });
      expect((await row(attempted)).first_attempted_at.getTime()).toBeGreaterThan(by.getTime());
    } finally {
      await resumeRelays(db.pool, schemaFor(), 'test');
    }
  });

  it('a dead letter that never reached Stripe (no meter: no attempt), its run closed after its wait: retry reopens it unforced days later, its run no bound', async () => {
    const key = (await withTransaction(db.pool, (c) => recordUsage(c, { usageId: randomUUID(), tenantId: 'acme', quantity: 1, eventName: 'no_such_meter' }))).entry.idempotencyKey;
    const dead = await waitStatus(key, 'dead');
    expect(dead).toMatchObject({ last_error_code: 'no_meter', first_attempted_at: null });
    // Its dead-letter wait over (DEAD_LETTER_OPEN_DAYS), as a terminated run is.
    await client.workflow.getHandle(key).terminate('its dead-letter wait is over');
    const aWeekLater = new DeadLetterRetrier({ db: db.pool, schema: schemaFor(), client, config, now: () => Date.now() + 8 * 24 * 3_600_000 });
    expect(await aWeekLater.retryKey(key, { force: false, requestedBy: 'test' })).toMatchObject({ outcome: 'reopened' });
  });

  it("restored with no attempt, its latest run one that was told of an earlier first attempt (a retry's, or continued as new): the window counts from that attempt, not the run's start", async () => {
    const key = await enqueue(2);
    await waitStatus(key, 'sent');
    await waitFor('the run to complete', async () => (await client.workflow.getHandle(key).describe()).status.name === 'COMPLETED');
    // A later run of the key, told the event was first attempted 23.5 h ago; it finds the row sent.
    const firstAttemptedAt = Date.now() - 23.5 * 3_600_000;
    await client.workflow.execute('usageWorkflow', {
      taskQueue: config.temporal.taskQueue,
      workflowId: key,
      workflowIdReusePolicy: 'ALLOW_DUPLICATE',
      args: [{ key, tenantId: 'acme', retry: config.retry, firstAttemptedAt }],
    });
    await db.pool.query(`UPDATE outbox SET status = 'dead', sent_at = NULL, first_attempted_at = NULL, last_error_code = $2, dead_at = now() WHERE idempotency_key = $1`, [
      key,
      TemporalErrorCodes.workflowClosed,
    ]);
    // An hour from now the run's start is well inside the window; the first attempt it was told of is not.
    const anHourLater = new DeadLetterRetrier({ db: db.pool, schema: schemaFor(), client, config, now: () => Date.now() + 3_600_000 });
    const refused = await anHourLater.retryKey(key, { force: false, requestedBy: 'test' });
    expect(refused).toMatchObject({ outcome: 'refused', message: expect.stringContaining('reconcile first') });
    expect(refused.message).toContain(`may have reached Stripe from ${new Date(firstAttemptedAt).toISOString()}`);
    expect((await row(key)).status).toBe('dead');
  });

  it("reopened after its run completed, a row restored with no attempt keeps the run's close as its first attempt, even when the new run's attempt is taken back", async () => {
    const key = await enqueue(1);
    await waitStatus(key, 'sent');
    const closedAt = new Date(Date.now() - 3_600_000);
    // A backup from before the first attempt: no attempt, no stamp; found dead as workflow_closed.
    await db.pool.query(`UPDATE outbox SET status = 'dead', sent_at = NULL, attempt_count = 0, first_attempted_at = NULL, last_error_code = $2 WHERE idempotency_key = $1`, [
      key,
      TemporalErrorCodes.workflowClosed,
    ]);
    expect(await reopenDeadLetter(db.pool, schemaFor(), key, closedAt)).toBeDefined();
    // The new run's attempt, then taken back (the pace, a lapsed lease, a refused key), as the activity does.
    const begun = await beginAttempt(db.pool, schemaFor(), key, { workflowId: key, safeWindowMs: SAFE_RESEND_WINDOW_MS, force: false });
    await undoAttempt(db.pool, schemaFor(), key, { wasFirst: begun.row!.attempt_count === 1 });
    // Still stamped: PostgreSQL's resend guard keeps counting the 24 h from the close.
    expect((await row(key)).first_attempted_at?.getTime()).toBe(closedAt.getTime());
    await db.pool.query(`UPDATE outbox SET status = 'sent', sent_at = now() WHERE idempotency_key = $1`, [key]);
  });

  it('cancelled: the workflow marks its row dead (workflow_cancelled) before it ends; retry reopens it, billed once', async () => {
    const key = await inFlightDuringOutage(5);
    try {
      const handle = client.workflow.getHandle(key);
      await handle.cancel();
      const dead = await waitStatus(key, 'dead');
      expect(dead.last_error_code).toBe(TemporalErrorCodes.workflowCancelled);
      await waitFor('the run to be cancelled', async () => (await handle.describe()).status.name === 'CANCELLED');
      // Listed in the Web UI with the dead letters, by its code.
      const attributes = (await handle.describe()).typedSearchAttributes;
      expect([attributes.get(OutboxStatusKey), attributes.get(OutboxErrorKey)]).toEqual(['dead', TemporalErrorCodes.workflowCancelled]);
    } finally {
      stripe.heal();
    }
    expect(await retrier.retryKey(key, { force: false, requestedBy: 'test' })).toMatchObject({ outcome: 'reopened' });
    await waitStatus(key, 'sent');
    expect(eventsFor(key)).toHaveLength(1);
  });

  it('cancelled while its retried call is at Stripe: the run waits for the call, and an event Stripe took is never listed as dead', async () => {
    // The first attempt fails (503), the second (a regular activity) is at Stripe when the cancel comes.
    stripe.failNext(1, 503);
    // Within this file's Stripe timeout (2 s): the call is answered.
    stripe.setLatency(1_200);
    try {
      const key = await enqueue(4);
      await waitFor('its second call to be at Stripe', async () => ((await row(key))?.attempt_count >= 2 && stripe.callsInFlight() > 0) || undefined, 30_000, 20);
      const handle = client.workflow.getHandle(key);
      await handle.cancel();
      await waitFor('the run to close', async () => (await handle.describe()).status.name !== 'RUNNING', 30_000);
      expect((await row(key)).status).toBe('sent');
      expect(eventsFor(key)).toHaveLength(1);
      // Not among the dead letters in the Web UI: the run learnt the call's answer before it ended.
      const attributes = (await handle.describe()).typedSearchAttributes;
      expect(attributes.get(OutboxStatusKey)).not.toBe('dead');
    } finally {
      stripe.setLatency(0);
    }
  });

  it('a dead letter whose event was delivered after all (an attempt answered past its timeout) ends delivered once its run is told', async () => {
    // Stripe refuses the event for good: the run makes the row dead and waits for a retry.
    stripe.refuseCustomer('cus_refused', 400);
    await addCustomer(db.pool, 'late', 'cus_refused');
    const r = await withTransaction(db.pool, (c) => recordUsage(c, { usageId: randomUUID(), tenantId: 'late', quantity: 2 }));
    const key = r.entry.idempotencyKey;
    await waitStatus(key, 'dead');
    const handle = client.workflow.getHandle(key);
    await waitFor('the run to wait as a dead letter', async () => (await handle.query(stateQuery)).status === 'dead');
    // What the late attempt's own mark leaves (markDelivered), then its notice to the run.
    await db.pool.query(`UPDATE outbox SET status = 'sent', sent_at = now(), dead_at = NULL WHERE idempotency_key = $1`, [key]);
    await deliveredLateNotice(client)(key);
    await waitFor('the run to complete', async () => (await handle.describe()).status.name === 'COMPLETED', 30_000);
    expect(await handle.result()).toMatchObject({ status: 'sent' });
    expect((await row(key)).status).toBe('sent');
    // Listed as the row is, not as the dead letter (nor a retry in flight) it was.
    const attributes = (await handle.describe()).typedSearchAttributes;
    expect([attributes.get(OutboxStatusKey), attributes.get(OutboxErrorKey)]).toEqual(['sent', undefined]);
  });

  it("cancelled while its attempt's worker is gone (the attempt ends timed out, the server having waited for it): marked workflow_cancelled, not a delivery failure", async () => {
    // A worker of this test's own on the dev server: the first attempt fails, the second never
    // answers and never heartbeats, as on a worker that died (until this worker stops).
    const dead: string[] = [];
    let tries = 0;
    const taskQueue = `gone-${randomUUID()}`;
    const worker = await Worker.create({
      connection: pipeline.connection,
      taskQueue,
      workflowBundle: workflowBundle(),
      activities: {
        async deliverUsage() {
          if (++tries === 1) throw ApplicationFailure.create({ type: ErrorTypes.retryable, message: 'Stripe answered 500', details: ['http_500'] });
          await Context.current().cancelled.catch(() => undefined);
          throw new Error('stopped');
        },
        async markDead(input: { code: string }) {
          dead.push(input.code);
          return { attempts: tries };
        },
        async markReopened() {},
      },
    });
    await worker.runUntil(async () => {
      const key = `u:gone:${randomUUID()}`;
      const retry = { ...config.retry, initialIntervalMs: 100, heartbeatTimeoutMs: 2_000, maximumAttempts: 10 };
      const handle = await client.workflow.start('usageWorkflow', { taskQueue, workflowId: key, args: [{ key, tenantId: 'gone', retry }] });
      await waitFor('the second attempt to be under way', async () => tries >= 2 || undefined);
      await handle.cancel();
      await expect(handle.result()).rejects.toThrow();
      expect((await handle.describe()).status.name).toBe('CANCELLED');
      expect(dead).toEqual([TemporalErrorCodes.workflowCancelled]);
    });
  });

  it('the worker runs the sweep by itself: the row of a terminated run turns dead without anyone asking', async () => {
    const key = await inFlightDuringOutage(2);
    // A sweep every 200 ms.
    await sweepingWorker({ intervalMs: 200, staleAfterMs: 0 });
    try {
      await client.workflow.getHandle(key).terminate('operator terminated it from the CLI');
      const dead = await waitStatus(key, 'dead');
      expect(dead.last_error_code).toBe(TemporalErrorCodes.workflowClosed);
      expect(dead.last_error_message).toMatch(/terminated/);
    } finally {
      stripe.heal();
    }
  });

  it('a sweep pass that found closed runs in a whole batch goes on at once with the next rows, not a batch per interval', async () => {
    // Orphans by the hundred (Temporal's state lost): dispatched, stale, no run. Four batches of 30.
    const keys = await withTransaction(db.pool, async (c) => {
      const made: string[] = [];
      for (let i = 0; i < 120; i++) made.push((await recordUsage(c, { usageId: randomUUID(), tenantId: 'acme', quantity: 1 })).entry.idempotencyKey);
      await c.query(`UPDATE outbox SET status = 'dispatched', updated_at = now() - interval '1 hour' WHERE idempotency_key = ANY($1::text[])`, [made]);
      return made;
    });
    const started = Date.now();
    // One pass every 20 s: four batches a pass at a time would take a minute past the first.
    await sweepingWorker({ intervalMs: 20_000, staleAfterMs: 60_000, batchSize: 30 });
    const deadCount = async () => Number((await db.pool.query(`SELECT count(*) FROM outbox WHERE idempotency_key = ANY($1::text[]) AND status = 'dead'`, [keys])).rows[0].count);
    await waitFor('every orphan dead', async () => (await deadCount()) === keys.length, 45_000, 500);
    expect(Date.now() - started).toBeLessThan(40_000);
    await db.pool.query('DELETE FROM outbox WHERE idempotency_key = ANY($1::text[])', [keys]);
  }, 90_000);
});
