/**
 * An event Stripe rejected after accepting it, end to end on the local Stripe (real worker, real
 * webhook route, real error reports): a dead letter whose first attempt reached Stripe with its
 * answer lost becomes `rejected_async` when Stripe's error report names it, a retry cannot turn
 * it into `sent` by "already exists", and `billing-outbox rebill` bills it once under a new
 * identifier (never twice: one revision however many operators rebill at once; a sent row refused).
 */
import { Client as TemporalClient, type Client } from '@temporalio/client';
import { randomBytes, randomUUID } from 'node:crypto';
import { Registry } from 'prom-client';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { buildApi, temporalHealthConnection, type Api } from '../src/api/index.js';
import { WEBHOOK_PATH } from '../src/api/webhooks.js';
import { runCli } from '../src/cli/run.js';
import type { Config } from '../src/config.js';
import { withTransaction } from '../src/db.js';
import { LocalStripe, signatureHeader, type ErrorReportEvent } from '../src/embedded/stripe/server.js';
import { createLogger } from '../src/log.js';
import { createMetrics } from '../src/metrics.js';
import { recordErrorReport } from '../src/ops/error-reports.js';
import { sweepClosedRuns } from '../src/ops/closed-runs.js';
import { rebillEvent } from '../src/ops/rebill.js';
import { DeadLetterRetrier } from '../src/ops/retry.js';
import { recordUsage } from '../src/outbox/enqueue.js';
import { beginAttempt, markDelivered, markSentAndHandOff } from '../src/outbox/sql/delivery.js';
import { markRejectedAsync } from '../src/outbox/sql/error-reports.js';
import { rebillRejected } from '../src/outbox/sql/operator.js';
import { OutboxErrorKey, OutboxStatusKey, reopenSignal, stateQuery } from '../workflows/shared.js';
import { addCustomer, createTestDb, startsAnswerLost, startTestPipeline, testConfig, waitFor, type TestDb, type TestPipeline } from './helpers.js';
import { schemaFor } from '../src/outbox/sql/schema.js';

const SECRET = `whsec_${randomBytes(16).toString('hex')}`;
const CUSTOMER = 'cus_rebill';
const CODE = 'meter_event_customer_not_found';

let db: TestDb;
let stripe: LocalStripe;
let config: Config;
let pipeline: TestPipeline;
let client: Client;
let api: Api;

beforeAll(async () => {
  db = await createTestDb();
  await addCustomer(db.pool, 'acme', CUSTOMER);
  stripe = await LocalStripe.start({ meters: ['api_requests'], customers: [CUSTOMER] });
  config = testConfig({
    STRIPE_API_BASE: stripe.url,
    STRIPE_API_KEY: 'sk_test_rebill',
    STRIPE_WEBHOOK_SECRET: SECRET,
    // After the lost answer the (customer, meter) lease is held this long: time to queue the 503s.
    STRIPE_UNANSWERED_HOLD_MS: '1500',
  });
  api = buildApi({ config, db: db.pool, log: createLogger('silent'), metrics: createMetrics(new Registry(), { db: db.pool }) });
  await api.ready();
  pipeline = await startTestPipeline({ db, config });
  client = pipeline.client;
});

afterAll(async () => {
  await pipeline?.stop();
  await api?.close();
  await stripe?.close();
  await db?.drop();
});

async function cli(argv: string[]): Promise<{ code: number; out: string; err: string }> {
  let out = '';
  let err = '';
  const code = await runCli(argv, {
    config,
    db: async () => db.pool,
    temporal: async () => client,
    out: { write: (s: string) => (out += s) },
    err: { write: (s: string) => (err += s) },
    user: 'test-operator',
  });
  return { code, out, err };
}

async function enqueue(quantity: number): Promise<string> {
  const r = await withTransaction(db.pool, (c) => recordUsage(c, { usageId: randomUUID(), tenantId: 'acme', quantity, occurredAt: new Date(Date.now() - 60_000) }));
  return r.entry.idempotencyKey;
}

async function row(key: string) {
  const { rows } = await db.pool.query('SELECT * FROM outbox WHERE idempotency_key = $1', [key]);
  return rows[0] as Record<string, unknown> & { status: string; identifier_revision: number; stripe_identifier: string | null };
}

const waitStatus = (key: string, status: string, timeoutMs = 30_000) =>
  waitFor(`${key} to be ${status}`, async () => ((await row(key))?.status === status ? row(key) : undefined), timeoutMs);

/** Events Stripe counts (not rejected, not cancelled) under `identifier`. */
const counted = (identifier: string) => stripe.events().filter((e) => e.identifier === identifier && !e.asyncError && !e.cancelled);
const requestsFor = (identifier: string) => stripe.requests().filter((r) => r.identifier === identifier);

async function actionsFor(key: string) {
  const { rows } = await db.pool.query('SELECT action, outcome, detail FROM operator_actions WHERE idempotency_key = $1 ORDER BY id', [key]);
  return rows as { action: string; outcome: string; detail: string }[];
}

const delivered = new Set<string>();

/**
 * Stripe's webhook: the error reports the local Stripe has published since the last call, each
 * POSTed to the API's route as Stripe sends it (the thin notification, signed), whenever the test
 * says (Stripe's report comes minutes after the call). Returns the route's answers.
 */
async function deliverReports(target: Api = api): Promise<{ statusCode: number; body: Record<string, unknown> }[]> {
  await stripe.flushAsyncErrors();
  const res = await fetch(`${stripe.url}/v2/core/events`, { headers: { authorization: 'Bearer sk_test_rebill' } });
  const events = ((await res.json()) as { data: ErrorReportEvent[] }).data.filter((e) => !delivered.has(e.id)).reverse();
  const answers = [];
  for (const event of events) {
    delivered.add(event.id);
    const { data: _data, ...thin } = event as unknown as Record<string, unknown>;
    const body = JSON.stringify(thin);
    const r = await target.inject({
      method: 'POST',
      url: WEBHOOK_PATH,
      headers: { 'content-type': 'application/json; charset=utf-8', 'stripe-signature': signatureHeader(body, SECRET) },
      payload: body,
    });
    answers.push({ statusCode: r.statusCode, body: r.json() });
  }
  return answers;
}

/** A sent event that Stripe's error report then rejects: `rejected_async`, its run completed. */
async function rejectedAfterSent(quantity: number): Promise<string> {
  stripe.asyncErrorNext(1, CODE);
  const key = await enqueue(quantity);
  await waitStatus(key, 'sent');
  const answers = await deliverReports();
  expect(answers.length).toBeGreaterThanOrEqual(1);
  for (const a of answers) expect(a.statusCode).toBe(200);
  await waitStatus(key, 'rejected_async');
  const handle = client.workflow.getHandle(key);
  await waitFor(`${key} run to complete`, async () => (await handle.describe()).status.name === 'COMPLETED');
  return key;
}

describe('an event Stripe rejected after accepting it', () => {
  it('lost answer → dead → error report: rejected_async; retry refused; rebill bills it once under a new identifier', async () => {
    // Attempt 1 reaches Stripe, which records the event (to be rejected later, asynchronously), and
    // the answer is lost (the library's own retry of the closed connection too).
    stripe.asyncErrorNext(1, CODE);
    stripe.dropAfterRecord(2);
    const key = await enqueue(7);
    await waitFor('Stripe to record attempt 1', async () => stripe.requests().some((r) => r.identifier === key && r.dropped));
    // Every later attempt gets a 5xx: the row dies.
    stripe.failNext(config.retry.maximumAttempts, 503);
    const dead = await waitStatus(key, 'dead');
    expect(dead.attempt_count).toBe(config.retry.maximumAttempts);
    expect(requestsFor(key)[0]).toMatchObject({ status: 200, dropped: true });
    expect(requestsFor(key).filter((r) => r.status === 503)).toHaveLength(config.retry.maximumAttempts - 1);
    expect(counted(key)).toHaveLength(0); // recorded, but rejected: Stripe does not count it

    // Stripe's error report names the event: the dead row becomes rejected_async with Stripe's code.
    const answers = await deliverReports();
    expect(answers).toEqual([{ statusCode: 200, body: expect.objectContaining({ matched: 1, marked: 1 }) }]);
    const rejected = await row(key);
    expect(rejected).toMatchObject({ status: 'rejected_async', last_error_code: CODE, identifier_revision: 0 });

    // A retry is refused and sends nothing: it would be told "already exists" and mark it sent.
    stripe.heal();
    const requestsBefore = requestsFor(key).length;
    const retry = await cli(['retry', key]);
    expect(retry.code).toBe(1);
    expect(retry.err).toMatch(/refused/);
    expect(retry.err).toContain(`billing-outbox rebill ${key}`);
    expect((await row(key)).status).toBe('rejected_async');
    expect(requestsFor(key)).toHaveLength(requestsBefore);

    // The cause fixed, rebill: a new identifier, delivered through the waiting dead letter's run.
    const rebill = await cli(['rebill', key, '--json']);
    expect(rebill.code).toBe(0);
    const result = JSON.parse(rebill.out) as Record<string, unknown>;
    expect(result).toMatchObject({ outcome: 'rebilled', previousIdentifier: key, identifier: `r1:${key}`, revision: 1 });
    expect(result.message).toMatch(/signalled its open workflow/);
    const sent = await waitStatus(key, 'sent');
    expect(sent).toMatchObject({ identifier_revision: 1, stripe_identifier: `r1:${key}`, attempt_count: 1 });
    const inspected = JSON.parse((await cli(['inspect', key, '--json'])).out) as { row: Record<string, unknown> };
    expect(inspected.row).toMatchObject({ status: 'sent', identifier: `r1:${key}`, identifierRevision: 1 });

    // Billed exactly once, under the new identifier; the old one still not counted.
    expect(counted(`r1:${key}`)).toHaveLength(1);
    expect(counted(`r1:${key}`)[0]).toMatchObject({ value: 7, customer: CUSTOMER });
    expect(counted(key)).toHaveLength(0);
    expect(requestsFor(key)).toHaveLength(requestsBefore);
    expect((await actionsFor(key)).map((a) => `${a.action}:${a.outcome}`)).toEqual(['retry:refused', 'rebill:rebilled']);
    expect((await actionsFor(key))[1]!.detail).toContain(`identifier ${key} → r1:${key}`);
  });

  it("the report tells the dead letter's open run, which ends listed rejected_async instead of offering a retry; rebill then bills it once with a new run", async () => {
    // The API as deployed: with its Temporal connection (its health probe's), over which it tells runs.
    const temporal = temporalHealthConnection(config.temporal);
    const telling = buildApi({ config, db: db.pool, log: createLogger('silent'), temporal });
    await telling.ready();
    try {
      stripe.asyncErrorNext(1, CODE);
      stripe.dropAfterRecord(2);
      const key = await enqueue(5);
      await waitFor('Stripe to record attempt 1', async () => stripe.requests().some((r) => r.identifier === key && r.dropped));
      stripe.failNext(config.retry.maximumAttempts, 503);
      await waitStatus(key, 'dead');
      const handle = client.workflow.getHandle(key);
      await waitFor('the dead letter run', async () => (await handle.query(stateQuery)).status === 'dead');

      expect(await deliverReports(telling)).toEqual([{ statusCode: 200, body: expect.objectContaining({ marked: 1 }) }]);
      // Told after the answer: the run reads its row and ends as it is, before its dead-letter deadline.
      await expect(handle.result()).resolves.toMatchObject({ status: 'rejected_async', lastError: null });
      const attributes = (await handle.describe()).typedSearchAttributes;
      expect([attributes.get(OutboxStatusKey), attributes.get(OutboxErrorKey)]).toEqual(['rejected_async', undefined]);
      expect(await row(key)).toMatchObject({ status: 'rejected_async', last_error_code: CODE });

      stripe.heal();
      const rebill = await cli(['rebill', key, '--json']);
      expect(rebill.code).toBe(0);
      await waitStatus(key, 'sent');
      expect(counted(`r1:${key}`)).toHaveLength(1);
      expect(counted(key)).toHaveLength(0);
    } finally {
      await telling.close();
      await temporal.close();
    }
  });

  it('two operators rebilling at once make one new revision and one delivery; a report on the old identifier leaves it alone', async () => {
    const key = await rejectedAfterSent(4);
    const firstSentAt = (await row(key)).sent_at as Date;
    const deps = { db: db.pool, schema: schemaFor(), client, config, now: Date.now };
    const results = await Promise.all([rebillEvent(deps, key, { actor: 'alice' }), rebillEvent(deps, key, { actor: 'bob' })]);
    expect(results.map((r) => r.outcome).sort()).toEqual(['rebilled', 'skipped']);
    const sent = await waitStatus(key, 'sent');
    expect(sent).toMatchObject({ identifier_revision: 1, stripe_identifier: `r1:${key}` });
    // Sent again, now: what `cancel`'s window and `status`'s recent counts go by, not the first acceptance.
    expect((sent.sent_at as Date).getTime()).toBeGreaterThan(firstSentAt.getTime());
    // The first delivery's run, and the one rebill's (visibility lags a little).
    const runs = async () => {
      const seen: string[] = [];
      for await (const wf of client.workflow.list({ query: `WorkflowId = "${key}"` })) seen.push(wf.status.name);
      return seen;
    };
    await waitFor('both runs to be listed', async () => (await runs()).length >= 2);
    expect(await runs()).toHaveLength(2);
    expect(counted(`r1:${key}`)).toHaveLength(1);
    expect(counted(key)).toHaveLength(0);

    // Stripe's verdict on the old identifier (a redelivered or late report) says nothing of the new one.
    const late = await recordErrorReport(
      db.pool,
      schemaFor(),
      { eventId: `evt_late_${randomUUID()}`, type: 'v1.billing.meter.error_report_triggered', meterId: null, errorCount: 1, errorTypes: [{ code: CODE, errorCount: 1, samples: [{ identifier: key, message: 'late' }] }], validationStart: null, validationEnd: null },
      {},
    );
    expect(late).toMatchObject({ marked: [], notSent: [{ key, status: 'superseded' }] });
    expect((await row(key)).status).toBe('sent');

    // Rebilled and delivered: a second rebill is refused (Stripe counts it now).
    const again = await rebillEvent(deps, key, { actor: 'carol' });
    expect(again.outcome).toBe('refused');
    expect((await row(key)).identifier_revision).toBe(1);
  });

  it("a rebill whose start's answer is lost after the server started the run stands: the row goes on with that run, billed once under the new identifier", async () => {
    const key = await rejectedAfterSent(6);
    const deps = { db: db.pool, schema: schemaFor(), client: startsAnswerLost(client.connection), config, now: Date.now };
    expect(await rebillEvent(deps, key, { actor: 'alice' })).toMatchObject({ outcome: 'rebilled' });
    expect(await waitStatus(key, 'sent')).toMatchObject({ identifier_revision: 1, stripe_identifier: `r1:${key}` });
    expect(counted(`r1:${key}`)).toHaveLength(1);
  });

  it('a rebill cut short after it moved the row (its start hanging on a slow Temporal, then Ctrl-C) has already recorded who began it; swept dead, a retry a day later bills the new identifier once, unforced', async () => {
    const key = await rejectedAfterSent(7);
    const hanging = new TemporalClient({ connection: client.connection, interceptors: { workflow: [{ start: () => new Promise<never>(() => undefined) }] } });
    void rebillEvent({ db: db.pool, schema: schemaFor(), client: hanging, config, now: Date.now }, key, { actor: 'alice' });
    await waitStatus(key, 'dispatched');
    expect(await actionsFor(key)).toEqual([{ action: 'rebill', outcome: 'started', detail: `rebill of identifier ${key}` }]);

    // As when Stripe's report came an hour after the delivery (here all within seconds): the run
    // closed well before the rebill, whatever Temporal's and PostgreSQL's clocks say.
    await db.pool.query(`UPDATE outbox SET rebilled_at = rebilled_at + interval '1 hour' WHERE idempotency_key = $1`, [key]);
    // No run delivers it: the closed-run sweep makes it dead (its run, the first delivery's, completed).
    await sweepClosedRuns({ db: db.pool, schema: schemaFor(), client, taskQueue: config.temporal.taskQueue }, { staleAfterMs: 0, batchSize: 100 });
    expect(await row(key)).toMatchObject({ status: 'dead', last_error_code: 'workflow_closed', first_attempted_at: null });
    // That run sent only the old identifier: its close bounds nothing of r1, which never reached Stripe.
    const aDayLater = new DeadLetterRetrier({ db: db.pool, schema: schemaFor(), client, config, now: () => Date.now() + 25 * 3_600_000 });
    expect(await aDayLater.retryKey(key, { force: false, requestedBy: 'test' })).toMatchObject({ outcome: 'reopened' });
    expect(await waitStatus(key, 'sent')).toMatchObject({ identifier_revision: 1, stripe_identifier: `r1:${key}` });
    expect(counted(`r1:${key}`)).toHaveLength(1);
  });

  it("a retry signalled to a rejected dead letter's workflow by hand (Web UI, temporal CLI) sends nothing and leaves it rejected", async () => {
    stripe.failNext(config.retry.maximumAttempts, 503);
    const key = await enqueue(6);
    await waitStatus(key, 'dead');
    const handle = client.workflow.getHandle(key);
    await waitFor(`${key} workflow to wait as a dead letter`, async () => (await handle.query(stateQuery)).status === 'dead');
    // Stripe's report names it (as if an attempt had reached Stripe with its answer lost).
    const report = await recordErrorReport(
      db.pool,
      schemaFor(),
      { eventId: `evt_dead_${randomUUID()}`, type: 'v1.billing.meter.error_report_triggered', meterId: null, errorCount: 1, errorTypes: [{ code: CODE, errorCount: 1, samples: [{ identifier: key, message: 'no customer' }] }], validationStart: null, validationEnd: null },
      {},
    );
    expect(report.marked).toEqual([key]);
    const before = requestsFor(key).length;
    await handle.signal(reopenSignal, { requestedBy: 'someone in the Web UI' });
    await waitFor(`${key} run to end`, async () => (await handle.describe()).status.name === 'COMPLETED');
    expect(requestsFor(key)).toHaveLength(before);
    expect(await row(key)).toMatchObject({ status: 'rejected_async', last_error_code: CODE, identifier_revision: 0 });
  });

  it('refuses to rebill a sent or a dead row: nothing sent, no new identifier', async () => {
    const key = await enqueue(2);
    await waitStatus(key, 'sent');
    const before = stripe.requests().length;
    const r = await cli(['rebill', key]);
    expect(r.code).toBe(1);
    expect(r.err).toMatch(/refused .*it is sent: Stripe counts it/);
    expect(await row(key)).toMatchObject({ status: 'sent', identifier_revision: 0, stripe_identifier: null });

    stripe.failNext(config.retry.maximumAttempts, 503);
    const deadKey = await enqueue(3);
    await waitStatus(deadKey, 'dead');
    const d = await cli(['rebill', deadKey]);
    expect(d.code).toBe(1);
    expect(d.err).toMatch(/retry it with the same identifier/);
    expect(await row(deadKey)).toMatchObject({ status: 'dead', identifier_revision: 0 });
    expect(stripe.requests().length).toBe(before + config.retry.maximumAttempts);
  });
});

describe('an attempt of the identifier before a rebill, answered late', () => {
  it('refuses to rebill while its run has an attempt in flight under the old identifier (the run would drop the signal): no new identifier', async () => {
    stripe.setLatency(6_000);
    try {
      const key = await enqueue(2);
      await waitFor(`${key} at Stripe`, async () => requestsFor(key).length > 0, 30_000);
      // Stripe's report on that identifier comes while the call is still out.
      await markRejectedAsync(db.pool, schemaFor(), [{ identifier: key, code: CODE, message: 'No such customer' }]);
      expect((await row(key)).status).toBe('rejected_async');
      const deps = { db: db.pool, schema: schemaFor(), client, config, now: Date.now };
      expect(await rebillEvent(deps, key, { actor: 'alice' })).toMatchObject({ outcome: 'refused', message: expect.stringContaining('still running') });
      expect(await row(key)).toMatchObject({ identifier_revision: 0, stripe_identifier: null });
    } finally {
      stripe.setLatency(0);
    }
  });

  /** A row no relay claims (already dispatched) and no run delivers: its statements are driven by the test. */
  async function dispatchedRow(name: string) {
    const key = `u:acme:${name}-${randomUUID()}`;
    await db.pool.query(
      `INSERT INTO outbox (tenant_id, event_name, quantity, occurred_at, idempotency_key, usage_id, status)
       VALUES ('acme', 'api_requests', 1, now() - interval '1 minute', $1, $1, 'dispatched')`,
      [key],
    );
    return { key, begin: () => beginAttempt(db.pool, schemaFor(), key, { workflowId: key, safeWindowMs: 3_600_000, force: false }) };
  }

  it('does not mark the rebilled row: it stays in flight under the new identifier until that one is delivered', async () => {
    const { key, begin } = await dispatchedRow('late');
    // An attempt under the key (revision 0) is begun and calls Stripe; its answer is slow to come
    // (a stalled worker, a zombie attempt Temporal already gave up on).
    const old = (await begin()).row!;
    expect(old).toMatchObject({ identifier: key, identifier_revision: 0 });
    // Meanwhile Stripe rejects that identifier (error report) and an operator rebills the row.
    await markRejectedAsync(db.pool, schemaFor(), [{ identifier: key, code: CODE, message: 'No such customer' }]);
    expect(await rebillRejected(db.pool, schemaFor(), key, { fromRevision: 0, identifier: `r1:${key}` })).toBeDefined();

    // The old attempt's answer ("already exists", or a late 200) arrives: it does not mark the row.
    expect(await markSentAndHandOff(db.pool, schemaFor(), key, 'old-holder', 1_000, old.identifier_revision)).toMatchObject({ attempts: null });
    expect(await markDelivered(db.pool, schemaFor(), key, 'accepted', old.identifier_revision)).toEqual({ attempts: null, first: false });
    expect(await row(key)).toMatchObject({ status: 'dispatched', identifier_revision: 1, stripe_identifier: `r1:${key}` });

    // The rebilled identifier's own attempt marks it.
    const next = (await begin()).row!;
    expect(next).toMatchObject({ identifier: `r1:${key}`, identifier_revision: 1 });
    expect((await markSentAndHandOff(db.pool, schemaFor(), key, 'new-holder', 1_000, next.identifier_revision)).attempts).toBe(1);
    expect(await row(key)).toMatchObject({ status: 'sent', identifier_revision: 1 });
  });

  it('a rebilled identifier is sent to the customer the tenant is mapped to now, even when its run never started and the row is retried later', async () => {
    const { key, begin } = await dispatchedRow('remapped');
    const old = (await begin()).row!;
    expect(await markSentAndHandOff(db.pool, schemaFor(), key, 'holder', 1_000, old.identifier_revision)).toMatchObject({ attempts: 1 });
    await markRejectedAsync(db.pool, schemaFor(), [{ identifier: key, code: CODE, message: 'No such customer' }]);
    // The operator fixes the mapping, then rebills; the command dies before its run starts, and the
    // row is later found dead and reopened (its first attempt stamped by the old run's close).
    await db.pool.query(`UPDATE billing_customers SET stripe_customer_id = 'cus_fixed' WHERE tenant_id = 'acme'`);
    try {
      expect(await rebillRejected(db.pool, schemaFor(), key, { fromRevision: 0, identifier: `r1:${key}` })).toBeDefined();
      await db.pool.query(`UPDATE outbox SET first_attempted_at = now() - interval '1 minute' WHERE idempotency_key = $1`, [key]);
      expect((await begin()).row).toMatchObject({ identifier: `r1:${key}`, stripe_customer_id: 'cus_fixed' });
    } finally {
      await db.pool.query(`UPDATE billing_customers SET stripe_customer_id = $1 WHERE tenant_id = 'acme'`, [CUSTOMER]);
    }
  });
});
