/**
 * POST /v1/stripe/webhooks on a real database, against the local Stripe server's real error
 * reports (signed thin events, full event fetched back with the real `stripe` client): signature
 * checks, rows marked rejected_async, redeliveries processed once, unmatched failures counted, and
 * what status, dead --rejected and the metrics show afterwards.
 */
import type { Client } from '@temporalio/client';
import { randomBytes, randomUUID } from 'node:crypto';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { Registry } from 'prom-client';
import type Stripe from 'stripe';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { buildApi, type Api } from '../src/api/index.js';
import { parseErrorReport, WEBHOOK_PATH } from '../src/api/webhooks.js';
import { BEGIN_SHORT, createPool } from '../src/db.js';
import { recordErrorReport } from '../src/ops/error-reports.js';
import { DeadLetterRetrier } from '../src/ops/retry.js';
import { markDelivered } from '../src/outbox/sql/delivery.js';
import type { AddressInfo } from 'node:net';
import { KEY_FILE_RECHECK_MS } from '../src/key-file.js';
import { createLogger } from '../src/log.js';
import { createMetrics, type Metrics } from '../src/metrics.js';
import { createStripeClient, sendMeterEvent } from '../src/stripe/client.js';
import { DEFAULT_METER_KEYS } from '../src/stripe/meters.js';
import { LocalStripe, signatureHeader, type ErrorReportEvent } from '../src/embedded/stripe/server.js';
import { runCliWithoutTemporal, testConfig, transactionsBegun, useStripe } from './hooks.js';

const SECRET = `whsec_${randomBytes(16).toString('hex')}`;
const CUSTOMER = 'cus_webhooks';
const STRIPE_KEY = 'sk_test_webhooks';
const REPORT = 'v1.billing.meter.error_report_triggered';

/** The local Stripe publishes error reports without delivering them: tests deliver them by hand, as they choose. */
const t = useStripe({
  customers: { acme: CUSTOMER },
  stripe: { meters: ['api_requests'] },
  env: { STRIPE_API_KEY: STRIPE_KEY, STRIPE_WEBHOOK_SECRET: SECRET },
});
let metrics: Metrics;
let app: Api;
let stripeClient: Stripe;
const extra: { close(): Promise<unknown> }[] = [];

beforeAll(async () => {
  metrics = createMetrics(new Registry(), { db: t.pool });
  app = buildApi({ config: t.config, db: t.pool, log: createLogger('silent'), metrics });
  await app.ready();
  stripeClient = createStripeClient(t.config.stripe);
});

afterAll(async () => {
  for (const c of extra.reverse()) await c.close();
  await app?.close();
});

/** An outbox row that is `sent`, and the same event recorded at Stripe (unless `toStripe` is false). */
async function sentEvent(quantity = 1, target: LocalStripe = t.stripe, client: Stripe = stripeClient): Promise<string> {
  const occurredAt = new Date(Date.now() - 120_000);
  const key = await t.enqueue('acme', quantity, { occurredAt });
  const eventName = (await row(key)).event_name as string;
  await sendMeterEvent(client, { keys: DEFAULT_METER_KEYS, eventName, stripeCustomerId: CUSTOMER, quantity, identifier: key, occurredAt });
  await t.pool.query(`UPDATE outbox SET status = 'sent', sent_at = now(), first_attempted_at = now(), attempt_count = 1 WHERE idempotency_key = $1`, [key]);
  expect(target.events().some((e) => e.identifier === key)).toBe(true);
  return key;
}

const row = async (key: string) => (await t.row(key)) as Record<string, unknown> & { status: string };

async function reports(): Promise<{ event_id: string; matched: number; unmatched: number; error_count: number }[]> {
  const { rows } = await t.pool.query('SELECT event_id, matched, unmatched, error_count FROM stripe_error_reports ORDER BY received_at');
  return rows;
}

/** Stripe's full error-report event naming `key` as its one sample, of `errorCount` failures. */
function reportNaming(key: string, errorCount = 1) {
  return {
    id: `evt_${randomUUID()}`,
    object: 'v2.core.event',
    type: REPORT,
    related_object: { id: 'mtr_local_1', type: 'billing.meter', url: '/v1/billing/meters/mtr_local_1' },
    data: {
      reason: {
        error_count: errorCount,
        error_types: [{ code: 'meter_event_customer_not_found', error_count: errorCount, sample_errors: [{ error_message: 'no such customer', request: { identifier: key } }] }],
      },
    },
  };
}

const seen = new Set<string>();

/**
 * The error reports the local Stripe published since the last call, in full (what
 * GET /v2/core/events/:id serves), oldest first. Stripe batches failures over a short window, so
 * one test's failures may come in more than one report.
 */
async function newReports(): Promise<ErrorReportEvent[]> {
  const res = await fetch(`${t.stripe.url}/v2/core/events`, { headers: { authorization: `Bearer ${STRIPE_KEY}` } });
  const body = (await res.json()) as { data: ErrorReportEvent[] };
  const fresh = body.data.filter((e) => !seen.has(e.id)).reverse();
  for (const e of fresh) seen.add(e.id);
  return fresh;
}

const identifiers = (events: ErrorReportEvent[]) =>
  events.flatMap((e) => e.data.reason.error_types.flatMap((type) => type.sample_errors.map((s) => s.request.identifier)));

/** The webhook body Stripe sends for an event: the thin notification, without `data`. */
function thinBody(event: ErrorReportEvent | Record<string, unknown>): string {
  const { data: _data, ...thin } = event as Record<string, unknown>;
  return JSON.stringify(thin);
}

function deliver(body: string, signature: string | null, target: Api = app) {
  return target.inject({
    method: 'POST',
    url: WEBHOOK_PATH,
    headers: { 'content-type': 'application/json; charset=utf-8', ...(signature === null ? {} : { 'stripe-signature': signature }) },
    payload: body,
  });
}

/** `count` sent events Stripe then reports as failed with `code`: published, not delivered. */
async function reportedFailures(code: string, count: number): Promise<{ keys: string[]; events: ErrorReportEvent[] }> {
  t.stripe.asyncErrorNext(count, code);
  const keys: string[] = [];
  for (let i = 0; i < count; i++) keys.push(await sentEvent(i + 1));
  await t.stripe.flushAsyncErrors();
  const events = await newReports();
  expect(identifiers(events)).toEqual(keys);
  return { keys, events };
}

/** Delivers every report, correctly signed; all must be acknowledged. Returns the answers' bodies. */
async function deliverAll(events: ErrorReportEvent[]): Promise<Record<string, number>[]> {
  const answers: Record<string, number>[] = [];
  for (const event of events) {
    const body = thinBody(event);
    const res = await deliver(body, signatureHeader(body, SECRET));
    expect(res.statusCode).toBe(200);
    answers.push(res.json());
  }
  return answers;
}

const sample = (text: string, name: string, labels: string) => {
  const line = text.split('\n').find((l) => l.startsWith(`${name}${labels} `));
  return line === undefined ? undefined : Number(line.slice(line.lastIndexOf(' ') + 1));
};

const cli = (argv: string[]) => runCliWithoutTemporal(argv, t.config, t.db);

describe('POST /v1/stripe/webhooks', () => {
  it('delivered by Stripe over HTTP: the named sent rows become rejected_async with Stripe\'s code', async () => {
    // A second local Stripe that delivers its reports itself, to an API listening on a real port.
    // Its target is filled in once the API listens on a port of its own (port 0: no port picked
    // beforehand that something else could take meanwhile); the reporter reads it when it delivers.
    const target = { url: '', secret: SECRET };
    const hooked = await LocalStripe.start({ customers: [CUSTOMER], webhook: target });
    extra.push(hooked);
    const liveConfig = testConfig({ STRIPE_API_BASE: hooked.url, STRIPE_API_KEY: STRIPE_KEY, STRIPE_WEBHOOK_SECRET: SECRET });
    const live = buildApi({ config: liveConfig, db: t.pool, log: createLogger('silent'), metrics: createMetrics(new Registry(), { db: t.pool }) });
    extra.push(live);
    await live.listen({ host: '127.0.0.1', port: 0 });
    target.url = `http://127.0.0.1:${(live.server.address() as AddressInfo).port}${WEBHOOK_PATH}`;
    const client = createStripeClient(liveConfig.stripe);

    hooked.asyncErrorNext(2, 'meter_event_customer_not_found');
    const bad = [await sentEvent(3, hooked, client), await sentEvent(4, hooked, client)];
    const good = await sentEvent(5, hooked, client);
    await hooked.flushAsyncErrors();

    const deliveries = hooked.webhookDeliveries();
    expect(deliveries.length).toBeGreaterThanOrEqual(1);
    for (const d of deliveries) expect(d).toMatchObject({ status: 200 });
    const ids = deliveries.map((d) => d.eventId);
    for (const key of bad) {
      const r = await row(key);
      expect(r).toMatchObject({ status: 'rejected_async', last_error_code: 'meter_event_customer_not_found' });
      expect(r.rejected_at).toBeInstanceOf(Date);
      expect(ids.some((id) => String(r.last_error_message).includes(id))).toBe(true);
    }
    expect((await row(good)).status).toBe('sent');
    const recorded = (await reports()).filter((r) => ids.includes(r.event_id));
    expect(recorded).toHaveLength(ids.length);
    expect(recorded.reduce((n, r) => n + r.matched, 0)).toBe(2);
    expect(recorded.reduce((n, r) => n + r.unmatched, 0)).toBe(0);
    expect(recorded.reduce((n, r) => n + r.error_count, 0)).toBe(2);
  });

  it('refuses a bad or missing signature with 400 and changes nothing', async () => {
    const { keys, events } = await reportedFailures('meter_event_invalid_value', 1);
    const event = events[0]!;
    const body = thinBody(event);
    const before = await reports();

    const wrongSecret = await deliver(body, signatureHeader(body, 'whsec_not_the_right_one'));
    expect(wrongSecret.statusCode).toBe(400);
    expect(wrongSecret.json()).toMatchObject({ error: { code: 'invalid_signature' } });

    const tampered = await deliver(body.replace(event.id, `${event.id}x`), signatureHeader(body, SECRET));
    expect(tampered.statusCode).toBe(400);

    const stale = await deliver(body, signatureHeader(body, SECRET, Math.floor(Date.now() / 1000) - 3600));
    expect(stale.statusCode).toBe(400);

    const missing = await deliver(body, null);
    expect(missing.statusCode).toBe(400);
    expect(missing.json().error.message).toContain('Stripe-Signature');

    const empty = await deliver('', signatureHeader('', SECRET));
    expect(empty.statusCode).toBe(400);

    for (const key of keys) expect((await row(key)).status).toBe('sent');
    expect(await reports()).toEqual(before);

    // The same body, correctly signed, is then accepted (no bearer token needed), also from a
    // Stripe whose clock is some minutes behind ours (or ours ahead).
    const ok = await deliver(body, signatureHeader(body, SECRET, Math.floor(Date.now() / 1000) - 8 * 60));
    expect(ok.statusCode).toBe(200);
    for (const key of keys) expect((await row(key)).status).toBe('rejected_async');
  });

  it('answers 503 with a clear message when STRIPE_WEBHOOK_SECRET is not set, changing nothing', async () => {
    const unconfigured = buildApi({
      config: testConfig({ STRIPE_API_BASE: t.stripe.url, STRIPE_API_KEY: STRIPE_KEY }),
      db: t.pool,
      log: createLogger('silent'),
    });
    extra.push(unconfigured);
    const { keys, events } = await reportedFailures('archived_meter', 1);
    const event = events[0]!;
    const body = thinBody(event);
    const res = await deliver(body, signatureHeader(body, SECRET), unconfigured);
    expect(res.statusCode).toBe(503);
    expect(res.json()).toMatchObject({ error: { code: 'webhook_not_configured' } });
    expect(res.json().error.message).toContain('STRIPE_WEBHOOK_SECRET');
    expect((await row(keys[0]!)).status).toBe('sent');
    expect((await reports()).map((r) => r.event_id)).not.toContain(event.id);
  });

  it("answers 503 naming the API's own key when Stripe refuses it reading the event (rolled, expired), counted as a credentials error; the report is taken once the key works", async () => {
    const staleMetrics = createMetrics(new Registry(), { db: t.pool });
    const stale = buildApi({
      config: testConfig({ STRIPE_API_BASE: t.stripe.url, STRIPE_API_KEY: 'sk_test_rolled_away', STRIPE_WEBHOOK_SECRET: SECRET }),
      db: t.pool,
      log: createLogger('silent'),
      metrics: staleMetrics,
    });
    extra.push(stale);
    const { keys, events } = await reportedFailures('meter_event_customer_not_found', 1);
    const body = thinBody(events[0]!);
    t.stripe.rollApiKey(STRIPE_KEY);
    try {
      const res = await deliver(body, signatureHeader(body, SECRET), stale);
      expect(res.statusCode).toBe(503);
      expect(res.json().error.code).toBe('stripe_credentials_refused');
      expect(res.json().error.message).toContain('STRIPE_API_KEY');
      expect(res.json().error.message).not.toContain('sk_test_rolled_away');
      expect(sample(await staleMetrics.render(), 'billing_outbox_stripe_errors_total', '{class="credentials"}')).toBe(1);
      expect((await row(keys[0]!)).status).toBe('sent');
      // Stripe redelivers; an API with the working key takes it.
      expect((await deliver(body, signatureHeader(body, SECRET))).statusCode).toBe(200);
      expect((await row(keys[0]!)).status).toBe('rejected_async');
    } finally {
      t.stripe.rollApiKey(undefined);
    }
  });

  it('verifies with a secret rolled in STRIPE_WEBHOOK_SECRET_FILE, read again while running, with no restart', async () => {
    const dir = mkdtempSync(path.join(tmpdir(), 'webhook-secret-'));
    extra.push({ close: async () => rmSync(dir, { recursive: true, force: true }) });
    const file = path.join(dir, 'whsec');
    writeFileSync(file, `${SECRET}\n`);
    const rolled = `whsec_${randomBytes(16).toString('hex')}`;
    const api = buildApi({
      config: testConfig({ STRIPE_API_BASE: t.stripe.url, STRIPE_API_KEY: STRIPE_KEY, STRIPE_WEBHOOK_SECRET_FILE: file }),
      db: t.pool,
      log: createLogger('silent'),
    });
    extra.push(api);
    const { keys, events } = await reportedFailures('meter_event_invalid_value', 1);
    const body = thinBody(events[0]!);
    // Signed with the new secret only: refused while the API verifies with the old one.
    expect((await deliver(body, signatureHeader(body, rolled), api)).statusCode).toBe(400);

    writeFileSync(file, `${rolled}\n`);
    await new Promise((resolve) => setTimeout(resolve, KEY_FILE_RECHECK_MS + 500));
    expect((await deliver(body, signatureHeader(body, SECRET), api)).statusCode).toBe(400);
    expect((await deliver(body, signatureHeader(body, rolled), api)).statusCode).toBe(200);
    for (const key of keys) expect((await row(key)).status).toBe('rejected_async');
  });

  it('processes a redelivered event once, also when two deliveries arrive together', async () => {
    const { keys, events } = await reportedFailures('meter_event_no_customer_defined', 1);
    const event = events[0]!;
    const body = thinBody(event);
    const counter = async () => sample(await metrics.render(), 'billing_outbox_async_rejections_total', '{code="meter_event_no_customer_defined"}') ?? 0;
    const countBefore = await counter();

    const [a, b] = await Promise.all([deliver(body, signatureHeader(body, SECRET)), deliver(body, signatureHeader(body, SECRET))]);
    expect([a.statusCode, b.statusCode]).toEqual([200, 200]);
    expect([a.json().duplicate, b.json().duplicate].sort()).toEqual([false, true]);
    const rejectedAt = (await row(keys[0]!)).rejected_at;

    const again = await deliver(body, signatureHeader(body, SECRET));
    expect(again.statusCode).toBe(200);
    expect(again.json()).toMatchObject({ received: true, duplicate: true });

    expect((await reports()).filter((r) => r.event_id === event.id)).toHaveLength(1);
    expect((await row(keys[0]!)).rejected_at).toEqual(rejectedAt);
    expect(await counter()).toBe(countBefore + 1);
  });

  it('counts failures it cannot tie to a row as unmatched, and marks a row still in flight so its late markSent cannot hide the rejection', async () => {
    t.stripe.asyncErrorNext(3, 'meter_event_invalid_value');
    const ours = await sentEvent(2);
    // An event at Stripe that is not in our outbox (another system, or a row lost in a restore).
    await stripeClient.billing.meterEvents.create({
      event_name: 'api_requests',
      payload: { stripe_customer_id: CUSTOMER, value: '1' },
      identifier: `not-ours-${randomUUID()}`,
    });
    // Ours, accepted by Stripe, but our workflow has not recorded it as sent yet.
    const inFlight = await sentEvent(1);
    await t.pool.query(`UPDATE outbox SET status = 'dispatched', sent_at = NULL WHERE idempotency_key = $1`, [inFlight]);
    await t.stripe.flushAsyncErrors();
    const events = await newReports();

    const answers = await deliverAll(events);
    const total = (field: string) => answers.reduce((n, a) => n + a[field]!, 0);
    expect({ errorCount: total('errorCount'), matched: total('matched'), marked: total('marked'), unmatched: total('unmatched') }).toEqual({
      errorCount: 3,
      matched: 2,
      marked: 2,
      unmatched: 1,
    });
    expect((await row(ours)).status).toBe('rejected_async');
    expect((await row(inFlight)).status).toBe('rejected_async');
    // The workflow's own bookkeeping arrives late and must leave the rejection in place.
    await markDelivered(t.pool, t.schema, inFlight, 'sent', 0);
    expect((await row(inFlight)).status).toBe('rejected_async');
    const recorded = (await reports()).filter((r) => events.some((e) => e.id === r.event_id));
    expect(recorded.reduce((n, r) => n + r.unmatched, 0)).toBe(1);
  });

  it("leaves alone a row never attempted that a sample names by its key: another deployment's event in the same Stripe account, unknown here", async () => {
    // Claimed and waiting for its first attempt (the lease, the pace): it has sent Stripe nothing.
    const key = await t.enqueue('acme', 4);
    await t.pool.query(`UPDATE outbox SET status = 'dispatched', dispatched_at = now() WHERE idempotency_key = $1`, [key]);
    const event = reportNaming(key);
    const outcome = await recordErrorReport(t.pool, t.schema, parseErrorReport(event), event);
    expect(outcome).toMatchObject({ matched: 0, marked: [], notSent: [], unknown: [key], unmatched: 1 });
    expect(await row(key)).toMatchObject({ status: 'dispatched', last_error_code: null });
  });

  it('counts failures Stripe did not name (it sends only samples) as unmatched', async () => {
    const key = await sentEvent(7);
    // Stripe reported 5 failures and named one of them.
    const event = reportNaming(key, 5);
    const outcome = await recordErrorReport(t.pool, t.schema, parseErrorReport(event), event);
    expect(outcome).toMatchObject({ duplicate: false, errorCount: 5, matched: 1, marked: [key], unmatched: 4 });
    expect((await row(key)).status).toBe('rejected_async');
    expect((await reports()).find((r) => r.event_id === event.id)).toMatchObject({ matched: 1, unmatched: 4, error_count: 5 });
  });

  it('records a report in a short transaction: one whose connection goes silent before COMMIT is ended by PostgreSQL, with the rows it locked', async () => {
    // What the report's transaction begins with (db-failover.test.ts: what BEGIN_SHORT does).
    const pool = createPool(t.db.url, 1);
    const begun = transactionsBegun(pool);
    try {
      const key = await sentEvent(2);
      const event = reportNaming(key);
      expect(await recordErrorReport(pool, t.schema, parseErrorReport(event), event)).toMatchObject({ marked: [key] });
      expect(begun).toEqual([BEGIN_SHORT]);
    } finally {
      await pool.end();
    }
  });

  it('refuses a signature dated in the future (it would stay replayable until then), and a signed event id that is not one', async () => {
    const body = JSON.stringify({ id: `evt_${randomUUID()}`, object: 'v2.core.event', type: 'v1.billing.meter.created', created: new Date().toISOString() });
    const inAnHour = Math.floor(Date.now() / 1000) + 3_600;
    const future = await deliver(body, signatureHeader(body, SECRET, inAnHour));
    expect(future.statusCode).toBe(400);
    expect(future.json().error).toMatchObject({ code: 'invalid_signature', message: expect.stringContaining('future') });
    // Some minutes ahead is a clock apart, taken (15 minutes either way); past that, refused.
    const sixteenAhead = await deliver(body, signatureHeader(body, SECRET, Math.floor(Date.now() / 1000) + 16 * 60));
    expect(sixteenAhead.statusCode).toBe(400);
    const { keys, events } = await reportedFailures('meter_event_invalid_value', 1);
    const report = thinBody(events[0]!);
    const eightAhead = await deliver(report, signatureHeader(report, SECRET, Math.floor(Date.now() / 1000) + 8 * 60));
    expect(eightAhead.statusCode).toBe(200);
    for (const key of keys) expect((await row(key)).status).toBe('rejected_async');
    // A present timestamp put before the future one the signature covers (Stripe's library reads the last).
    const twoStamps = await deliver(body, `t=${Math.floor(Date.now() / 1000)},${signatureHeader(body, SECRET, inAnHour)}`);
    expect(twoStamps.statusCode).toBe(400);
    expect(twoStamps.json().error).toMatchObject({ code: 'invalid_signature', message: 'the Stripe-Signature timestamp is missing, repeated or in the future' });

    // Correctly signed, but its id carries a NUL byte (PostgreSQL refuses it in text): a 400, not a
    // 500 that Stripe would redeliver for days.
    const nul = JSON.stringify({ id: 'evt_\u0000abc', object: 'v2.core.event', type: 'v1.billing.meter.error_report_triggered', created: new Date().toISOString() });
    const res = await deliver(nul, signatureHeader(nul, SECRET));
    expect(res.statusCode).toBe(400);
    expect(res.json().error.code).toBe('invalid_event');
  });

  it("processes a report that names its account (an organization's event destination sends this account's events with their account as context)", async () => {
    const { keys, events } = await reportedFailures('meter_event_invalid_value', 1);
    const named = JSON.stringify({ ...JSON.parse(thinBody(events[0]!)), context: 'acct_1OurOwnAccount' });
    const res = await deliver(named, signatureHeader(named, SECRET));
    expect(res.statusCode).toBe(200);
    expect(res.json()).toMatchObject({ received: true, handled: true, marked: keys.length });
    for (const key of keys) expect((await row(key)).status).toBe('rejected_async');
  });

  it('acknowledges other Stripe events without acting on them, and keeps JSON parsing on the other routes', async () => {
    const body = JSON.stringify({ id: `evt_${randomUUID()}`, object: 'v2.core.event', type: 'v1.billing.meter.created', created: new Date().toISOString() });
    const res = await deliver(body, signatureHeader(body, SECRET));
    expect(res.statusCode).toBe(200);
    expect(res.json()).toMatchObject({ received: true, handled: false });

    // The raw-body parser is the webhook route's only: /v1/usage still wants a bearer token and JSON.
    const usage = await app.inject({ method: 'POST', url: '/v1/usage', headers: { 'content-type': 'text/plain' }, payload: 'x' });
    expect(usage.statusCode).toBe(401);
  });

  it('shows rejections in status, dead --rejected and the metrics', async () => {
    const { keys, events } = await reportedFailures('meter_event_customer_not_found', 2);
    await deliverAll(events);
    const { rows } = await t.pool.query<{ n: number }>(`SELECT count(*)::int AS n FROM outbox WHERE status = 'rejected_async'`);
    const rejected = rows[0]!.n;

    const status = await cli(['status', '--json']);
    expect(status.code).toBe(0);
    const json = JSON.parse(status.out) as {
      counts: Record<string, number>;
      rejectedAsyncByErrorCode: { code: string; count: number }[];
      errorReports: { received: number; unmatched: number; matched: number; errorCount: number };
    };
    expect(json.counts.rejected_async).toBe(rejected);
    expect(json.counts.cancelled).toBe(0);
    expect(json.rejectedAsyncByErrorCode).toContainEqual({ code: 'meter_event_customer_not_found', count: expect.any(Number) });
    expect(json.errorReports.received).toBe((await reports()).length);
    expect(json.errorReports.unmatched).toBeGreaterThanOrEqual(5);

    const text = await cli(['status']);
    expect(text.out).toMatch(new RegExp(`^rejected_async\\s+${rejected}$`, 'm'));
    expect(text.out).toMatch(/^meter_event_customer_not_found\s+\d+$/m);
    expect(text.out).toContain('billing-outbox dead --rejected');
    expect(text.out).toMatch(/Stripe error reports: \d+ received/);
    expect(text.out).toContain('more events than those marked rejected_async may be affected');

    const dead = await cli(['dead', '--rejected', '--json']);
    expect(dead.code).toBe(0);
    const listing = JSON.parse(dead.out) as { total: number; items: { key: string; errorCode: string; rejectedAt: string; quantity: number }[] };
    expect(listing.total).toBe(rejected);
    for (const key of keys) expect(listing.items.find((i) => i.key === key)).toMatchObject({ errorCode: 'meter_event_customer_not_found', rejectedAt: expect.any(String) });
    const table = await cli(['dead', '--rejected']);
    expect(table.out).toMatch(/^KEY\s+TENANT\s+EVENT\s+QUANTITY\s+STRIPE ERROR\s+REJECTED AT\s+MESSAGE$/m);
    expect(table.out).toContain(keys[0]);
    // The plain dead-letter listing is about dead rows only, and a retry refuses them.
    expect((await cli(['dead'])).out).not.toContain(keys[0]);
    const retrier = new DeadLetterRetrier({ db: t.pool, schema: t.schema, client: {} as Client, config: t.config, now: Date.now });
    expect(await retrier.retryKey(keys[0]!, { force: false, requestedBy: 'bob' })).toMatchObject({
      outcome: 'refused',
      message: expect.stringContaining('meter_event_customer_not_found'),
    });

    const text2 = await metrics.render();
    expect(sample(text2, 'billing_outbox_rows', '{status="rejected_async"}')).toBe(rejected);
    expect(sample(text2, 'billing_outbox_rows', '{status="cancelled"}')).toBe(0);
    expect(sample(text2, 'billing_outbox_async_rejections_total', '{code="meter_event_customer_not_found"}')).toBeGreaterThanOrEqual(2);
  });
});
