/**
 * The whole path on real services: PostgreSQL outbox → relay → Temporal usage workflow → the local
 * Stripe-compatible server, with Stripe's failures injected as faults.
 */
import { randomUUID } from 'node:crypto';
import { describe, expect, it } from 'vitest';
import { recordErrorReport } from '../src/ops/error-reports.js';
import { startUsageWorkflow, usageWorkflowStartOptions } from '../src/temporal/start-usage.js';
import { reopenSignal, stateQuery } from '../workflows/shared.js';
import { refusedForGood, usePipeline, waitFor } from './hooks.js';

/** Eight tenants with one event each: eight lanes, so that each event's call is refused once. */
const SPREAD = Array.from({ length: 8 }, (_, i) => `spread${i}`);
const t = usePipeline({
  customers: { acme: 'cus_acme', globex: 'cus_globex', ghost: 'cus_ghost', ...Object.fromEntries(SPREAD.map((t) => [t, `cus_${t}`])) },
  // Every call for 'ghost' is refused (a 400): its events die at once.
  stripe: { meters: ['api_requests'], refuseCustomers: { cus_ghost: refusedForGood('cus_ghost') } },
});
const { enqueue, row, waitStatus, eventsFor, requestsFor } = t;

describe('the core pipeline', () => {
  it('delivers committed usage to Stripe once, with the idempotency key as identifier', async () => {
    const occurredAt = new Date(Date.now() - 3_600_000);
    const keys = [await enqueue('acme', 3, { occurredAt }), await enqueue('globex', 5, { occurredAt }), await enqueue('acme', 1, { occurredAt })];
    for (const key of keys) await waitStatus(key, 'sent');
    const recorded = keys.map((k) => eventsFor(k));
    expect(recorded.map((r) => r.length)).toEqual([1, 1, 1]);
    expect(recorded[1]![0]).toMatchObject({ eventName: 'api_requests', customer: 'cus_globex', value: 5, timestamp: Math.floor(occurredAt.getTime() / 1000) });
    const sent = await row(keys[0]!);
    expect(sent).toMatchObject({ attempt_count: 1, workflow_id: keys[0], last_error_code: null });
    expect(sent.sent_at).toBeInstanceOf(Date);
    expect(sent.first_attempted_at).toBeInstanceOf(Date);
    expect(await t.client.workflow.getHandle(keys[0]!).query(stateQuery)).toEqual({ status: 'sent', attempts: 1, lastError: null });
  });

  it('retries 5xx answers with Temporal backoff and bills once, with a fresh Idempotency-Key per attempt', async () => {
    t.stripe.failNext(2, 500);
    const key = await enqueue('acme', 4);
    const sent = await waitStatus(key, 'sent');
    expect(eventsFor(key)).toHaveLength(1);
    expect(sent.attempt_count).toBe(3);
    const requests = requestsFor(key);
    expect(requests.map((r) => r.status)).toEqual([500, 500, 200]);
    // One constant key would have replayed the stored 500 for a day.
    expect(new Set(requests.map((r) => r.idempotencyKey)).size).toBe(3);
  });

  it('treats a lost response after Stripe recorded the event as delivered: duplicate identifier → sent, one event', async () => {
    // Stripe records the event but the answer is lost, twice: the library's own retry of the closed
    // connection (same Idempotency-Key) is lost too, so the attempt fails and Temporal retries.
    t.stripe.dropAfterRecord(2);
    const key = await enqueue('globex', 9);
    // The next attempt waits out the unanswered call's hold on its (customer, meter) lease (the
    // Stripe timeout and more: about 25 s here), so more than the default wait.
    const sent = await waitStatus(key, 'sent', 50_000);
    expect(eventsFor(key)).toHaveLength(1);
    const requests = requestsFor(key);
    // The new attempt was refused as a duplicate identifier, which means Stripe already has it.
    expect(requests.at(-1)).toMatchObject({ status: 400 });
    expect(requests.at(-1)!.errorMessage).toMatch(/^An event already exists with identifier /);
    expect(sent.attempt_count).toBe(2);
    expect(await t.client.workflow.getHandle(key).query(stateQuery)).toMatchObject({ status: 'sent' });
  });

  it('treats a 200 with a malformed body as unknown: the resend finds the identifier taken → sent, one event', async () => {
    t.stripe.garbleNext(1);
    const key = await enqueue('globex', 11);
    const sent = await waitStatus(key, 'sent');
    expect(eventsFor(key)).toHaveLength(1);
    const requests = requestsFor(key);
    expect(requests.map((r) => r.status)).toEqual([200, 400]);
    expect(requests[1]!.errorMessage).toMatch(/^An event already exists with identifier /);
    expect(sent.attempt_count).toBe(2);
  });

  it('a single lost response is absorbed by the replayed answer: one event, one attempt', async () => {
    t.stripe.dropAfterRecord(1);
    const key = await enqueue('globex', 10);
    const sent = await waitStatus(key, 'sent');
    expect(eventsFor(key)).toHaveLength(1);
    expect(requestsFor(key).at(-1)).toMatchObject({ status: 200, replayed: true });
    expect(sent.attempt_count).toBe(1);
  });

  it('dead-letters a non-retryable 400 at once, with Stripe code and message on the row', async () => {
    const key = await enqueue('ghost', 2);
    const dead = await waitStatus(key, 'dead');
    expect(dead.attempt_count).toBe(1);
    expect(dead.last_error_code).toBe('resource_missing');
    expect(dead.last_error_message).toContain('cus_ghost');
    expect(eventsFor(key)).toHaveLength(0);
    const state = await t.client.workflow.getHandle(key).query(stateQuery);
    expect(state).toMatchObject({ status: 'dead', attempts: 1, lastError: { code: 'resource_missing' } });
  });

  it('dead-letters after the last attempt, then a retry signal sends it with the same identifier', async () => {
    t.stripe.failNext(4, 503);
    const key = await enqueue('acme', 6);
    const dead = await waitStatus(key, 'dead');
    expect(dead.attempt_count).toBe(t.config.retry.maximumAttempts);
    // Stripe's 503 carries no code: the row says the status, and Stripe's own message.
    expect(dead.last_error_code).toBe('http_503');
    expect(dead.last_error_message).toContain("Stripe's end");
    expect(eventsFor(key)).toHaveLength(0);

    // The workflow is still open, waiting for a human.
    const handle = t.client.workflow.getHandle(key);
    const described = await handle.describe();
    expect(described.status.name).toBe('RUNNING');
    // The Web UI at a glance: the static summary says what the event is, the current details what
    // went wrong and the exact command that retries it.
    expect(await described.staticSummary()).toMatch(/^acme: 6 × api_requests at \d{4}-\d\d-\d\dT/);
    const details = await waitFor('the dead letter described', async () => {
      const metadata = await handle.query<{ currentDetails?: string }>('__temporal_workflow_metadata');
      return metadata.currentDetails?.startsWith('**Dead letter**') ? metadata.currentDetails : undefined;
    });
    expect(details).toContain(dead.last_error_code!);
    expect(details).toContain(`billing-outbox retry ${key}`);
    await handle.signal(reopenSignal);
    const sent = await waitStatus(key, 'sent');
    expect(sent.attempt_count).toBe(t.config.retry.maximumAttempts + 1);
    expect(eventsFor(key)).toHaveLength(1);
    expect(eventsFor(key)[0]!.identifier).toBe(key);
    await waitFor('workflow to complete', async () => (await handle.describe()).status.name === 'COMPLETED');
  });

  it('finds dead letters by the OutboxStatus and TenantId search attributes', async () => {
    const key = await enqueue('ghost', 1);
    await waitStatus(key, 'dead');
    const q = `TaskQueue = "${t.config.temporal.taskQueue}" AND OutboxStatus = "dead" AND TenantId = "ghost"`;
    const ids = await waitFor('dead letters in visibility', async () => {
      const found: string[] = [];
      for await (const wf of t.client.workflow.list({ query: q })) found.push(wf.workflowId);
      return found.includes(key) ? found : undefined;
    });
    expect(ids).toContain(key);
    const sentQuery = `TaskQueue = "${t.config.temporal.taskQueue}" AND OutboxStatus = "dead" AND TenantId = "acme"`;
    const acme: string[] = [];
    for await (const wf of t.client.workflow.list({ query: sentQuery })) acme.push(wf.workflowId);
    expect(acme).not.toContain(key);
  });

  it("a row Stripe's error report rejects while its call is still at Stripe: the run ends listed rejected_async, not as one more delivered event", async () => {
    // Stripe records the event at once and answers 2 s later: the report lands in between.
    t.stripe.setLatency(2_000);
    let key: string;
    try {
      key = await enqueue('acme', 6);
      await waitFor('its call to be at Stripe', async () => (t.stripe.callsInFlight() > 0 && eventsFor(key).length > 0) || undefined, 30_000, 20);
      const report = {
        eventId: `evt_${randomUUID()}`,
        type: 'v1.billing.meter.error_report_triggered',
        meterId: null,
        errorCount: 1,
        errorTypes: [{ code: 'meter_event_no_customer_defined', errorCount: 1, samples: [{ identifier: key, message: 'no such customer' }] }],
        validationStart: null,
        validationEnd: null,
      };
      expect((await recordErrorReport(t.pool, t.schema, report, {})).marked).toEqual([key]);
    } finally {
      t.stripe.setLatency(0);
    }
    const handle = t.client.workflow.getHandle(key);
    expect(await handle.result()).toMatchObject({ status: 'rejected_async' });
    expect((await handle.describe()).searchAttributes.OutboxStatus).toEqual(['rejected_async']);
    expect((await row(key)).status).toBe('rejected_async');
    expect(eventsFor(key)).toHaveLength(1);
  });

  it('never starts a second run for an event: duplicate start is refused, running or closed', async () => {
    const key = await enqueue('acme', 2);
    await waitStatus(key, 'sent');
    await waitFor('workflow to complete', async () => (await t.client.workflow.getHandle(key).describe()).status.name === 'COMPLETED');
    // A late relay (or a restart) tries to start it again after it finished.
    // The relay makes such a row dead (workflow_closed); no second run either way.
    expect(await startUsageWorkflow(t.client, { idempotency_key: key, tenant_id: 'acme' }, t.config)).toMatchObject({ kind: 'closed', status: 'COMPLETED' });
    const runs: string[] = [];
    for await (const wf of t.client.workflow.list({ query: `WorkflowId = "${key}"` })) runs.push(wf.runId);
    expect(runs).toHaveLength(1);
    expect(eventsFor(key)).toHaveLength(1);

    // While its run is still open: Stripe answers slowly, a second start comes meanwhile.
    t.stripe.setLatency(2_000);
    let open: string;
    try {
      open = await enqueue('acme', 3);
      await waitStatus(open, 'dispatched', 10_000);
      expect((await t.client.workflow.getHandle(open).describe()).status.name).toBe('RUNNING');
      expect(await startUsageWorkflow(t.client, { idempotency_key: open, tenant_id: 'acme' }, t.config)).toEqual({ kind: 'running' });
    } finally {
      t.stripe.setLatency(0);
    }
    await waitStatus(open, 'sent');
    const openRuns: string[] = [];
    for await (const wf of t.client.workflow.list({ query: `WorkflowId = "${open}"` })) openRuns.push(wf.runId);
    expect(openRuns).toHaveLength(1);
    expect(eventsFor(open)).toHaveLength(1);
  });

  it('recovers a crash between claim and start: the lease lapses, one run, one meter event', async () => {
    // The row is committed already claimed, as a relay that claimed it and died before starting its
    // workflow leaves it: the live relay never saw it pending, and must wait out the lease.
    const key = await enqueue('globex', 8, {
      beforeCommit: (c, k) =>
        c.query(
          `UPDATE outbox SET status = 'claimed', claimed_by = 'crashed-relay', claim_id = $2, processing_deadline = clock_timestamp() + interval '1 second'
            WHERE idempotency_key = $1`,
          [k, randomUUID()],
        ),
    });
    const sent = await waitStatus(key, 'sent');
    expect(sent.claimed_by).not.toBe('crashed-relay');
    expect(eventsFor(key)).toHaveLength(1);
    const runs: string[] = [];
    for await (const wf of t.client.workflow.list({ query: `WorkflowId = "${key}"` })) runs.push(wf.runId);
    expect(runs).toHaveLength(1);
  });

  it('recovers a crash between start and marking dispatched: re-claim finds the run, no second one', async () => {
    // As a relay that claimed the row, started its workflow and died before marking it would
    // leave it: started, still `claimed`, with a lease about to lapse.
    const key = await enqueue('acme', 11, {
      beforeCommit: (c, k) =>
        c.query(
          `UPDATE outbox SET status = 'claimed', claimed_by = 'dead-relay', claim_id = $2, processing_deadline = clock_timestamp() + interval '1 second'
            WHERE idempotency_key = $1`,
          [k, randomUUID()],
        ),
    });
    // Stripe answers slowly, so the run is still in flight when a relay re-claims the row.
    t.stripe.setLatency(2_000);
    try {
      expect(await startUsageWorkflow(t.client, { idempotency_key: key, tenant_id: 'acme' }, t.config)).toEqual({ kind: 'started' });
      // The live relay re-claims it, finds the run already started, and marks it dispatched.
      const dispatched = await waitStatus(key, 'dispatched', 10_000);
      expect(dispatched.claimed_by).not.toBe('dead-relay');
    } finally {
      t.stripe.setLatency(0);
    }
    await waitStatus(key, 'sent');
    const runs: string[] = [];
    for await (const wf of t.client.workflow.list({ query: `WorkflowId = "${key}"` })) runs.push(wf.runId);
    expect(runs).toHaveLength(1);
    expect(eventsFor(key)).toHaveLength(1);
  });

  it("sends the customer and value under the payload keys of the event's own meter", async () => {
    // A meter configured with its own keys: an event under the default keys would be answered 200
    // and rejected later by Stripe (meter_event_no_customer_defined).
    t.stripe.addMeter('gpu_seconds', { customerKey: 'account', valueKey: 'seconds' });
    const key = await enqueue('acme', 42, { eventName: 'gpu_seconds' });
    await waitStatus(key, 'sent');
    const [event] = eventsFor(key);
    expect(event).toMatchObject({ eventName: 'gpu_seconds', customer: 'cus_acme', value: 42, payload: { account: 'cus_acme', seconds: '42' } });
    expect(event!.asyncError).toBeUndefined();
  });

  it("an event sent to a meter deactivated since the worker read the list (v1: Stripe's no_meter at once): waits for its replacement, then sent to it once", async () => {
    const before = t.stripe.addMeter('swap_units');
    const first = await enqueue('acme', 1, { eventName: 'swap_units' });
    await waitStatus(first, 'sent');
    // The operator's first step: the worker's list (read a moment ago) still names the old meter.
    t.stripe.deactivateMeter('swap_units');
    const key = await enqueue('acme', 5, { eventName: 'swap_units' });
    const waiting = await waitFor('waiting for the meter', async () => {
      const r = await row(key);
      return r.last_error_code === 'meter_replacing' ? r : undefined;
    });
    expect(waiting.status).toBe('dispatched');
    expect(waiting.last_error_message).toMatch(/waiting for its replacement/);
    // Refused by Stripe, taken back: not an attempt of the event's budget.
    expect(waiting.attempt_count).toBe(0);
    // The second step: the new meter, with its own payload keys.
    const after = t.stripe.addMeter('swap_units', { customerKey: 'account', valueKey: 'units' });
    expect(after).not.toBe(before);
    await waitStatus(key, 'sent');
    expect(eventsFor(key)).toEqual([expect.objectContaining({ value: 5, payload: { account: 'cus_acme', units: '5' } })]);
  });

  it('dead-letters an event whose meter does not exist at Stripe, with the reason, without sending it', async () => {
    const key = await enqueue('acme', 1, { eventName: 'no_such_meter' });
    const dead = await waitStatus(key, 'dead');
    expect(dead.last_error_code).toBe('no_meter');
    expect(dead.last_error_message).toMatch(/no active meter for event name "no_such_meter"/);
    expect(requestsFor(key)).toHaveLength(0);
  });

  it('dead-letters usage that aged past Stripe\'s 35-day window in the outbox, before calling Stripe', async () => {
    // recordUsage refuses such usage at the door; a row can still age past the window while it
    // waits (a long outage): written here as it would be found then.
    const key = await enqueue('acme', 3, {
      beforeCommit: (c, k) => c.query(`UPDATE outbox SET occurred_at = now() - interval '36 days' WHERE idempotency_key = $1`, [k]),
    });
    const dead = await waitStatus(key, 'dead');
    expect(dead.last_error_code).toBe('timestamp_too_far_in_past');
    expect(dead.last_error_message).toMatch(/35-day/);
    expect(requestsFor(key)).toHaveLength(0);
  });

  it('refuses a retry past the 24 h identifier window, and sends on a forced retry', async () => {
    t.stripe.failNext(4, 503);
    const key = await enqueue('acme', 12);
    await waitStatus(key, 'dead');
    const before = requestsFor(key).length;
    // The event was first attempted 25 hours ago: Stripe may have forgotten its identifier.
    await t.pool.query(`UPDATE outbox SET first_attempted_at = now() - interval '25 hours' WHERE idempotency_key = $1`, [key]);
    const handle = t.client.workflow.getHandle(key);
    await handle.signal(reopenSignal);
    const refused = await waitFor('the refusal', async () => {
      const r = await row(key);
      return r.status === 'dead' && r.last_error_code === 'identifier_window_expired' ? r : undefined;
    });
    expect(refused.last_error_message).toMatch(/24 h/);
    // What made it dead before stays in view.
    expect(refused.last_error_message).toMatch(/Its last error: http_503: /);
    expect(refused.attempt_count).toBe(t.config.retry.maximumAttempts);
    expect(requestsFor(key)).toHaveLength(before);

    await handle.signal(reopenSignal, { force: true, requestedBy: 'test' });
    await waitStatus(key, 'sent');
    expect(eventsFor(key)).toHaveLength(1);
  });

  it('waits out 429s without spending retry attempts: more 429s than the attempt budget still end sent', async () => {
    // Twice the configured maximum attempts, all 429: a failure-counting policy would dead-letter it.
    t.stripe.failNext(t.config.retry.maximumAttempts * 2, 429, { retryAfterSeconds: 0 });
    const key = await enqueue('globex', 4);
    const sent = await waitStatus(key, 'sent', 60_000);
    const statuses = requestsFor(key).map((r) => r.status);
    expect(statuses.filter((s) => s === 429)).toHaveLength(t.config.retry.maximumAttempts * 2);
    expect(statuses.at(-1)).toBe(200);
    expect(sent.last_error_code).toBeNull();
    expect(eventsFor(key)).toHaveLength(1);
  });

  it('dead-letters an event Stripe keeps refusing with 429 for longer than RETRY_MAX_RATE_LIMITED_MS', async () => {
    // A separate run with a 2 s budget for 429s, against the same database and Stripe.
    const shortConfig = t.configWith({ RETRY_MAX_RATE_LIMITED_MS: '2000' });
    const short = await t.startPipeline(shortConfig, { worker: false });
    try {
      t.stripe.failNext(1_000, 429, { retryAfterSeconds: 0 });
      // Committed as handed to a workflow already: the file's own relay leaves it to this one.
      const key = await enqueue('acme', 1, {
        beforeCommit: (c, k) => c.query(`UPDATE outbox SET status = 'dispatched' WHERE idempotency_key = $1`, [k]),
      });
      await short.client.workflow.start('usageWorkflow', usageWorkflowStartOptions({ idempotency_key: key, tenant_id: 'acme' }, shortConfig, { reusePolicy: 'REJECT_DUPLICATE' }));
      await short.addWorker();
      const dead = await waitStatus(key, 'dead');
      expect(dead.last_error_code).toBe('rate_limited');
      expect(eventsFor(key)).toHaveLength(0);
    } finally {
      // Forget the 429s still queued (and what this Stripe recorded so far: each test checks its own keys).
      t.stripe.reset();
      await short.stop();
    }
  });

  it('honours Retry-After on a 429', async () => {
    t.stripe.failNext(1, 429, { retryAfterSeconds: 2 });
    const started = Date.now();
    const key = await enqueue('globex', 2);
    await waitStatus(key, 'sent');
    const requests = requestsFor(key);
    expect(requests.map((r) => r.status)).toEqual([429, 200]);
    // The retry policy alone would have come back after ~50 ms; Stripe asked for 2 s.
    expect(requests[1]!.at - requests[0]!.at).toBeGreaterThanOrEqual(1_900);
    expect(Date.now() - started).toBeGreaterThanOrEqual(1_900);
  });

  it('spreads the retries after a 429 (Retry-After plus jitter), so refused calls do not come back as one burst', async () => {
    // Eight events refused with the same Retry-After: without jitter they would all come back one
    // second later, together. With up to rateLimitJitterMs (500 ms, src/config.ts) each, eight waits fall
    // within 100 ms of each other with probability ~1e-4. One event per lane: a lane's events share its
    // call, and its lane window may hold it to one in flight, which would take all eight 429s.
    t.stripe.failNext(8, 429, { retryAfterSeconds: 1 });
    const keys = await Promise.all(SPREAD.map((tenant, i) => enqueue(tenant, 20 + i)));
    for (const key of keys) await waitStatus(key, 'sent');
    const waits = keys.map((key) => {
      const requests = requestsFor(key);
      const refused = requests.find((r) => r.status === 429);
      const accepted = requests.find((r) => r.status === 200);
      return refused && accepted ? accepted.at - refused.at : undefined;
    });
    const measured = waits.filter((w): w is number => w !== undefined);
    // Each of the eight got the 429 (the eight refused calls were theirs) and was sent once after it.
    expect(measured).toHaveLength(8);
    for (const key of keys) expect(eventsFor(key)).toHaveLength(1);
    for (const w of measured) expect(w).toBeGreaterThanOrEqual(950);
    expect(Math.max(...measured) - Math.min(...measured)).toBeGreaterThan(100);
  });
});
