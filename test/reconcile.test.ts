/**
 * `billing-outbox reconcile` and `billing-outbox cancel` on a real database against the local
 * Stripe server, through the real `stripe` client. Sent rows are made directly (insert, mark sent,
 * post the same meter event to Stripe): what reconciliation compares is exactly that pair.
 */
import type { Client } from '@temporalio/client';
import { randomUUID } from 'node:crypto';
import type Stripe from 'stripe';
import { beforeAll, describe, expect, it, vi } from 'vitest';
import { DeadLetterRetrier, windowRefusal } from '../src/ops/retry.js';
import { findOperatorRow } from '../src/outbox/sql/operator.js';
import { reconcile, type ReconcileReport } from '../src/ops/reconcile.js';
import { createStripeClient, sendMeterEvent } from '../src/stripe/client.js';
import { DEFAULT_METER_KEYS } from '../src/stripe/meters.js';
import { AT_STRIPE } from '../src/outbox/statuses.js';
import { idempotencyKeyFor, runCliWithoutTemporal, useStripe } from './hooks.js';

const HOUR = 3_600_000;

const t = useStripe({ stripe: { meters: ['api_requests', 'tokens'] } });

beforeAll(() => {
  // Meters that aggregate otherwise than by sum (Stripe's default_aggregation.formula).
  t.stripe.addMeter('logins', { formula: 'count' });
  t.stripe.addMeter('seats', { formula: 'last' });
});
let client: Stripe;
/** Five whole hours ago: every test's usage sits in the hours after it (well inside Stripe's 35 days). */
let base: number;

beforeAll(() => {
  client = createStripeClient(t.config.stripe);
  base = Math.floor(Date.now() / HOUR) * HOUR - 5 * HOUR;
});

interface Tenant {
  id: string;
  customer: string;
}

/** A tenant of the test's own, billed as a Stripe customer of its own. */
async function tenant(): Promise<Tenant> {
  const suffix = randomUUID().slice(0, 8);
  const tenant = { id: `t-${suffix}`, customer: `cus_${suffix}` };
  t.stripe.addCustomer(tenant.customer);
  await t.addCustomers({ [tenant.id]: tenant.customer });
  return tenant;
}

/**
 * An outbox row for `tn`, `minutes` after `base`. `toStripe`: the same event is posted to Stripe
 * (identifier = key). `status`: what the row then says.
 */
async function event(
  tn: Tenant,
  quantity: number,
  minutes: number,
  opts: { toStripe?: boolean; status?: string; eventName?: string } = {},
): Promise<string> {
  const occurredAt = new Date(base + minutes * 60_000);
  const eventName = opts.eventName ?? 'api_requests';
  const key = await t.enqueue(tn.id, quantity, { occurredAt, eventName });
  if (opts.toStripe ?? true) await sendMeterEvent(client, { keys: DEFAULT_METER_KEYS, eventName, stripeCustomerId: tn.customer, quantity, identifier: key, occurredAt });
  const status = opts.status ?? 'sent';
  await t.pool.query(
    `UPDATE outbox SET status = $2, attempt_count = 1, first_attempted_at = now(),
            sent_at = CASE WHEN $2 = ANY($3::text[]) THEN now() END,
            dead_at = CASE WHEN $2 = 'dead' THEN now() END,
            last_error_code = CASE WHEN $2 = 'dead' THEN 'connection_error' END
      WHERE idempotency_key = $1`,
    [key, status, AT_STRIPE],
  );
  return key;
}

const cli = (argv: string[]) => runCliWithoutTemporal(argv, t.config, t.db);

const at = (hours: number) => new Date(base + hours * HOUR).toISOString();

async function reconcileJson(args: string[]): Promise<{ code: number; report: ReconcileReport; err: string }> {
  const r = await cli(['reconcile', ...args, '--json']);
  return { code: r.code, report: JSON.parse(r.out) as ReconcileReport, err: r.err };
}

const row = async (key: string) => (await t.row(key)) as Record<string, unknown> & { status: string };

describe('billing-outbox reconcile', () => {
  it('exits 0 when our sent rows are exactly what Stripe counted, hour by hour', async () => {
    const tn = await tenant();
    await event(tn, 3, 10);
    await event(tn, 4, 50);
    await event(tn, 5, 65);
    await event(tn, 2, 70, { eventName: 'tokens' });
    // Stripe rejected this one after a 200: neither side counts it.
    t.stripe.asyncErrorNext(1, 'meter_event_invalid_value');
    await event(tn, 100, 75, { status: 'rejected_async' });

    const { code, report } = await reconcileJson(['--from', at(0), '--to', at(3), '--tenant', tn.id]);
    expect(code).toBe(0);
    expect(report).toMatchObject({ from: at(0), to: at(3), tenantId: tn.id, match: true });
    expect(report.summary).toEqual({ pairs: 2, windows: 3, matching: 3, differing: 0, ours: 14, stripe: 14 });
    const api = report.groups.find((g) => g.eventName === 'api_requests')!;
    expect(api).toMatchObject({ stripeCustomerId: tn.customer, tenantIds: [tn.id], meterId: expect.stringMatching(/^mtr_/), problem: null, match: true });
    expect(api.windows.map((w) => [w.start, w.ours, w.stripe, w.delta, w.match])).toEqual([
      [at(0), 7, 7, 0, true],
      [at(1), 5, 5, 0, true],
    ]);
    expect(api.windows[1]!.rows).toEqual({ sent: 1, unsettled: 0, excluded: 1 });
    expect(api.windows[0]!.events).toEqual([]);
    expect(report.notes[0]).toContain('eventually consistent');

    const text = await cli(['reconcile', '--from', at(0), '--to', at(3), '--tenant', tn.id]);
    expect(text.code).toBe(0);
    expect(text.out).toContain('eventually consistent');
    expect(text.out).toMatch(/^\s+WINDOW \(UTC\)\s+OURS\s+STRIPE\s+DELTA\s+RESULT/m);
    expect(text.out).toContain('result: everything matches');
  });

  it('exits 1 on a row marked sent that Stripe never received, naming the window and its events', async () => {
    const tn = await tenant();
    const counted = await event(tn, 3, 130);
    const missing = await event(tn, 4, 140, { toStripe: false });
    await event(tn, 6, 200);

    const { code, report } = await reconcileJson(['--from', at(2), '--to', at(4), '--tenant', tn.id]);
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

    const text = await cli(['reconcile', '--from', at(2), '--to', at(4), '--tenant', tn.id]);
    expect(text.code).toBe(1);
    expect(text.out).toMatch(new RegExp(`${at(2).replace(':00.000Z', 'Z')}\\s+7\\s+3\\s+-4\\s+DIFFERS`));
    expect(text.out).toContain(`events in ${at(2).replace(':00.000Z', 'Z')}`);
    expect(text.out).toMatch(new RegExp(`${missing}\\s+${tn.id}\\s+4\\s+sent`));
    expect(text.out).toContain('DIFFERENCES');
  });

  it('exits 1 on an extra event at Stripe, and on a dead letter that did reach Stripe', async () => {
    const tn = await tenant();
    await event(tn, 2, 10);
    // Something else reported usage for this customer.
    await client.billing.meterEvents.create({
      event_name: 'api_requests',
      payload: { stripe_customer_id: tn.customer, value: '5' },
      identifier: `elsewhere-${randomUUID()}`,
      timestamp: Math.floor((base + 20 * 60_000) / 1000),
    });
    // A dead letter whose last attempt got through (the answer was lost).
    const dead = await event(tn, 7, 70, { status: 'dead' });

    const { code, report } = await reconcileJson(['--from', at(0), '--to', at(2), '--tenant', tn.id]);
    expect(code).toBe(1);
    const [first, second] = report.groups[0]!.windows;
    expect(first).toMatchObject({ ours: 2, stripe: 7, delta: 5, match: false });
    expect(first!.hint).toContain('more than our sent rows');
    expect(second).toMatchObject({ ours: 0, stripe: 7, delta: 7, match: false, rows: { sent: 0, unsettled: 1, excluded: 0 } });
    expect(second!.events).toEqual([expect.objectContaining({ key: dead, quantity: 7, status: 'dead', lastErrorCode: 'connection_error' })]);
    expect(second!.hint).toContain('most likely reached Stripe');
  });

  it('lists a dead letter in a matching window; the command the retry refusal suggests runs as given', async () => {
    const tn = await tenant();
    await event(tn, 1, 125);
    const dead = await event(tn, 9, 130, { toStripe: false, status: 'dead' });
    await t.pool.query(`UPDATE outbox SET first_attempted_at = now() - interval '25 hours' WHERE idempotency_key = $1`, [dead]);

    const refusal = windowRefusal((await findOperatorRow(t.pool, t.schema, dead))!, Date.now());
    const suggested = /`billing-outbox (reconcile [^`]+)`/.exec(refusal)?.[1];
    expect(suggested).toBe(`reconcile --from ${at(2)} --to ${at(3)} --tenant=${tn.id}`);
    const { code, report } = await reconcileJson(suggested!.split(' ').slice(1));
    expect(code).toBe(0);
    const [window] = report.groups[0]!.windows;
    expect(window).toMatchObject({ start: at(2), ours: 1, stripe: 1, match: true, rows: { sent: 1, unsettled: 1, excluded: 0 } });
    expect(window!.events.map((e) => [e.key, e.status])).toContainEqual([dead, 'dead']);
    expect(window!.hint).toContain('does not hold them');
  });

  it("a retry refused past the window names the customer the event was sent to, not the one its tenant was remapped to since", async () => {
    const tn = await tenant();
    const dead = await event(tn, 3, 140, { status: 'dead' });
    await t.pool.query(`UPDATE outbox SET first_attempted_at = now() - interval '25 hours', billed_customer_id = $2 WHERE idempotency_key = $1`, [dead, tn.customer]);
    const moved = `cus_moved_${randomUUID().slice(0, 8)}`;
    await t.addCustomers({ [tn.id]: moved });
    const refusal = windowRefusal((await findOperatorRow(t.pool, t.schema, dead))!, Date.now());
    expect(refusal).toContain(`(Stripe customer ${tn.customer},`);
    expect(refusal).not.toContain(moved);
  });

  it('compares a count meter with the number of delivered events, and leaves a last meter out with a note: no drift on a clean system', async () => {
    const tn = await tenant();
    await event(tn, 5, 10, { eventName: 'logins' });
    await event(tn, 7, 20, { eventName: 'logins' });
    await event(tn, 3, 10, { eventName: 'seats' });
    await event(tn, 9, 30, { eventName: 'seats' });
    const { code, report } = await reconcileJson(['--from', at(0), '--to', at(1), '--tenant', tn.id]);
    expect(report.groups.map((g) => [g.eventName, g.measure, g.ours, g.stripe, g.match])).toEqual([['logins', 'events', 2, 2, true]]);
    expect(report.notes).toContainEqual(expect.stringContaining('Not compared: event name "seats", whose meter aggregates by last'));
    expect(code).toBe(0);

    // A count meter missing one event: told in events, with the hint for a row Stripe lacks.
    const lost = await event(tn, 11, 40, { eventName: 'logins', toStripe: false });
    const after = await reconcileJson(['--from', at(0), '--to', at(1), '--tenant', tn.id]);
    expect(after.code).toBe(1);
    const [window] = after.report.groups[0]!.windows;
    expect(window).toMatchObject({ ours: 3, stripe: 2, delta: -1, match: false });
    expect(window!.events.map((e) => e.key)).toContain(lost);
    expect(window!.hint).toContain('Stripe counts 1 less than our sent rows');
  });

  it('refuses a range with more windows than it compares at once, before any call to Stripe, naming what to narrow', async () => {
    const tn = await tenant();
    await event(tn, 1, 10);
    await event(tn, 1, 70);
    await event(tn, 1, 130);
    let stripeUsed = 0;
    const counting = {
      get billing() {
        stripeUsed++;
        return client.billing;
      },
    };
    const deps = { db: t.pool, schema: t.schema, stripe: counting, maxWindows: 2 };
    await expect(reconcile(deps, { from: new Date(at(0)), to: new Date(at(3)), tenantId: tn.id })).rejects.toThrow(
      'the range holds more than 2 (customer, meter, hour) windows to compare: reconcile a shorter range, or one tenant (--tenant)',
    );
    expect(stripeUsed).toBe(0);
    await expect(reconcile({ ...deps, maxWindows: 3 }, { from: new Date(at(0)), to: new Date(at(3)), tenantId: tn.id })).resolves.toMatchObject({ match: true });
    expect(stripeUsed).toBeGreaterThan(0);
  });

  it('reads every meter of an event name: a meter replaced in the range (new payload keys) still counts the hours before, and nothing reads as missing', async () => {
    t.stripe.addMeter('renamed_keys');
    const tn = await tenant();
    await event(tn, 4, 10, { eventName: 'renamed_keys' });
    await event(tn, 6, 70, { eventName: 'renamed_keys' });
    // Replaced with the same keys (the local Stripe names the old one inactive); later usage goes to the new one.
    t.stripe.replaceMeter('renamed_keys', {});
    await event(tn, 5, 80, { eventName: 'renamed_keys' });
    const { code, report } = await reconcileJson(['--from', at(0), '--to', at(2), '--tenant', tn.id]);
    expect(report.groups.map((g) => [g.eventName, g.ours, g.stripe, g.match])).toEqual([['renamed_keys', 15, 15, true]]);
    expect(code).toBe(0);
    // Each meter's summaries take their turn in the account's pace: the meter list, then two meters.
    let paced = 0;
    const deps = { db: t.pool, schema: t.schema, stripe: client, pace: async () => void paced++ };
    await expect(reconcile(deps, { from: new Date(at(0)), to: new Date(at(2)), tenantId: tn.id })).resolves.toMatchObject({ match: true });
    expect(paced).toBe(3);

    // A count meter replaced by a sum meter: their summaries add up to no total of ours; not compared, and said.
    t.stripe.addMeter('recounted', { formula: 'count' });
    await event(tn, 7, 20, { eventName: 'recounted' });
    t.stripe.replaceMeter('recounted', { formula: 'sum' });
    await event(tn, 3, 30, { eventName: 'recounted' });
    const mixed = await reconcile(deps, { from: new Date(at(0)), to: new Date(at(1)), tenantId: tn.id });
    expect(mixed.groups.map((g) => g.eventName)).toEqual(['renamed_keys']);
    expect(mixed.notes.join('\n')).toMatch(/Not compared: event name "recounted", whose meters in the range aggregate differently \(count, sum|sum, count/);
  });

  it("asks Stripe for several customers' summaries at once, at most eight, and compares each as before", async () => {
    const tenants = await Promise.all(Array.from({ length: 12 }, () => tenant()));
    for (const tn of tenants) await event(tn, 2, 200);
    let now = 0;
    let most = 0;
    const watching = {
      billing: {
        meters: {
          list: (params: Stripe.Billing.MeterListParams) => client.billing.meters.list(params),
          listEventSummaries: (id: string, params: Stripe.Billing.MeterListEventSummariesParams) =>
            (async function* () {
              now++;
              most = Math.max(most, now);
              try {
                await new Promise((r) => setTimeout(r, 50));
                yield* client.billing.meters.listEventSummaries(id, params);
              } finally {
                now--;
              }
            })(),
        },
      },
    } as unknown as Pick<Stripe, 'billing'>;
    const report = await reconcile({ db: t.pool, schema: t.schema, stripe: watching }, { from: new Date(at(3)), to: new Date(at(4)) });
    const ours = report.groups.filter((g) => tenants.some((tn) => tn.customer === g.stripeCustomerId));
    expect(ours).toHaveLength(12);
    expect(ours.every((g) => g.match && g.ours === 2 && g.stripe === 2)).toBe(true);
    expect(most).toBeGreaterThan(1);
    expect(most).toBeLessThanOrEqual(8);
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
    const tn = await tenant();
    await event(tn, 1, 185);
    const aligned = await reconcileJson(['--from', new Date(base + 3 * HOUR + 17 * 60_000).toISOString(), '--to', new Date(base + 3 * HOUR + 20 * 60_000).toISOString(), '--tenant', tn.id]);
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
    // Hours older than the retention have lost rows to pruning: ours would be short, not a drift.
    const old = (days: number) => new Date(Date.now() - days * 24 * HOUR).toISOString();
    await bad(['--from', old(46), '--to', old(40), '--tenant', tn.id], /older than the outbox keeps delivered rows \(OUTBOX_RETENTION_DAYS, 45 days\).*reconcile from/);
    await bad(['--from', at(0), '--to', at(1), '--tenant', 'no-such-tenant'], /no Stripe customer/);
    await bad(['--from', at(0), '--to', at(1), 'extra'], /unexpected argument/);
    // Exactly 31 days is allowed.
    expect((await cli(['reconcile', '--from', at(0), '--to', new Date(base + 31 * 24 * HOUR).toISOString(), '--tenant', tn.id])).code).toBe(0);
  });
});

describe('billing-outbox cancel', () => {
  async function actionsFor(key: string) {
    const { rows } = await t.pool.query('SELECT actor, action, outcome, detail FROM operator_actions WHERE idempotency_key = $1 ORDER BY id', [key]);
    return rows as { actor: string; action: string; outcome: string; detail: string }[];
  }

  it('cancels a sent event within 24 h: Stripe stops counting it and reconcile still matches', async () => {
    const tn = await tenant();
    await event(tn, 2, 250);
    const key = await event(tn, 8, 255);
    const before = await reconcileJson(['--from', at(4), '--to', at(5), '--tenant', tn.id]);
    expect(before.report.groups[0]!.windows[0]).toMatchObject({ ours: 10, stripe: 10 });

    const r = await cli(['cancel', key, '--by', 'alice', '--json']);
    expect(r.code).toBe(0);
    const result = JSON.parse(r.out) as { key: string; outcome: string; message: string; row: { status: string; cancelledAt: string } };
    expect(result).toMatchObject({ key, outcome: 'cancelled', row: { status: 'cancelled', cancelledAt: expect.any(String) } });

    const cancelled = await row(key);
    expect(cancelled.status).toBe('cancelled');
    expect(cancelled.cancelled_at).toBeInstanceOf(Date);
    expect(t.stripe.events().find((e) => e.identifier === key)?.cancelled).toBe(true);
    expect(await actionsFor(key)).toEqual([expect.objectContaining({ actor: 'alice', action: 'cancel', outcome: 'cancelled' })]);

    const after = await reconcileJson(['--from', at(4), '--to', at(5), '--tenant', tn.id]);
    expect(after.code).toBe(0);
    expect(after.report.groups[0]!.windows[0]).toMatchObject({ ours: 2, stripe: 2, match: true, rows: { sent: 1, unsettled: 0, excluded: 1 } });

    // A cancelled row cannot be cancelled again, nor retried (decided before Temporal is asked anything).
    const again = await cli(['cancel', key]);
    expect(again.code).toBe(1);
    expect(again.err).toContain('already cancelled');
    const retrier = new DeadLetterRetrier({ db: t.pool, schema: t.schema, client: {} as Client, config: t.config, now: Date.now });
    expect(await retrier.retryKey(key, { force: true, requestedBy: 'bob' })).toMatchObject({ outcome: 'refused', message: expect.stringContaining('cancelled at Stripe') });
    expect((await actionsFor(key)).map((a) => [a.actor, a.action, a.outcome])).toEqual([
      ['alice', 'cancel', 'cancelled'],
      ['test-operator', 'cancel', 'refused'],
      ['bob', 'retry', 'refused'],
    ]);
  });

  it('refuses an event sent 24 h ago or more without calling Stripe', async () => {
    const tn = await tenant();
    const key = await event(tn, 3, 30);
    await t.pool.query(`UPDATE outbox SET sent_at = now() - interval '25 hours' WHERE idempotency_key = $1`, [key]);

    const r = await cli(['cancel', key]);
    expect(r.code).toBe(1);
    expect(r.err).toContain('24 hours');
    expect(r.err).toContain('Stripe was not called');
    // Stripe received it minutes ago and would have accepted a cancel: it was never asked.
    expect(t.stripe.events().find((e) => e.identifier === key)?.cancelled).toBe(false);
    expect((await row(key)).status).toBe('sent');
    expect(await actionsFor(key)).toEqual([expect.objectContaining({ action: 'cancel', outcome: 'refused' })]);
  });

  it("judges the 24 h by the database's clock, which stamped sent_at: an operator's clock some minutes fast does not refuse a cancel Stripe would take", async () => {
    const tn = await tenant();
    const key = await event(tn, 3, 35);
    await t.pool.query(`UPDATE outbox SET sent_at = now() - interval '23 hours 55 minutes' WHERE idempotency_key = $1`, [key]);
    vi.useFakeTimers({ toFake: ['Date'], now: Date.now() + 10 * 60_000 });
    const r = await cli(['cancel', key, '--json']).finally(() => vi.useRealTimers());
    expect(JSON.parse(r.out)).toMatchObject({ outcome: 'cancelled' });
    expect(t.stripe.events().find((e) => e.identifier === key)?.cancelled).toBe(true);
  });

  it("reports Stripe's own refusal and leaves the row sent", async () => {
    const tn = await tenant();
    // Stripe received it over 24 h ago by its own clock, although our sent_at is recent.
    const late = await event(tn, 3, 40);
    t.stripe.advanceClock(25 * HOUR);
    try {
      const r = await cli(['cancel', late, '--json']);
      expect(r.code).toBe(1);
      const result = JSON.parse(r.out) as { outcome: string; message: string; row: { status: string } };
      expect(result).toMatchObject({ outcome: 'refused', row: { status: 'sent' } });
      expect(result.message).toContain('Stripe refused the cancel');
      expect(result.message).toContain('24 hours');
    } finally {
      t.stripe.advanceClock(-25 * HOUR);
    }
    expect((await row(late)).status).toBe('sent');

    // Marked sent, but Stripe has no such event.
    const unknown = await event(tn, 1, 45, { toStripe: false });
    const r = await cli(['cancel', unknown]);
    expect(r.code).toBe(1);
    expect(r.err).toContain('resource_missing');
    expect(r.err).toContain('billing-outbox reconcile');
    expect((await row(unknown)).status).toBe('sent');

    // Accepted by the v2 stream a minute ago: Stripe validates it later, and may not have it yet.
    const streamed = await event(tn, 1, 46, { toStripe: false, status: 'accepted' });
    await t.pool.query(`UPDATE outbox SET sent_at = now() - interval '1 minute' WHERE idempotency_key = $1`, [streamed]);
    const early = await cli(['cancel', streamed]);
    expect(early.code).toBe(1);
    expect(early.err).toContain('may not have processed it yet');
    expect(early.err).not.toContain('billing-outbox reconcile');
    expect((await row(streamed)).status).toBe('accepted');
  });

  it('a cancel repeated after one whose answer was lost gets the first answer again (one Idempotency-Key per cancel), and the row becomes cancelled', async () => {
    const tn = await tenant();
    const key = await event(tn, 4, 60);
    // Stripe cancels the event, the answer is lost (twice: stripe-node retries a closed connection
    // once, and that retry is answered from the idempotency store).
    t.stripe.dropAfterRecord(2);
    const first = await cli(['cancel', key, '--by', 'alice']);
    expect(first.code).toBe(1);
    expect(first.err).toContain('could not reach a decision');
    expect(t.stripe.events().find((e) => e.identifier === key)?.cancelled).toBe(true);
    expect((await row(key)).status).toBe('sent');

    const again = await cli(['cancel', key, '--by', 'alice', '--json']);
    expect(again.code).toBe(0);
    const result = JSON.parse(again.out) as { outcome: string; message: string; row: { status: string } };
    expect(result).toMatchObject({ outcome: 'cancelled', row: { status: 'cancelled' } });
    expect(result.message).toContain('Stripe accepted the cancel');
    expect((await row(key)).cancelled_at).toBeInstanceOf(Date);
    expect((await actionsFor(key)).map((a) => a.outcome)).toEqual(['failed', 'cancelled']);
  });

  it('a cancel Stripe answered with a 500 is not refused by that stored answer when repeated (Stripe replays it for a day): the row becomes cancelled', async () => {
    const tn = await tenant();
    const key = await event(tn, 3, 62);
    t.stripe.failNext(1, 500);
    const first = await cli(['cancel', key, '--by', 'alice']);
    expect(first.code).toBe(1);
    expect(first.err).toContain('could not reach a decision');
    expect(t.stripe.events().find((e) => e.identifier === key)?.cancelled).toBe(false);

    // Stripe is healthy again, but has the 500 stored under the cancel's Idempotency-Key.
    const again = await cli(['cancel', key, '--by', 'alice', '--json']);
    expect(again.code).toBe(0);
    expect(JSON.parse(again.out)).toMatchObject({ outcome: 'cancelled', row: { status: 'cancelled' } });
    expect(t.stripe.events().find((e) => e.identifier === key)?.cancelled).toBe(true);
    expect((await actionsFor(key)).map((a) => a.outcome)).toEqual(['failed', 'cancelled']);
  });

  it('an event cancelled at Stripe by someone else (another Idempotency-Key): the refusal as already cancelled makes the row cancelled', async () => {
    const tn = await tenant();
    const key = await event(tn, 2, 61);
    // As the Dashboard or a script would: the same cancel, not through billing-outbox.
    await client.billing.meterEventAdjustments.create({ event_name: 'api_requests', type: 'cancel', cancel: { identifier: key } });

    const r = await cli(['cancel', key, '--by', 'alice', '--json']);
    expect(r.code).toBe(0);
    const result = JSON.parse(r.out) as { outcome: string; message: string };
    expect(result).toMatchObject({ outcome: 'cancelled' });
    expect(result.message).toContain('already cancelled');
    expect((await actionsFor(key)).map((a) => [a.outcome, a.detail.includes('already been cancelled')])).toEqual([['cancelled', true]]);
  });

  it('refuses rows that are not sent, and unknown keys; bad arguments exit 2', async () => {
    const tn = await tenant();
    const dead = await event(tn, 1, 50, { toStripe: false, status: 'dead' });
    const r = await cli(['cancel', dead]);
    expect(r.code).toBe(1);
    expect(r.err).toContain('dead letter');
    expect((await row(dead)).status).toBe('dead');

    const missing = await cli(['cancel', idempotencyKeyFor('nobody', 'does-not-exist')]);
    expect(missing.code).toBe(1);
    expect(missing.err).toContain('no outbox row');

    expect((await cli(['cancel'])).code).toBe(2);
    expect((await cli(['cancel', 'a', 'b'])).code).toBe(2);
    expect((await cli(['cancel', dead, '--by', ''])).code).toBe(2);
  });
});
