/**
 * A retry that answers, and a Web UI list that says why: the `retry` Workflow Update (its
 * validator refuses before anything is recorded), `billing-outbox retry --wait` and
 * `retry --all-dead --wait`, and the OutboxError search attribute, on the real dev server.
 */
import { temporal } from '@temporalio/proto';
import { describe, expect, it } from 'vitest';
import { runCli } from '../src/cli/run.js';
import { DeadLetterRetrier } from '../src/ops/retry.js';
import { usageWorkflowStartOptions } from '../src/temporal/start-usage.js';
import { LIST_QUERIES } from '../src/temporal/web-ui.js';
import { OutboxErrorKey, OutboxStatusKey, retryUpdate, stateQuery } from '../workflows/shared.js';
import { refusedForGood, usePipeline, waitFor } from './hooks.js';

const t = usePipeline({
  // Every call for these customers is refused (a 400), until a test admits one: each event dies at once.
  customers: { fixme: 'cus_fixme', bulkw: 'cus_bulkw', ghostw: 'cus_ghostw', slowfix: 'cus_slowfix', noworker: 'cus_noworker' },
  stripe: {
    meters: ['api_requests'],
    refuseCustomers: Object.fromEntries(['cus_fixme', 'cus_bulkw', 'cus_ghostw', 'cus_slowfix', 'cus_noworker'].map((c) => [c, refusedForGood(c)])),
  },
});

async function cli(argv: string[], errIsTTY = false, config = t.config): Promise<{ code: number; out: string; err: string }> {
  let out = '';
  let err = '';
  const code = await runCli(argv, {
    config,
    db: async () => t.pool,
    temporal: async () => t.client,
    out: { write: (s: string) => (out += s) },
    err: { write: (s: string) => (err += s), isTTY: errIsTTY },
    user: 'test-operator',
  });
  return { code, out, err };
}

async function deadLetter(tenantId: string): Promise<string> {
  const key = await t.enqueue(tenantId, 1);
  await t.waitStatus(key, 'dead');
  await waitFor(`${key} workflow dead`, async () => (await t.client.workflow.getHandle(key).query(stateQuery)).status === 'dead');
  return key;
}

const attributes = async (key: string) => (await t.client.workflow.getHandle(key).describe()).typedSearchAttributes;

describe('retry --wait', () => {
  it('answers dead again with Stripe\'s code, then sent; the OutboxError attribute is set when dead and cleared by the retry', async () => {
    const key = await deadLetter('fixme');
    expect((await attributes(key)).get(OutboxErrorKey)).toBe('resource_missing');
    expect((await attributes(key)).get(OutboxStatusKey)).toBe('dead');
    // The Web UI's list (and its banner's link) filters on it.
    await waitFor('the dead letter listed by its error code', async () => {
      for await (const wf of t.client.workflow.list({ query: `${LIST_QUERIES.deadWithError('resource_missing')} AND WorkflowId = "${key}"` })) return wf;
      return undefined;
    });

    const again = await cli(['retry', key, '--wait']);
    expect(again.code).toBe(1);
    expect(again.err).toMatch(new RegExp(`^billing-outbox: retried ${key}: dead again after \\d+ attempt\\(s\\): resource_missing: `));
    expect((await t.row(key)).status).toBe('dead');
    expect((await attributes(key)).get(OutboxErrorKey)).toBe('resource_missing');

    t.stripe.admitCustomer('cus_fixme');
    const sent = await cli(['retry', key, '--wait']);
    expect(sent).toMatchObject({ code: 0, err: '' });
    expect(sent.out).toMatch(new RegExp(`^retried ${key}: sent after \\d+ attempt\\(s\\)\\n$`));
    // The answer came once the row was marked: no wait for it.
    expect((await t.row(key)).status).toBe('sent');
    expect(t.eventsFor(key)).toHaveLength(1);
    const after = await attributes(key);
    expect(after.get(OutboxErrorKey)).toBeUndefined();
    expect(after.get(OutboxStatusKey)).toBe('dispatched');
  });

  it('the Update\'s validator refuses a resend past the safe window with no history event; forced, it answers dead again', async () => {
    const key = await deadLetter('ghostw');
    const handle = t.client.workflow.getHandle(key);
    await handle.terminate('test: a run that did not make the first attempt');
    await t.pool.query(`UPDATE outbox SET first_attempted_at = now() - interval '25 hours' WHERE idempotency_key = $1`, [key]);
    // A run told that the first attempt was 25 h ago (as an operator's reopen tells it): its own
    // first attempt is refused as unsafe by the activity, and it waits as a dead letter.
    const row = await t.row(key);
    const options = usageWorkflowStartOptions({ idempotency_key: key, tenant_id: 'ghostw' }, t.config, { reusePolicy: 'ALLOW_DUPLICATE' });
    options.args = [{ ...options.args[0], firstAttemptedAt: (row.first_attempted_at as Date).getTime() }];
    const run = await t.client.workflow.start('usageWorkflow', options);
    // Dead, and settled: its markDead activity done and the workflow task after it completed (with
    // the timer of the dead letter's open days).
    const { EVENT_TYPE_ACTIVITY_TASK_COMPLETED, EVENT_TYPE_TIMER_STARTED } = temporal.api.enums.v1.EventType;
    await waitFor(`${key} dead again, settled`, async () => {
      const events = (await run.fetchHistory()).events ?? [];
      return events.some((e) => e.eventType === EVENT_TYPE_ACTIVITY_TASK_COMPLETED) && events.at(-1)?.eventType === EVENT_TYPE_TIMER_STARTED;
    });
    expect((await run.query(stateQuery)).status).toBe('dead');
    const requests = t.requestsFor(key).length;

    const before = (await run.fetchHistory()).events?.length;
    await expect(run.executeUpdate(retryUpdate, { args: [{ requestedBy: 'test' }] })).rejects.toMatchObject({
      cause: { type: 'RetryRefused', details: ['window'], message: expect.stringContaining('safe resend window') },
    });
    expect((await run.fetchHistory()).events?.length).toBe(before);
    expect((await run.query(stateQuery)).status).toBe('dead');
    expect(t.requestsFor(key)).toHaveLength(requests);

    // Forced, it is accepted (recorded), resent once, and answers with Stripe's refusal.
    const answer = await run.executeUpdate(retryUpdate, { args: [{ force: true, requestedBy: 'test' }] });
    expect(answer).toMatchObject({ status: 'dead', lastError: { code: 'resource_missing' } });
    expect((await run.fetchHistory()).events!.length).toBeGreaterThan(before!);
    expect(t.requestsFor(key)).toHaveLength(requests + 1);
  });

  it('waits no longer than its limit (and a query of the run\'s state): the retry stands, and the event is delivered once', async () => {
    const key = await deadLetter('slowfix');
    t.stripe.admitCustomer('cus_slowfix');
    // Stripe takes 8 s to answer; the wait's limit (10 minutes for the CLI) is 1 s here.
    t.stripe.setLatency(8_000);
    try {
      const retrier = new DeadLetterRetrier({ db: t.pool, schema: t.schema, client: t.client, config: t.config, now: Date.now });
      const began = Date.now();
      const retrying = retrier.retryKey(key, { force: false, requestedBy: 'test-operator', wait: { timeoutMs: 1_000 } });
      // Recorded before it acts, as started: a wait cut short (Ctrl-C) still leaves the row.
      const actions = async () => (await t.pool.query(`SELECT outcome, detail FROM operator_actions WHERE idempotency_key = $1`, [key])).rows;
      await waitFor('the retry recorded as started', async () => (await actions())[0]?.outcome === 'started', 5_000, 20);
      const result = await retrying;
      expect(await actions()).toEqual([{ outcome: 'retried', detail: result.message }]);
      // The limit, then the state as the run tells it: a query that waits for the attempt in the
      // workflow task gives up after 5 s. Either way, long before Stripe answers.
      expect(Date.now() - began).toBeLessThan(7_000);
      expect(result).toMatchObject({ key, outcome: 'retried', message: expect.stringMatching(/^no answer within 1 ?s; /) });
      // Not cancelled by the wait's end: the attempt goes on and the event is delivered, once.
      await t.waitStatus(key, 'sent');
      expect(t.eventsFor(key)).toHaveLength(1);
    } finally {
      t.stripe.setLatency(0);
    }
  });

  it('with no worker to take an Update, signals instead of waiting for one for good, and says so', async () => {
    const key = await deadLetter('noworker');
    // Its open run now on a task queue no worker polls: the state query and any Update go unanswered.
    await t.client.workflow.getHandle(key).terminate('test: moved to a task queue without workers');
    const options = usageWorkflowStartOptions({ idempotency_key: key, tenant_id: 'noworker' }, t.config, { reusePolicy: 'ALLOW_DUPLICATE' });
    const run = await t.client.workflow.start('usageWorkflow', { ...options, taskQueue: `nobody-${key}` });
    const began = Date.now();
    // The CLI of a deployment on that queue, all of whose workers are down.
    const r = await cli(['retry', key, '--wait'], false, { ...t.config, temporal: { ...t.config.temporal, taskQueue: `nobody-${key}` } });
    // The state query's 5 s, then the signal.
    expect(Date.now() - began).toBeLessThan(15_000);
    expect(r.out + r.err).toContain(`signalled its open workflow to retry (its state query went unanswered: is a worker running?; not waited for)`);
    const { EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED } = temporal.api.enums.v1.EventType;
    expect((await run.fetchHistory()).events?.some((e) => e.eventType === EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED)).toBe(true);
    const { rows } = await t.pool.query(`SELECT action, outcome FROM operator_actions WHERE idempotency_key = $1`, [key]);
    expect(rows).toEqual([expect.objectContaining({ outcome: 'signalled' })]);
    await run.terminate('test: done');
  });

  it('retry --all-dead --wait: progress on a terminal, then a table of outcomes (an open run and a reopened one)', async () => {
    const keys = [await deadLetter('bulkw'), await deadLetter('bulkw'), await deadLetter('bulkw')];
    const closed = t.client.workflow.getHandle(keys[2]!);
    await closed.terminate('test: closed dead letter');
    await waitFor('terminated', async () => (await closed.describe()).status.name === 'TERMINATED');
    t.stripe.admitCustomer('cus_bulkw');

    const r = await cli(['retry', '--all-dead', '--tenant', 'bulkw', '--wait', '--yes'], true);
    expect(r.code).toBe(0);
    expect(r.err).toMatch(/\r\[[#-]+\] \d+\/3 \d+% sent \d+ {2}dead again 0/);
    expect(r.out).toMatch(/^RESULT\s+CODE\s+EVENTS\s+FOR EXAMPLE$/m);
    expect(r.out).toMatch(/^sent\s+3\s+u:bulkw:/m);
    expect(r.out).toContain('3 matched; 0 signalled, 2 retried, 1 reopened, 0 skipped, 0 refused, 0 failed');
    for (const key of keys) {
      expect((await t.row(key)).status).toBe('sent');
      expect(t.eventsFor(key)).toHaveLength(1);
    }
  });
});
