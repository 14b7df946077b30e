/**
 * `billing-outbox reconcile` and `billing-outbox cancel` on a real database against the local
 * Stripe server, through the real `stripe` client. Sent rows are made directly (insert, mark sent,
 * post the same meter event to Stripe): what reconciliation compares is exactly that pair.
 */
import type { Client } from '@temporalio/client';
import { randomUUID } from 'node:crypto';
import type Stripe from 'stripe';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { DeadLetterRetrier, windowRefusal } from '../src/ops/retry.js';
import type { Config } from '../src/config.js';
import { withTransaction } from '../src/db.js';
import { recordUsage } from '../src/outbox/enqueue.js';
import { findOperatorRow } from '../src/outbox/sql/operator.js';
import type { ReconcileReport } from '../src/ops/reconcile.js';
import { createStripeClient, sendMeterEvent } from '../src/stripe/client.js';
import { DEFAULT_METER_KEYS } from '../src/stripe/meters.js';
import { LocalStripe } from '../src/embedded/stripe/server.js';
import { addCustomer, createTestDb, runCliWithoutTemporal, testConfig, type TestDb } from './helpers.js';

const HOUR = 3_600_000;

let db: TestDb;
let stripe: LocalStripe;
let config: Config;
let client: Stripe;
/** Five whole hours ago: every test's usage sits in the hours after it (well inside Stripe's 35 days). */
let base: number;

beforeAll(async () => {
  db = await createTestDb();
  stripe = await LocalStripe.start({ meters: ['api_requests', 'tokens'] });
  config = testConfig({ STRIPE_API_BASE: stripe.url, STRIPE_API_KEY: 'sk_test_reconcile' });
  client = createStripeClient(config.stripe);
  base = Math.floor(Date.now() / HOUR) * HOUR - 5 * HOUR;
});

afterAll(async () => {
  await stripe?.close();
  await db?.drop();
});

interface Tenant {
  id: string;
  customer: string;
}

/** A tenant of the test's own, billed as a Stripe customer of its own. */
async function tenant(): Promise<Tenant> {
  const suffix = randomUUID().slice(0, 8);
  const t = { id: `t-${suffix}`, customer: `cus_${suffix}` };
  stripe.addCustomer(t.customer);
  await addCustomer(db.pool, t.id, t.customer);
  return t;
}

/**
 * An outbox row for `t`, `minutes` after `base`. `toStripe`: the same event is posted to Stripe
 * (identifier = key). `status`: what the row then says.
 */
async function event(
  t: Tenant,
  quantity: number,
  minutes: number,
  opts: { toStripe?: boolean; status?: string; eventName?: string } = {},
): Promise<string> {
  const occurredAt = new Date(base + minutes * 60_000);
  const eventName = opts.eventName ?? 'api_requests';
  const { entry } = await withTransaction(db.pool, (c) => recordUsage(c, { usageId: randomUUID(), tenantId: t.id, quantity, occurredAt, eventName }));
  const key = entry.idempotencyKey;
  if (opts.toStripe ?? true) await sendMeterEvent(client, { keys: DEFAULT_METER_KEYS, eventName, stripeCustomerId: t.customer, quantity, identifier: key, occurredAt });
  const status = opts.status ?? 'sent';
  await db.pool.query(
    `UPDATE outbox SET status = $2, attempt_count = 1, first_attempted_at = now(),
            sent_at = CASE WHEN $2 IN ('sent', 'rejected_async', 'cancelled') THEN now() END,
            dead_at = CASE WHEN $2 = 'dead' THEN now() END,
            last_error_code = CASE WHEN $2 = 'dead' THEN 'connection_error' END
      WHERE idempotency_key = $1`,
    [key, status],
  );
  return key;
}

const cli = (argv: string[]) => runCliWithoutTemporal(argv, config, db);

const at = (hours: number) => new Date(base + hours * HOUR).toISOString();

async function reconcileJson(args: string[]): Promise<{ code: number; report: ReconcileReport; err: string }> {
  const r = await cli(['reconcile', ...args, '--json']);
  return { code: r.code, report: JSON.parse(r.out) as ReconcileReport, err: r.err };
}

async function row(key: string) {
  const { rows } = await db.pool.query('SELECT * FROM outbox WHERE idempotency_key = $1', [key]);
  return rows[0] as Record<string, unknown> & { status: string };
}

describe('billing-outbox reconcile', () => {
  it('exits 0 when our sent rows are exactly what Stripe counted, hour by hour', async () => {
    const t = await tenant();
    await event(t, 3, 10);
    await event(t, 4, 50);
    await event(t, 5, 65);
    await event(t, 2, 70, { eventName: 'tokens' });
    // Stripe rejected this one after a 200: neither side counts it.
    stripe.asyncErrorNext(1, 'meter_event_invalid_value');
    await event(t, 100, 75, { status: 'rejected_async' });

    const { code, report } = await reconcileJson(['--from', at(0), '--to', at(3), '--tenant', t.id]);
    expect(code).toBe(0);
    expect(report).toMatchObject({ from: at(0), to: at(3), tenantId: t.id, match: true });
    expect(report.summary).toEqual({ pairs: 2, windows: 3, matching: 3, differing: 0, ours: 14, stripe: 14 });
    const api = report.groups.find((g) => g.eventName === 'api_requests')!;
    expect(api).toMatchObject({ stripeCustomerId: t.customer, tenantIds: [t.id], meterId: expect.stringMatching(/^mtr_/), problem: null, match: true });
    expect(api.windows.map((w) => [w.start, w.ours, w.stripe, w.delta, w.match])).toEqual([
      [at(0), 7, 7, 0, true],
      [at(1), 5, 5, 0, true],
    ]);
    expect(api.windows[1]!.rows).toEqual({ sent: 1, unsettled: 0, excluded: 1 });
    expect(api.windows[0]!.events).toEqual([]);
    expect(report.notes[0]).toContain('eventually consistent');

    const text = await cli(['reconcile', '--from', at(0), '--to', at(3), '--tenant', t.id]);
    expect(text.code).toBe(0);
    expect(text.out).toContain('eventually consistent');
    expect(text.out).toMatch(/^\s+WINDOW \(UTC\)\s+OURS\s+STRIPE\s+DELTA\s+RESULT/m);
    expect(text.out).toContain('result: everything matches');
  });

  it('exits 1 on a row marked sent that Stripe never received, naming the window and its events', async () => {
    const t = await tenant();
    const counted = await event(t, 3, 130);
    const missing = await event(t, 4, 140, { toStripe: false });
    await event(t, 6, 200);

    const { code, report } = await reconcileJson(['--from', at(2), '--to', at(4), '--tenant', t.id]);
    expect(code).toBe(1);
    expect(report.match).toBe(false);
    expect(report.summary).toMatchObject({ windows: 2, matching: 1, differing: 1, ours: 13, stripe: 9 });
    const [differing, fine] = report.groups[0]!.windows;
    expect(differing).toMatchObject({ start: at(2), end: at(3), ours: 7, stripe: 3, delta: -4, match: false, eventsOmitted: 0 });
    expect(differing!.events.map((e) => [e.key, e.quantity, e.status])).toEqual([
      [counted, 3, 'sent'],
      [missing, 4, 'sent'],
    ]);
    expect(differing!.hint).toContain('less than our sent rows');
    expect(fine).toMatchObject({ start: at(3), match: true, events: [] });

    const text = await cli(['reconcile', '--from', at(2), '--to', at(4), '--tenant', t.id]);
    expect(text.code).toBe(1);
    expect(text.out).toMatch(new RegExp(`${at(2).replace(':00.000Z', 'Z')}\\s+7\\s+3\\s+-4\\s+DIFFERS`));
    expect(text.out).toContain(`events in ${at(2).replace(':00.000Z', 'Z')}`);
    expect(text.out).toMatch(new RegExp(`${missing}\\s+${t.id}\\s+4\\s+sent`));
    expect(text.out).toContain('DIFFERENCES');
  });

  it('exits 1 on an extra event at Stripe, and on a dead letter that did reach Stripe', async () => {
    const t = await tenant();
    await event(t, 2, 10);
    // Something else reported usage for this customer.
    await client.billing.meterEvents.create({
      event_name: 'api_requests',
      payload: { stripe_customer_id: t.customer, value: '5' },
      identifier: `elsewhere-${randomUUID()}`,
      timestamp: Math.floor((base + 20 * 60_000) / 1000),
    });
    // A dead letter whose last attempt got through (the answer was lost).
    const dead = await event(t, 7, 70, { status: 'dead' });

    const { code, report } = await reconcileJson(['--from', at(0), '--to', at(2), '--tenant', t.id]);
    expect(code).toBe(1);
    const [first, second] = report.groups[0]!.windows;
    expect(first).toMatchObject({ ours: 2, stripe: 7, delta: 5, match: false });
    expect(first!.hint).toContain('more than our sent rows');
    expect(second).toMatchObject({ ours: 0, stripe: 7, delta: 7, match: false, rows: { sent: 0, unsettled: 1, excluded: 0 } });
    expect(second!.events).toEqual([expect.objectContaining({ key: dead, quantity: 7, status: 'dead', lastErrorCode: 'connection_error' })]);
    expect(second!.hint).toContain('most likely reached Stripe');
  });

  it('lists a dead letter in a matching window; the command the retry refusal suggests runs as given', async () => {
    const t = await tenant();
    await event(t, 1, 125);
    const dead = await event(t, 9, 130, { toStripe: false, status: 'dead' });
    await db.pool.query(`UPDATE outbox SET first_attempted_at = now() - interval '25 hours' WHERE idempotency_key = $1`, [dead]);

    const refusal = windowRefusal((await findOperatorRow(db.pool, dead))!, Date.now());
    const suggested = /`billing-outbox (reconcile [^`]+)`/.exec(refusal)?.[1];
    expect(suggested).toBe(`reconcile --from ${at(2)} --to ${at(3)} --tenant ${t.id}`);
    const { code, report } = await reconcileJson(suggested!.split(' ').slice(1));
    expect(code).toBe(0);
    const [window] = report.groups[0]!.windows;
    expect(window).toMatchObject({ start: at(2), ours: 1, stripe: 1, match: true, rows: { sent: 1, unsettled: 1, excluded: 0 } });
    expect(window!.events.map((e) => [e.key, e.status])).toContainEqual([dead, 'dead']);
    expect(window!.hint).toContain('does not hold them');
  });

  it('--tenant compares only the customer that tenant is billed as', async () => {
    const clean = await tenant();
    const broken = await tenant();
    await event(clean, 2, 10);
    await event(broken, 2, 10, { toStripe: false });

    expect((await cli(['reconcile', '--from', at(0), '--to', at(1), '--tenant', clean.id])).code).toBe(0);
    const one = await reconcileJson(['--from', at(0), '--to', at(1), '--tenant', broken.id]);
    expect(one.code).toBe(1);
    expect(one.report.groups.map((g) => g.stripeCustomerId)).toEqual([broken.customer]);
    const all = await reconcileJson(['--from', at(0), '--to', at(1)]);
    expect(all.code).toBe(1);
    expect(all.report.groups.map((g) => g.stripeCustomerId)).toEqual(expect.arrayContaining([clean.customer, broken.customer]));
    expect(all.report.groups.find((g) => g.stripeCustomerId === clean.customer)?.match).toBe(true);
  });

  it('aligns the range to whole hours and refuses bad ranges with exit 2', async () => {
    const t = await tenant();
    await event(t, 1, 185);
    const aligned = await reconcileJson(['--from', new Date(base + 3 * HOUR + 17 * 60_000).toISOString(), '--to', new Date(base + 3 * HOUR + 20 * 60_000).toISOString(), '--tenant', t.id]);
    expect(aligned.code).toBe(0);
    expect([aligned.report.from, aligned.report.to]).toEqual([at(3), at(4)]);

    const bad = async (args: string[], message: RegExp) => {
      const r = await cli(['reconcile', ...args]);
      expect(r.code).toBe(2);
      expect(r.err).toMatch(message);
      expect(r.out).toBe('');
    };
    await bad(['--from', at(2), '--to', at(1)], /--from is after --to/);
    await bad(['--from', at(0), '--to', new Date(base + 31 * 24 * HOUR + HOUR).toISOString()], /longer than 31 days/);
    await bad(['--from', at(1), '--to', at(1)], /range is empty/);
    await bad(['--from', 'yesterday', '--to', at(1)], /--from must be an ISO 8601 time/);
    await bad(['--from', '2026-03-10T09:00', '--to', at(1)], /--from must be an ISO 8601 time with a time zone/);
    // Days that do not exist are refused, not rolled over into the next month (was: December 1).
    for (const impossible of ['2026-11-31', '2026-02-29', '2026-11-31T10:00:00Z', '2026-11-30T24:00:00Z', '2026-11-31T01:00:00+02:00']) {
      await bad(['--from', impossible, '--to', at(1)], /--from must be an ISO 8601 time/);
    }
    await bad(['--to', at(1)], /--from is required/);
    await bad(['--from', at(0), '--to', at(1), '--tenant', 'no-such-tenant'], /no Stripe customer/);
    await bad(['--from', at(0), '--to', at(1), 'extra'], /unexpected argument/);
    // Exactly 31 days is allowed.
    expect((await cli(['reconcile', '--from', at(0), '--to', new Date(base + 31 * 24 * HOUR).toISOString(), '--tenant', t.id])).code).toBe(0);
  });
});

describe('billing-outbox cancel', () => {
  async function actionsFor(key: string) {
    const { rows } = await db.pool.query('SELECT actor, action, outcome, detail FROM operator_actions WHERE idempotency_key = $1 ORDER BY id', [key]);
    return rows as { actor: string; action: string; outcome: string; detail: string }[];
  }

  it('cancels a sent event within 24 h: Stripe stops counting it and reconcile still matches', async () => {
    const t = await tenant();
    await event(t, 2, 250);
    const key = await event(t, 8, 255);
    const before = await reconcileJson(['--from', at(4), '--to', at(5), '--tenant', t.id]);
    expect(before.report.groups[0]!.windows[0]).toMatchObject({ ours: 10, stripe: 10 });

    const r = await cli(['cancel', key, '--by', 'alice', '--json']);
    expect(r.code).toBe(0);
    const result = JSON.parse(r.out) as { key: string; outcome: string; message: string; row: { status: string; cancelledAt: string } };
    expect(result).toMatchObject({ key, outcome: 'cancelled', row: { status: 'cancelled', cancelledAt: expect.any(String) } });

    const cancelled = await row(key);
    expect(cancelled.status).toBe('cancelled');
    expect(cancelled.cancelled_at).toBeInstanceOf(Date);
    expect(stripe.events().find((e) => e.identifier === key)?.cancelled).toBe(true);
    expect(await actionsFor(key)).toEqual([expect.objectContaining({ actor: 'alice', action: 'cancel', outcome: 'cancelled' })]);

    const after = await reconcileJson(['--from', at(4), '--to', at(5), '--tenant', t.id]);
    expect(after.code).toBe(0);
    expect(after.report.groups[0]!.windows[0]).toMatchObject({ ours: 2, stripe: 2, match: true, rows: { sent: 1, unsettled: 0, excluded: 1 } });

    // A cancelled row cannot be cancelled again, nor retried (decided before Temporal is asked anything).
    const again = await cli(['cancel', key]);
    expect(again.code).toBe(1);
    expect(again.err).toContain('already cancelled');
    const retrier = new DeadLetterRetrier({ db: db.pool, client: {} as Client, config, now: Date.now });
    expect(await retrier.retryKey(key, { force: true, requestedBy: 'bob' })).toMatchObject({ outcome: 'refused', message: expect.stringContaining('cancelled at Stripe') });
    expect((await actionsFor(key)).map((a) => [a.actor, a.action, a.outcome])).toEqual([
      ['alice', 'cancel', 'cancelled'],
      ['test-operator', 'cancel', 'refused'],
      ['bob', 'retry', 'refused'],
    ]);
  });

  it('refuses an event sent 24 h ago or more without calling Stripe', async () => {
    const t = await tenant();
    const key = await event(t, 3, 30);
    await db.pool.query(`UPDATE outbox SET sent_at = now() - interval '25 hours' WHERE idempotency_key = $1`, [key]);

    const r = await cli(['cancel', key]);
    expect(r.code).toBe(1);
    expect(r.err).toContain('24 hours');
    expect(r.err).toContain('Stripe was not called');
    // Stripe received it minutes ago and would have accepted a cancel: it was never asked.
    expect(stripe.events().find((e) => e.identifier === key)?.cancelled).toBe(false);
    expect((await row(key)).status).toBe('sent');
    expect(await actionsFor(key)).toEqual([expect.objectContaining({ action: 'cancel', outcome: 'refused' })]);
  });

  it("reports Stripe's own refusal and leaves the row sent", async () => {
    const t = await tenant();
    // Stripe received it over 24 h ago by its own clock, although our sent_at is recent.
    const late = await event(t, 3, 40);
    stripe.advanceClock(25 * HOUR);
    try {
      const r = await cli(['cancel', late, '--json']);
      expect(r.code).toBe(1);
      const result = JSON.parse(r.out) as { outcome: string; message: string; row: { status: string } };
      expect(result).toMatchObject({ outcome: 'refused', row: { status: 'sent' } });
      expect(result.message).toContain('Stripe refused the cancel');
      expect(result.message).toContain('24 hours');
    } finally {
      stripe.advanceClock(-25 * HOUR);
    }
    expect((await row(late)).status).toBe('sent');

    // Marked sent, but Stripe has no such event.
    const unknown = await event(t, 1, 45, { toStripe: false });
    const r = await cli(['cancel', unknown]);
    expect(r.code).toBe(1);
    expect(r.err).toContain('resource_missing');
    expect(r.err).toContain('billing-outbox reconcile');
    expect((await row(unknown)).status).toBe('sent');
  });

  it('refuses rows that are not sent, and unknown keys; bad arguments exit 2', async () => {
    const t = await tenant();
    const dead = await event(t, 1, 50, { toStripe: false, status: 'dead' });
    const r = await cli(['cancel', dead]);
    expect(r.code).toBe(1);
    expect(r.err).toContain('dead letter');
    expect((await row(dead)).status).toBe('dead');

    const missing = await cli(['cancel', 'usage_log:does-not-exist']);
    expect(missing.code).toBe(1);
    expect(missing.err).toContain('no outbox row');

    expect((await cli(['cancel'])).code).toBe(2);
    expect((await cli(['cancel', 'a', 'b'])).code).toBe(2);
    expect((await cli(['cancel', dead, '--by', ''])).code).toBe(2);
  });
});
