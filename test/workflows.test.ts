/**
 * The usage workflow's own logic, in milliseconds: Temporal's time-skipping test server runs the
 * real workflow code with the activities replaced (as in Temporal's samples), so retry backoff,
 * 429 budgets of an hour and continue-as-new take no wall-clock time. What crosses processes
 * (PostgreSQL, Stripe, workers dying) is tested end to end in pipeline.test.ts and faults.test.ts.
 */
// First: installs the SDK runtime (quiet logging) before anything else touches it.
import { marked } from 'marked';
import { waitFor, workflowBundle } from './helpers.js';
import { randomUUID } from 'node:crypto';
import { existsSync, readFileSync } from 'node:fs';
import path from 'node:path';
import { activityInfo } from '@temporalio/activity';
import { ApplicationFailure } from '@temporalio/common';
import { temporal } from '@temporalio/proto';
import { TestWorkflowEnvironment } from '@temporalio/testing';
import { Worker } from '@temporalio/worker';
import { afterAll, beforeAll, expect, it } from 'vitest';
import type { DeliveryActivities, DeliveryResult } from '../activities/delivery.js';
import { PROJECT_ROOT } from '../src/embedded/temporal.js';
import { ErrorTypes, OutboxErrorKey, OutboxStatusKey, RELAY_CALLS_PER_RUN, reopenSignal, retryUpdate, rowChangedSignal, SEARCH_ATTRIBUTES, stateQuery, TemporalErrorCodes, type DeliverInput, type RelayWorkflowInput, type UsageWorkflowInput } from '../workflows/shared.js';

let env: TestWorkflowEnvironment;

beforeAll(async () => {
  const recorded = path.join(PROJECT_ROOT, '.tools', 'temporal-test-server-path');
  const local = existsSync(recorded) ? readFileSync(recorded, 'utf8').trim() : '';
  env = await TestWorkflowEnvironment.createTimeSkipping(
    local && existsSync(local) ? { server: { executable: { type: 'existing-path', path: local } } } : {},
  );
  // The workflow keeps OutboxStatus current; the test server must know the attribute like a real one.
  await env.connection.operatorService.addSearchAttributes({
    namespace: env.namespace ?? 'default',
    searchAttributes: Object.fromEntries(SEARCH_ATTRIBUTES.map((k) => [k.name, temporal.api.enums.v1.IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD])),
  });
}, 120_000);

afterAll(async () => {
  await env?.teardown();
});

const RETRY = {
  initialIntervalMs: 1_000,
  backoffCoefficient: 2,
  maximumIntervalMs: 60_000,
  maximumAttempts: 4,
  attemptTimeoutMs: 30_000,
  heartbeatTimeoutMs: 10_000,
  maxRateLimitedMs: 10 * 60_000,
  deadLetterOpenMs: 7 * 86_400_000,
};

type Deliver = (input: DeliverInput) => Promise<DeliveryResult>;

/** The workflow's activities, replaced: delivery by the test's own function, bookkeeping recorded. */
function fakeActivities(deliver: Deliver, hooks: { markDead?: (input: { code: string }) => Promise<void>; firstAttemptedAt?: () => number | null | undefined } = {}) {
  const calls = { deliver: [] as DeliverInput[], dead: [] as { code: string; message: string }[], retrying: 0 };
  const activities: Partial<DeliveryActivities> = {
    async deliverUsage(input) {
      calls.deliver.push(input);
      return deliver(input);
    },
    async markDead(input) {
      calls.dead.push({ code: input.code, message: input.message });
      await hooks.markDead?.(input);
      return { attempts: calls.deliver.length, firstAttemptedAt: hooks.firstAttemptedAt?.() };
    },
    async markReopened() {
      calls.retrying++;
    },
  };
  return { calls, activities };
}

async function withWorker<T>(activities: object, fn: (taskQueue: string) => Promise<T>): Promise<T> {
  const taskQueue = `wf-${randomUUID()}`;
  const worker = await Worker.create({ connection: env.nativeConnection, taskQueue, workflowBundle: workflowBundle(), activities });
  return worker.runUntil(fn(taskQueue));
}

function start(taskQueue: string, input: Partial<UsageWorkflowInput> = {}) {
  const key = `u:wf:${randomUUID()}`;
  return env.client.workflow.start('usageWorkflow', {
    taskQueue,
    workflowId: key,
    args: [{ key, tenantId: 'wf', retry: RETRY, ...input } satisfies UsageWorkflowInput],
  });
}

/** A history event's time, in ms. */
function timestampMs(t: { seconds?: unknown; nanos?: number | null } | null | undefined): number {
  return Number(t?.seconds ?? 0) * 1000 + Math.floor((t?.nanos ?? 0) / 1e6);
}

const retryable = () => ApplicationFailure.create({ type: ErrorTypes.retryable, message: 'Stripe answered 500', details: ['http_500'] });
const sent = async (): Promise<DeliveryResult> => ({ outcome: 'sent', attempts: 1 });

it("an attempt timed out whose call got through after all: the row is sent when it would be made dead, and the run ends delivered, not as a dead letter", async () => {
  const { calls, activities } = fakeActivities(async () => {
    throw retryable();
  });
  // markDead finds the row at Stripe: the abandoned call's answer came and marked it sent.
  const markDead = activities.markDead!;
  activities.markDead = async (input) => ({ ...(await markDead(input)), atStripe: 'sent' as const });
  await withWorker(activities, async (taskQueue) => {
    const handle = await start(taskQueue);
    await expect(handle.result()).resolves.toMatchObject({ status: 'sent', lastError: null, attempts: RETRY.maximumAttempts });
    expect(calls.dead).toHaveLength(1);
    const attributes = (await handle.describe()).typedSearchAttributes;
    expect([attributes.get(OutboxStatusKey), attributes.get(OutboxErrorKey)]).toEqual(['sent', undefined]);
  });
});

it('a v2 delivery that finds its row accepted by an earlier attempt (its answer late) ends the run as accepted, as the row says, not sent', async () => {
  const { activities } = fakeActivities(async () => ({ outcome: 'already_sent', attempts: 1, status: 'accepted' }));
  await withWorker(activities, async (taskQueue) => {
    await expect((await start(taskQueue)).result()).resolves.toMatchObject({ status: 'accepted' });
  });
});

it("a delivery that finds its row rejected by Stripe's error report meanwhile ends the run as rejected_async, not as delivered", async () => {
  const { activities } = fakeActivities(async () => ({ outcome: 'already_sent', attempts: 1, status: 'rejected_async' }));
  await withWorker(activities, async (taskQueue) => {
    const handle = await start(taskQueue);
    await expect(handle.result()).resolves.toMatchObject({ status: 'rejected_async', lastError: null });
    const attributes = (await handle.describe()).typedSearchAttributes;
    expect([attributes.get(OutboxStatusKey), attributes.get(OutboxErrorKey)]).toEqual(['rejected_async', undefined]);
  });
});

it('a retry Update accepted while the dead mark runs, which finds the row at Stripe: answered with the delivered state, and the run ends', async () => {
  let release!: () => void;
  const marking = new Promise<void>((resolve) => (release = resolve));
  let marked!: () => void;
  const markStarted = new Promise<void>((resolve) => (marked = resolve));
  const { activities } = fakeActivities(async () => {
    throw ApplicationFailure.create({ type: ErrorTypes.rejected, message: 'No such customer', details: ['resource_missing'], nonRetryable: true });
  });
  activities.markDead = async () => {
    marked();
    await marking;
    return { attempts: 1, atStripe: 'sent' as const };
  };
  await withWorker(activities, async (taskQueue) => {
    const handle = await start(taskQueue);
    await markStarted;
    // Dead by the run's own state: the Update's validator takes it.
    const update = handle.executeUpdate(retryUpdate, { args: [{ requestedBy: 'test' }] });
    await waitFor('the Update accepted', async () => ((await handle.fetchHistory()).events ?? []).some((e) => e.workflowExecutionUpdateAcceptedEventAttributes) || undefined);
    release();
    await expect(update).resolves.toMatchObject({ status: 'sent' });
    await expect(handle.result()).resolves.toMatchObject({ status: 'sent' });
  });
});

it("passes on the judgement that held its last try as Stripe down to the next tries (on whichever worker), through waits of our own, until Stripe answers", async () => {
  const hold = { since: 1_234, judgedAt: 5_678 };
  const answers: DeliveryResult[] = [
    { outcome: 'deferred', reason: 'stripe_down', waitMs: 15_000, attempts: 1, outageHold: hold },
    { outcome: 'deferred', reason: 'stripe_down', waitMs: 15_000, attempts: 2, outageHold: hold },
    { outcome: 'deferred', reason: 'paced', waitMs: 100, attempts: 3 },
    { outcome: 'deferred', reason: 'rate_limited', waitMs: 100, attempts: 3 },
    { outcome: 'sent', attempts: 4 },
  ];
  const { calls, activities } = fakeActivities(async () => answers.shift()!);
  await withWorker(activities, async (taskQueue) => {
    const handle = await start(taskQueue);
    await env.sleep('1 minute');
    expect(await handle.query(stateQuery)).toMatchObject({ status: 'sent' });
  });
  expect(calls.deliver.map((c) => c.heldByOutage)).toEqual([undefined, hold, hold, hold, undefined]);
});

it('carries the hold across continue-as-new, to the new run\'s first try in its workflow task', async () => {
  const hold = { since: 1_234, judgedAt: 5_678 };
  const answers: DeliveryResult[] = [
    { outcome: 'deferred', reason: 'stripe_down', waitMs: 15_000, attempts: 1, outageHold: hold },
    { outcome: 'sent', attempts: 2 },
  ];
  const { calls, activities } = fakeActivities(async () => answers.shift()!);
  await withWorker(activities, async (taskQueue) => {
    const handle = await start(taskQueue, { deferralsPerRun: 1 });
    await env.sleep('1 minute');
    expect(await handle.query(stateQuery)).toMatchObject({ status: 'sent' });
    expect((await handle.describe()).runId).not.toBe(handle.firstExecutionRunId);
  });
  expect(calls.deliver.map((c) => c.heldByOutage)).toEqual([undefined, hold]);
});

it('runs the retry policy out, then the event is dead and waits for a retry signal', async () => {
  const { calls, activities } = fakeActivities(async () => {
    throw retryable();
  });
  await withWorker(activities, async (taskQueue) => {
    const handle = await start(taskQueue);
    // Backoff 1 s, 2 s, 4 s between the 4 attempts: skipped, not waited.
    await env.sleep('1 minute');
    expect(calls.deliver).toHaveLength(RETRY.maximumAttempts);
    expect(calls.dead).toEqual([{ code: 'http_500', message: 'Stripe answered 500' }]);
    expect(await handle.query(stateQuery)).toMatchObject({ status: 'dead', lastError: { code: 'http_500' } });
    // Still open a day later: a dead letter waits for a human.
    await env.sleep('1 day');
    expect((await handle.describe()).status.name).toBe('RUNNING');
    expect(calls.deliver).toHaveLength(RETRY.maximumAttempts);
    // ...for DEAD_LETTER_OPEN_DAYS, then the run ends as Failed (the row stays dead; the CLI reopens it).
    await env.sleep('7 days');
    const closed = await handle.describe();
    expect(closed.status.name).toBe('FAILED');
    const failure = await handle.result().catch((e: unknown) => e as { cause?: { message?: string; type?: string } });
    expect(failure).toMatchObject({ cause: { type: 'DeadLetterClosed', message: expect.stringMatching(/not retried within 168 h/) } });
  });
});

it("a dead letter told its row changed (Stripe's error report rejected it) reads the row and ends as it is; told while the row is still dead, it waits on, and its deadline stands", async () => {
  let rowStatus: 'dead' | 'dispatched' | 'rejected_async' = 'dead';
  const reads: string[] = [];
  const { calls, activities } = fakeActivities(async () => {
    throw ApplicationFailure.create({ type: ErrorTypes.rejected, message: 'No such customer', details: ['resource_missing'], nonRetryable: true });
  });
  activities.readRowStatus = async (key) => {
    reads.push(key);
    return rowStatus;
  };
  await withWorker(activities, async (taskQueue) => {
    const handle = await start(taskQueue);
    await waitFor('the dead letter', async () => (await handle.query(stateQuery)).status === 'dead' && calls.dead.length === 1);
    // Told while the row is still dead (a report that named it, then nothing changed): it waits on.
    await handle.signal(rowChangedSignal);
    await waitFor('the row read', async () => reads.length === 1);
    await env.sleep('1 day');
    expect((await handle.describe()).status.name).toBe('RUNNING');
    expect(await handle.query(stateQuery)).toMatchObject({ status: 'dead', lastError: { code: 'resource_missing' } });
    // Put back in flight (a rebill about to signal this run): not at Stripe, not this run's to close.
    rowStatus = 'dispatched';
    await handle.signal(rowChangedSignal);
    await waitFor('the row read again', async () => reads.length === 2);
    await env.sleep('1 hour');
    expect((await handle.describe()).status.name).toBe('RUNNING');
    // Rejected by Stripe's error report: the run ends listed as that, before its dead-letter deadline.
    rowStatus = 'rejected_async';
    await handle.signal(rowChangedSignal);
    await expect(handle.result()).resolves.toMatchObject({ status: 'rejected_async', lastError: null });
    expect(reads).toHaveLength(3);
    expect(calls.deliver).toHaveLength(1);
    expect(calls.retrying).toBe(0);
    const attributes = (await handle.describe()).typedSearchAttributes;
    expect([attributes.get(OutboxStatusKey), attributes.get(OutboxErrorKey)]).toEqual(['rejected_async', undefined]);
  });
});

it('a dead letter told its row changed, with the row still dead, closes at its own deadline, not a wait longer', async () => {
  const { activities } = fakeActivities(async () => {
    throw ApplicationFailure.create({ type: ErrorTypes.rejected, message: 'No such customer', details: ['resource_missing'], nonRetryable: true });
  });
  activities.readRowStatus = async () => 'dead';
  await withWorker(activities, async (taskQueue) => {
    const handle = await start(taskQueue);
    await waitFor('the dead letter', async () => (await handle.query(stateQuery)).status === 'dead');
    await env.sleep('3 days');
    await handle.signal(rowChangedSignal);
    await env.sleep('3 days');
    expect((await handle.describe()).status.name).toBe('RUNNING');
    // Seven days from its death, as without the signal (not seven from the signal).
    await env.sleep('25 hours');
    expect((await handle.describe()).status.name).toBe('FAILED');
  });
});

/**
 * Stripe refuses the first delivery for good and accepts the next; the dead mark, once started
 * (`deadStarted`), is held until `releaseMarkDead()`: an operator's retry can arrive mid-bookkeeping.
 */
function refusedOnceThenSent() {
  let markDeadStarted!: () => void;
  const deadStarted = new Promise<void>((resolve) => (markDeadStarted = resolve));
  let releaseMarkDead!: () => void;
  const markDeadGate = new Promise<void>((resolve) => (releaseMarkDead = resolve));
  let first = true;
  const { calls, activities } = fakeActivities(
    async () => {
      if (first) {
        first = false;
        throw ApplicationFailure.create({ type: ErrorTypes.rejected, message: 'No such customer', details: ['resource_missing'], nonRetryable: true });
      }
      return sent();
    },
    {
      markDead: async () => {
        markDeadStarted();
        await markDeadGate;
      },
    },
  );
  return { calls, activities, deadStarted, releaseMarkDead };
}

it('does not drop a retry signal sent while the dead mark is still being written', async () => {
  const { calls, activities, deadStarted, releaseMarkDead } = refusedOnceThenSent();
  await withWorker(activities, async (taskQueue) => {
    const handle = await start(taskQueue);
    await deadStarted;
    // The operator sees "dead" and signals before the row's bookkeeping has finished.
    await handle.signal(reopenSignal, { requestedBy: 'test' });
    releaseMarkDead();
    expect(await handle.result()).toMatchObject({ status: 'sent' });
    expect(calls.deliver).toHaveLength(2);
    expect(calls.retrying).toBe(1);
  });
});

it('honours a retry signal that arrives in the same workflow task as the dead letter\'s deadline', async () => {
  const { calls, activities } = fakeActivities(async () => {
    if (calls.deliver.length === 1) {
      throw ApplicationFailure.create({ type: ErrorTypes.rejected, message: 'No such customer', details: ['resource_missing'], nonRetryable: true });
    }
    return sent();
  });
  const taskQueue = `wf-${randomUUID()}`;
  // No workflow cache, so no sticky queue: the next task goes to whichever worker polls the task queue.
  const dying = await Worker.create({ connection: env.nativeConnection, taskQueue, workflowBundle: workflowBundle(), activities, maxCachedWorkflows: 0 });
  const { h: handle, startedAt } = await dying.runUntil(async () => {
    const h = await start(taskQueue);
    // Dead, and waiting on the deadline's timer (the only timer of this run).
    const timer = await waitFor('the dead letter to wait for its deadline', async () => {
      const { events } = await h.fetchHistory();
      return events?.find((e) => e.timerStartedEventAttributes);
    });
    return { h, startedAt: timestampMs(timer.eventTime) };
  });
  // No worker now: time is moved exactly to the deadline. The timer fires, and its workflow task
  // waits for a worker (the test server skips no further while a task is pending: a sleep past the
  // deadline would never end); the operator's retry signal joins that same task.
  await env.sleep(startedAt + RETRY.deadLetterOpenMs - (await env.currentTimeMs()));
  await handle.signal(reopenSignal, { requestedBy: 'test' });
  const { events } = await handle.fetchHistory();
  // The race itself, in the history: the deadline fired and the signal came before a worker took
  // the task they share.
  const tail = (events ?? []).slice(-3).map((e) => temporal.api.enums.v1.EventType[e.eventType ?? 0]);
  expect(tail).toEqual(['EVENT_TYPE_TIMER_FIRED', 'EVENT_TYPE_WORKFLOW_TASK_SCHEDULED', 'EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED']);

  const worker = await Worker.create({ connection: env.nativeConnection, taskQueue, workflowBundle: workflowBundle(), activities });
  const result = await worker.runUntil(handle.result());
  expect(result).toMatchObject({ status: 'sent' });
  expect(calls.retrying).toBe(1);
  expect(calls.deliver).toHaveLength(2);
});

it('the retry Update sent while the dead mark is still being written answers for the next delivery, not the one that died', async () => {
  const { calls, activities, deadStarted, releaseMarkDead } = refusedOnceThenSent();
  await withWorker(activities, async (taskQueue) => {
    const handle = await start(taskQueue);
    await deadStarted;
    const update = await handle.startUpdate(retryUpdate, { args: [{ requestedBy: 'test' }], waitForStage: 'ACCEPTED' });
    releaseMarkDead();
    expect(await update.result()).toMatchObject({ status: 'sent', lastError: null });
    expect(calls.deliver).toHaveLength(2);
    expect(await handle.result()).toMatchObject({ status: 'sent' });
  });
});

it('the retry Update: refused in flight (no Update in the history); a retried delivery that continues as new answers dispatched', async () => {
  let mode: 'reject' | 'defer' = 'defer';
  const { activities } = fakeActivities(async () => {
    if (mode === 'reject') throw ApplicationFailure.create({ type: ErrorTypes.rejected, message: 'No such customer', details: ['resource_missing'], nonRetryable: true });
    return { outcome: 'deferred', reason: 'lease_busy', waitMs: 3_600_000, attempts: 0 };
  });
  await withWorker(activities, async (taskQueue) => {
    const handle = await start(taskQueue, { deferralsPerRun: 1 });
    // Waiting out its first deferral: the task that deferred is complete, its timer started.
    await waitFor('the first deferral', async () => (await handle.fetchHistory()).events?.at(-1)?.eventType === temporal.api.enums.v1.EventType.EVENT_TYPE_TIMER_STARTED);
    // The Web UI's current details say what it waits for, and until when.
    const { currentDetails } = await handle.query<{ currentDetails?: string }>('__temporal_workflow_metadata');
    expect(currentDetails).toMatch(/^\*\*Waiting\*\* for the \(customer, meter\) lease: .*; next try at \d{4}-\d\d-\d\dT.*Waiting spends no retry attempt\./);
    await expect(handle.executeUpdate(retryUpdate, { args: [{ requestedBy: 'test' }] })).rejects.toMatchObject({
      cause: { type: 'RetryRefused', details: ['not_dead'] },
    });
    // This test server records the workflow task that ran the validator (the dev server drops it:
    // retry-wait.test.ts counts the events there); the Update itself is not in the history.
    const { EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED, EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_REJECTED } = temporal.api.enums.v1.EventType;
    const types = ((await handle.fetchHistory()).events ?? []).map((e) => e.eventType);
    expect(types).not.toContain(EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED);
    expect(types).not.toContain(EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_REJECTED);
    await handle.terminate('test: next case');

    mode = 'reject';
    const dead = await start(taskQueue, { deferralsPerRun: 1 });
    await waitFor('dead', async () => (await dead.query(stateQuery)).status === 'dead');
    mode = 'defer';
    const answer = dead.executeUpdate(retryUpdate, { args: [{ requestedBy: 'test' }] });
    await env.sleep('2 hours');
    expect(await answer).toMatchObject({ status: 'dispatched' });
    expect((await dead.describe()).runId).not.toBe(dead.firstExecutionRunId);
    await dead.terminate('test over');
  });
});

it('a dead letter retried again and again continues as new every reopensPerRun retries, each retry still a delivery and its answer', async () => {
  const { calls, activities } = fakeActivities(async () => {
    throw ApplicationFailure.create({ type: ErrorTypes.rejected, message: 'No such customer', details: ['resource_missing'], nonRetryable: true });
  });
  await withWorker(activities, async (taskQueue) => {
    const handle = await start(taskQueue, { reopensPerRun: 2 });
    await waitFor('dead', async () => (await handle.query(stateQuery)).status === 'dead');
    // The first retry: dead again in the same run.
    expect(await handle.executeUpdate(retryUpdate, { args: [{ requestedBy: 'test' }] })).toMatchObject({ status: 'dead' });
    expect((await handle.describe()).runId).toBe(handle.firstExecutionRunId);
    // The second: this run's last; the retried delivery goes on in a new run, and is dead again there.
    expect(await handle.executeUpdate(retryUpdate, { args: [{ requestedBy: 'test' }] })).toMatchObject({ status: 'dispatched' });
    const latest = env.client.workflow.getHandle(handle.workflowId);
    await waitFor('the new run dead again', async () => (await latest.describe()).runId !== handle.firstExecutionRunId && (await latest.query(stateQuery)).status === 'dead');
    expect(calls.deliver).toHaveLength(3);
    expect(calls.dead).toHaveLength(3);
    // And it takes a retry as the first run did.
    expect(await latest.executeUpdate(retryUpdate, { args: [{ requestedBy: 'test' }] })).toMatchObject({ status: 'dead' });
    expect(calls.deliver).toHaveLength(4);
    await latest.terminate('test over');
  });
});

it("clears a wait's reason from the run's page when the wait is over: tries failing afterwards are not shown as waiting for a key", async () => {
  const { calls, activities } = fakeActivities(async () => {
    if (calls.deliver.length === 1) return { outcome: 'deferred', reason: 'stripe_credentials', waitMs: 60_000, attempts: 0 };
    throw ApplicationFailure.create({ type: ErrorTypes.retryable, message: 'Stripe answered 500' });
  });
  await withWorker(activities, async (taskQueue) => {
    const handle = await start(taskQueue);
    await waitFor('the deferral', async () => calls.deliver.length >= 1 || undefined);
    expect((await handle.query<{ currentDetails?: string }>('__temporal_workflow_metadata')).currentDetails).toMatch(/working Stripe API key/);
    // The wait over, the next tries fail and back off (1 s, 2 s, …): the run is delivering, not waiting.
    await env.sleep('62 seconds');
    expect(calls.deliver.length).toBeGreaterThanOrEqual(2);
    expect(calls.dead).toEqual([]);
    const { currentDetails } = await handle.query<{ currentDetails?: string }>('__temporal_workflow_metadata');
    expect(currentDetails).toMatch(/^\*\*Delivering\*\* to Stripe/);
    await handle.terminate('test over');
  });
});

it("cuts a 429's Retry-After to what is left of the 429 budget: a day's Retry-After ends dead as rate_limited, not past the 23 h window", async () => {
  const { calls, activities } = fakeActivities(async () => ({ outcome: 'deferred', reason: 'rate_limited', waitMs: 24 * 3_600_000, attempts: 0 }));
  await withWorker(activities, async (taskQueue) => {
    const handle = await start(taskQueue);
    await env.sleep('15 minutes');
    // The 10-minute budget: a try at its end, still 429, and dead with Stripe's reason.
    expect(calls.deliver).toHaveLength(2);
    expect(calls.dead).toHaveLength(1);
    expect(calls.dead[0]!.code).toBe('rate_limited');
    expect(calls.dead[0]!.message).toMatch(/Stripe kept answering 429 for over 600 s/);
    await handle.terminate('test over');
  });
});

it("bounds Stripe's 429s by RETRY_MAX_RATE_LIMITED_MS across continue-as-new", async () => {
  const { calls, activities } = fakeActivities(async () => ({ outcome: 'deferred', reason: 'rate_limited', waitMs: 60_000, attempts: 0 }));
  await withWorker(activities, async (taskQueue) => {
    // Three deferrals per run: the 10-minute budget spans four runs.
    const handle = await start(taskQueue, { deferralsPerRun: 3 });
    await env.sleep('30 minutes');
    expect(calls.dead).toHaveLength(1);
    expect(calls.dead[0]!.code).toBe('rate_limited');
    expect(calls.dead[0]!.message).toMatch(/Stripe kept answering 429 for over 600 s/);
    // About ten minutes of one call a minute: not one run's worth, not forever.
    expect(calls.deliver.length).toBeGreaterThanOrEqual(10);
    expect(calls.deliver.length).toBeLessThanOrEqual(13);
    // It continued as new on the way: the run now open is not the one first started.
    expect((await handle.describe()).runId).not.toBe(handle.firstExecutionRunId);
    await handle.terminate('test over');
  });
});

it('never dead-letters an event for waiting on our own pace, a busy customer, our own database, a refused key, its clock or its meter being replaced', async () => {
  const reasons = ['paced', 'lease_busy', 'database_unavailable', 'stripe_credentials', 'stamped_ahead', 'meter_replacing'] as const;
  const { calls, activities } = fakeActivities(async () =>
    calls.deliver.length > 40 ? sent() : { outcome: 'deferred', reason: reasons[calls.deliver.length % reasons.length]!, waitMs: 60_000, attempts: 0 },
  );
  await withWorker(activities, async (taskQueue) => {
    // 40 minutes of waiting, four times the 429 budget: still delivered.
    const handle = await start(taskQueue, { deferralsPerRun: 7 });
    expect(await handle.result()).toMatchObject({ status: 'sent' });
    expect(calls.dead).toEqual([]);
  });
});

it('keeps the 24 h guard: a plain retry is refused again, a forced retry sends', async () => {
  // As the real activity does once the first attempt is over 23 h old: refuse unless forced.
  const { calls, activities } = fakeActivities(async ({ force }) => {
    if (!force) {
      throw ApplicationFailure.create({ type: ErrorTypes.unsafeToSend, message: 'first attempted 25 h ago', details: ['identifier_window_expired'], nonRetryable: true });
    }
    return sent();
  });
  await withWorker(activities, async (taskQueue) => {
    const handle = await start(taskQueue);
    await env.sleep('1 minute');
    expect(await handle.query(stateQuery)).toMatchObject({ status: 'dead', lastError: { code: 'identifier_window_expired' } });
    await handle.signal(reopenSignal, {});
    await env.sleep('1 minute');
    expect(await handle.query(stateQuery)).toMatchObject({ status: 'dead' });
    await handle.signal(reopenSignal, { force: true, requestedBy: 'ops' });
    expect(await handle.result()).toMatchObject({ status: 'sent' });
    expect(calls.deliver.map((c) => c.force)).toEqual([false, false, true]);
    expect(calls.dead.map((d) => d.code)).toEqual(['identifier_window_expired', 'identifier_window_expired']);
  });
});

it('spends RETRY_MAXIMUM_ATTEMPTS once per event, across deferrals and continue-as-new', async () => {
  // Each scheduled activity: its first try gets a 500, its second is deferred (a busy lease) and
  // says one try failed before it. Before the budget was the event's, every deferral scheduled a
  // fresh activity with a fresh budget, and this went on until the 23 h guard.
  const { calls, activities } = fakeActivities(async () => {
    const { attempt } = activityInfo();
    if (attempt === 1) throw retryable();
    return { outcome: 'deferred', reason: 'lease_busy', waitMs: 1_000, attempts: 0, failedBefore: attempt - 1 };
  });
  await withWorker(activities, async (taskQueue) => {
    const handle = await start(taskQueue, { deferralsPerRun: 1 });
    await env.sleep('1 hour');
    expect(calls.dead.map((d) => d.code)).toEqual(['http_500']);
    // In the task 1 failed; then 1 failed + 1 deferred, twice; then the last attempt left failed.
    expect(calls.deliver).toHaveLength(6);
    // It continued as new on the way, carrying what was spent.
    expect((await handle.describe()).runId).not.toBe(handle.firstExecutionRunId);
    await handle.terminate('test over');
  });
});

it('bounds only 429s: waits of our own between two of them (an hour of pace) do not count towards the 429 budget', async () => {
  // A 429, then an hour of waiting for our own pace, then another 429: not "429s for over 10 minutes".
  const { calls, activities } = fakeActivities(async () => {
    const n = calls.deliver.length;
    if (n === 1 || n === 62) return { outcome: 'deferred', reason: 'rate_limited', waitMs: 60_000, attempts: 0 };
    if (n > 62) return sent();
    return { outcome: 'deferred', reason: 'paced', waitMs: 60_000, attempts: 0 };
  });
  await withWorker(activities, async (taskQueue) => {
    const handle = await start(taskQueue, { deferralsPerRun: 25 });
    expect(await handle.result()).toMatchObject({ status: 'sent' });
    expect(calls.dead).toEqual([]);
  });
});

it("bounds 429s that alternate with waits of our own: the pace between two 429s is no answer from Stripe, and does not start the count again", async () => {
  // Under a sustained 429 a busy pace defers every other try; each such wait once ended the stretch,
  // and the event went on for 23 h, to die as identifier_window_expired instead of rate_limited.
  const { calls, activities } = fakeActivities(async () =>
    calls.deliver.length % 2 === 1
      ? { outcome: 'deferred', reason: 'rate_limited', waitMs: 60_000, attempts: 0 }
      : { outcome: 'deferred', reason: 'paced', waitMs: 60_000, attempts: 0 },
  );
  await withWorker(activities, async (taskQueue) => {
    const handle = await start(taskQueue, { deferralsPerRun: 25 });
    await env.sleep('30 minutes');
    // Ten minutes of waiting on 429s (the budget) took about twenty of workflow time.
    expect(calls.dead.map((d) => d.code)).toEqual(['rate_limited']);
    expect(calls.deliver.length).toBeGreaterThanOrEqual(20);
    expect(calls.deliver.length).toBeLessThanOrEqual(25);
    await handle.terminate('test over');
  });
});

it("a failed try ends a stretch of 429s wherever it happens, the in-task try of a run continued as new included", async () => {
  // 429s, a continue-as-new (three deferrals a run), then the new run's first try (in the workflow
  // task) fails; after it, 429s again: the count starts from that failure.
  const { calls, activities } = fakeActivities(async () => {
    const n = calls.deliver.length;
    if (n === 4) throw retryable();
    return { outcome: 'deferred', reason: 'rate_limited', waitMs: 60_000, attempts: 0 };
  });
  await withWorker(activities, async (taskQueue) => {
    const handle = await start(taskQueue, { deferralsPerRun: 3 });
    // Three 429 minutes, the failure, then about nine more minutes of 429s: not yet the 10-minute budget since the failure.
    await env.sleep('12 minutes');
    expect(calls.dead).toEqual([]);
    await env.sleep('10 minutes');
    expect(calls.dead.map((d) => d.code)).toEqual(['rate_limited']);
    await handle.terminate('test over');
  });
});

it("judges a retry by the row's resend window: a dead letter no try of which reached Stripe is retried without --force days later", async () => {
  // As the real activity does for a tenant with no Stripe customer yet: refused before any call, the
  // attempt taken back, the row's first_attempted_at left empty (markDead reports null).
  let mapped = false;
  let rowWindow: number | null = null;
  const { calls, activities } = fakeActivities(
    async () => {
      if (!mapped) throw ApplicationFailure.create({ type: ErrorTypes.missing, message: 'no Stripe customer for tenant wf', details: ['customer_mapping_missing'], nonRetryable: true });
      return sent();
    },
    { firstAttemptedAt: () => rowWindow },
  );
  await withWorker(activities, async (taskQueue) => {
    const handle = await start(taskQueue);
    await waitFor('dead', async () => (await handle.query(stateQuery)).status === 'dead');
    // The customer is mapped two days later: the Update is taken and the event sent.
    await env.sleep('2 days');
    mapped = true;
    expect(await handle.executeUpdate(retryUpdate, { args: [{ requestedBy: 'test' }] })).toMatchObject({ status: 'sent' });
    expect(calls.deliver.map((c) => c.force)).toEqual([false, false]);

    // A row whose window did begin (a try reached Stripe) two days ago: refused without --force.
    mapped = false;
    rowWindow = Date.now() - 2 * 86_400_000;
    const old = await start(taskQueue);
    try {
      // Dead with its dead mark done (its attempts counted): the run knows the row's window only then.
      await waitFor('dead and marked', async () => {
        const state = await old.query(stateQuery);
        return state.status === 'dead' && state.attempts > 0;
      });
      await expect(old.executeUpdate(retryUpdate, { args: [{ requestedBy: 'test' }] })).rejects.toMatchObject({ cause: { type: 'RetryRefused', details: ['window'] } });
    } finally {
      await old.terminate('test over');
    }
  });
});

it("a rebill's reopen starts the 24 h window again: a later plain retry of the new identifier is not refused for the old one's age", async () => {
  let mode: 'reject' | 'send' = 'reject';
  const { activities } = fakeActivities(async () => {
    if (mode === 'send') return { outcome: 'sent', attempts: 1 };
    throw ApplicationFailure.create({ type: ErrorTypes.rejected, message: 'No such customer', details: ['resource_missing'], nonRetryable: true });
  });
  await withWorker(activities, async (taskQueue) => {
    const handle = await start(taskQueue);
    await waitFor('dead', async () => (await handle.query(stateQuery)).status === 'dead');
    await env.sleep('25 hours');
    // The rebill's signal (src/ops/rebill.ts): delivered again under a new identifier, dead again.
    await handle.signal(reopenSignal, { newIdentifier: true, requestedBy: 'rebill' });
    await waitFor('dead again', async () => (await handle.query(stateQuery)).attempts > 1 && (await handle.query(stateQuery)).status === 'dead');
    mode = 'send';
    expect(await handle.executeUpdate(retryUpdate, { args: [{ requestedBy: 'test' }] })).toMatchObject({ status: 'sent' });
  });
});

/**
 * A dead letter past the 24 h window (its first try refused so), retried with force until sent:
 * whether each try was forced, in order. `next(n)` answers the n-th try from the second on.
 */
async function forcesOfForcedRetry(next: (n: number) => ReturnType<Deliver>): Promise<boolean[]> {
  const { calls, activities } = fakeActivities(async () => {
    const n = calls.deliver.length;
    if (n === 1) throw ApplicationFailure.create({ type: ErrorTypes.unsafeToSend, message: 'first attempted 25 h ago', details: ['identifier_window_expired'], nonRetryable: true });
    return next(n);
  });
  return withWorker(activities, async (taskQueue) => {
    const handle = await start(taskQueue);
    await env.sleep('1 minute');
    expect(await handle.query(stateQuery)).toMatchObject({ status: 'dead' });
    await handle.signal(reopenSignal, { force: true, requestedBy: 'ops' });
    expect(await handle.result()).toMatchObject({ status: 'sent' });
    return calls.deliver.map((c) => c.force === true);
  });
}

it("uses a forced retry's force for one attempt only (that attempt starts a new 24 h window)", async () => {
  const forces = await forcesOfForcedRetry(async (n) => {
    if (n === 2) throw retryable();
    return sent();
  });
  expect(forces).toEqual([false, true, false]);
});

it("keeps a forced retry's force through deferrals that came before the attempt began (a busy lease, our database away), and no further", async () => {
  const forces = await forcesOfForcedRetry(async (n) => {
    if (n === 2) return { outcome: 'deferred', reason: 'lease_busy', waitMs: 1_000, attempts: 0, begun: false };
    if (n === 3) return { outcome: 'deferred', reason: 'database_unavailable', waitMs: 1_000, attempts: 0, begun: false };
    // Begun, then put off (our pace): the force is used up by the attempt that began.
    if (n === 4) return { outcome: 'deferred', reason: 'paced', waitMs: 1_000, attempts: 1 };
    return sent();
  });
  expect(forces).toEqual([false, true, true, true, false]);
});

it('a retry typed by hand with fields of the wrong kind (the Web UI takes any JSON) is a plain retry, not a run that fails every task', async () => {
  let mode: 'fail' | 'send' = 'fail';
  const { calls, activities } = fakeActivities(async () => {
    if (mode === 'send') return sent();
    throw ApplicationFailure.create({ type: ErrorTypes.rejected, message: 'No such customer', details: ['resource_missing'], nonRetryable: true });
  });
  await withWorker(activities, async (taskQueue) => {
    const handle = await start(taskQueue);
    await waitFor('dead', async () => (await handle.query(stateQuery)).status === 'dead');
    mode = 'send';
    await handle.signal(reopenSignal, { requestedBy: { name: 'alice' }, force: 'yes', newIdentifier: 1 } as never);
    expect(await handle.result()).toMatchObject({ status: 'sent' });
    expect(calls.deliver.map((c) => c.force === true)).toEqual([false, false]);
  });
  // And as an Update: refused or taken, never a task that fails.
  mode = 'fail';
  await withWorker(activities, async (taskQueue) => {
    const handle = await start(taskQueue);
    await waitFor('dead', async () => (await handle.query(stateQuery)).status === 'dead');
    mode = 'send';
    expect(await handle.executeUpdate(retryUpdate, { args: [['a b'] as never] })).toMatchObject({ status: 'sent' });
  });
});

it("shows a tenant's text in the Web UI's details as text: a usage id or an answer quoting one makes no link", async () => {
  // The usage id closes a one-backtick code span and opens a link; Stripe's answer quotes another.
  const key = 'u:wf:x` [Retry here](https://evil.example) `';
  const { activities } = fakeActivities(async () => {
    throw ApplicationFailure.create({ type: ErrorTypes.rejected, message: "No such customer: '[Fix it](https://evil.example)' <img src=x> **now**", details: ['resource_missing'], nonRetryable: true });
  });
  await withWorker(activities, async (taskQueue) => {
    const handle = await start(taskQueue, { key });
    await waitFor('dead', async () => (await handle.query(stateQuery)).status === 'dead');
    const { currentDetails } = await handle.query<{ currentDetails?: string }>('__temporal_workflow_metadata');
    const html = await marked.parse(currentDetails!);
    expect(html).not.toMatch(/<a |<img|<strong>now/);
    // Both read as they are: the key in code, the answer as text.
    const text = html.replace(/<[^>]+>/g, '').replace(/&#39;/g, "'").replace(/&quot;/g, '"').replace(/&lt;/g, '<').replace(/&gt;/g, '>').replace(/&amp;/g, '&');
    expect(text).toContain(key);
    expect(text).toContain("No such customer: '[Fix it](https://evil.example)' <img src=x> **now**");
    await handle.terminate('test over');
  });
});

it('a cancelled run marks its row dead (workflow_cancelled) before it ends when in flight; a dead letter keeps Stripe\'s reason', async () => {
  const { calls, activities } = fakeActivities(async () => {
    throw retryable();
  });
  await withWorker(activities, async (taskQueue) => {
    // Cancelled while waiting as a dead letter: the row and the Web UI keep why it died.
    const handle = await start(taskQueue);
    await env.sleep('1 minute');
    expect(calls.dead.map((d) => d.code)).toEqual(['http_500']);
    await handle.cancel();
    await expect(handle.result()).rejects.toThrow();
    const described = await handle.describe();
    expect(described.status.name).toBe('CANCELLED');
    expect(calls.dead.map((d) => d.code)).toEqual(['http_500']);
    expect(described.typedSearchAttributes.get(OutboxErrorKey)).toBe('http_500');
  });
  // Cancelled between attempts (in the retry policy's backoff): marked once, as cancelled, not as a delivery failure.
  const slow = fakeActivities(async () => {
    throw retryable();
  });
  await withWorker(slow.activities, async (taskQueue) => {
    const handle = await start(taskQueue, { retry: { ...RETRY, maximumAttempts: 100, initialIntervalMs: 60_000, maximumIntervalMs: 60_000 } });
    await waitUntil(() => slow.calls.deliver.length >= 1);
    await handle.cancel();
    await expect(handle.result()).rejects.toThrow();
    expect(slow.calls.dead.map((d) => d.code)).toEqual([TemporalErrorCodes.workflowCancelled]);
    expect(slow.calls.dead[0]!.message).toContain(`retry ${handle.workflowId} `);
    expect([(await handle.describe()).typedSearchAttributes.get(OutboxStatusKey), (await handle.describe()).typedSearchAttributes.get(OutboxErrorKey)]).toEqual([
      'dead',
      TemporalErrorCodes.workflowCancelled,
    ]);
  });
  // Cancelled between attempts while an earlier attempt's call got through (v2: a timed-out attempt's
  // batch accepted since): the row is not made dead, and the run is not listed as a dead letter.
  const late = fakeActivities(async () => {
    throw retryable();
  });
  const markDead = late.activities.markDead!;
  late.activities.markDead = async (input) => ({ ...(await markDead(input)), atStripe: 'accepted' as const });
  await withWorker(late.activities, async (taskQueue) => {
    const handle = await start(taskQueue, { retry: { ...RETRY, maximumAttempts: 100, initialIntervalMs: 60_000, maximumIntervalMs: 60_000 } });
    await waitUntil(() => late.calls.deliver.length >= 1);
    await handle.cancel();
    await expect(handle.result()).rejects.toThrow();
    const attributes = (await handle.describe()).typedSearchAttributes;
    expect([attributes.get(OutboxStatusKey), attributes.get(OutboxErrorKey)]).toEqual(['accepted', undefined]);
  });
});

it("cancelled before its dead letter reached the row (the mark waits out our database): the row is marked dead with Stripe's reason, not left in flight", async () => {
  let marks = 0;
  const { calls, activities } = fakeActivities(
    async () => {
      throw ApplicationFailure.create({ type: ErrorTypes.rejected, message: 'No such customer', details: ['resource_missing'], nonRetryable: true });
    },
    {
      markDead: async () => {
        if (++marks === 1) throw new Error('connect ECONNREFUSED (our PostgreSQL away)');
      },
    },
  );
  await withWorker(activities, async (taskQueue) => {
    const handle = await start(taskQueue);
    await waitUntil(() => marks >= 1);
    await handle.cancel();
    await expect(handle.result()).rejects.toThrow();
    expect(calls.dead.map((d) => d.code)).toEqual(['resource_missing', 'resource_missing']);
    expect((await handle.describe()).typedSearchAttributes.get(OutboxErrorKey)).toBe('resource_missing');
  });
});

async function waitUntil(ok: () => boolean): Promise<void> {
  for (let i = 0; i < 200 && !ok(); i++) await new Promise((r) => setTimeout(r, 25));
  expect(ok()).toBe(true);
}

it("a relay continues as new after the calls per run its input names (set by its starter), the next run taking this release's figure", async () => {
  // Read from the input, not the code, so that a release lowering RELAY_CALLS_PER_RUN leaves a run
  // already past the new figure replaying as it ran (no non-determinism error).
  const runs: string[] = [];
  const activities = {
    async relayOutbox() {
      runs.push(activityInfo().workflowExecution?.runId ?? '');
    },
  };
  await withWorker(activities, async (taskQueue) => {
    const memo = { billingOutboxDeployment: 'deployment-a' };
    const handle = await env.client.workflow.start('relayWorkflow', { taskQueue, workflowId: `relay-${randomUUID()}`, memo, args: [{ relayId: 'r', callsPerRun: 3 } satisfies RelayWorkflowInput] });
    await waitFor('a second run', async () => new Set(runs).size >= 2 && runs.length >= 5);
    // Three calls in the first run, then the next run's.
    expect(new Set(runs.slice(0, 3)).size).toBe(1);
    expect(runs[3]).not.toBe(runs[0]);
    // The next run still says whose relay it is (workers refuse a task queue another deployment's relays hold).
    const next = await env.client.workflow.getHandle(handle.workflowId, runs[3]).describe();
    expect(next.memo).toEqual(memo);
    await handle.terminate('test over');
  });
  expect(RELAY_CALLS_PER_RUN).toBeGreaterThan(3);
});
