/**
 * Reconciliation: what we believe Stripe holds, against what Stripe counted.
 *
 * Ours, per (Stripe customer, meter event name, hour): the quantities of the outbox rows that are
 * `sent`, bucketed by `occurred_at` (the meter event's `timestamp`). Rows `rejected_async` or
 * `cancelled` are expected not to be counted by Stripe and are left out; rows not yet settled
 * (pending, claimed, dispatched, dead) may or may not have reached Stripe and are left out too, but
 * listed, because deciding that is usually why someone reconciles.
 * Stripe's, per the same hour: `aggregated_value` of the meter's event summaries for the customer
 * (GET /v1/billing/meters/{id}/event_summaries, value_grouping_window=hour).
 *
 * Limits, said in the output too: Stripe's summaries are eventually consistent (the last minutes may
 * be missing); only customers with outbox rows in the range are compared; a tenant is compared under
 * the Stripe customer it maps to now (a remapped tenant's older events went to the old customer).
 */
import type Stripe from 'stripe';
import type { Queryable } from '../db.js';
import { UNSETTLED } from '../outbox/statuses.js';
import { listWindowEvents, reconcileWindows, type ReconcileWindowRow } from '../outbox/sql/reconcile.js';
import { hourlyEventSummaries } from '../stripe/client.js';
import { currentMeters, everyMeterByEventName } from '../stripe/meters.js';
import type { Schema } from '../outbox/sql/schema.js';
import { forEachLimit } from '../limit.js';

export const HOUR_MS = 3_600_000;
/** The longest range one run may cover (744 hourly windows per customer and meter). */
export const MAX_RANGE_MS = 31 * 24 * HOUR_MS;
/** Rows listed per window; the rest are counted (`eventsOmitted`). */
export const MAX_EVENTS_PER_WINDOW = 200;

export const EVENTUAL_CONSISTENCY_NOTE =
  "Stripe's meter event summaries are eventually consistent: usage received in the last few minutes may not be counted yet, " +
  'so a difference in the most recent window can disappear on a later run.';

const isUnsettled = (status: string) => (UNSETTLED as readonly string[]).includes(status);

export interface ReconcileEvent {
  key: string;
  /** The identifier Stripe got for it (the key, unless STRIPE_IDENTIFIER_NAMESPACE or a rebill made it another). */
  identifier: string;
  /** 0, or how many times it was rebilled under a new identifier after Stripe rejected it. */
  revision: number;
  tenantId: string;
  quantity: number;
  status: string;
  occurredAt: string;
  sentAt: string | null;
  lastErrorCode: string | null;
}

export interface ReconcileWindow {
  /** ISO start of the hour (UTC). */
  start: string;
  end: string;
  /** Sum of our `sent` rows. */
  ours: number;
  /** Stripe's aggregated value. */
  stripe: number;
  /** stripe − ours: positive when Stripe counts more than we sent, negative when less. */
  delta: number;
  match: boolean;
  /** Rows in the window by kind: counted (sent), unsettled (pending/claimed/dispatched/dead), excluded (rejected_async/cancelled). */
  rows: { sent: number; unsettled: number; excluded: number };
  /**
   * The window's rows (every status, oldest first), listed when the window differs or holds
   * unsettled rows; otherwise empty.
   */
  events: ReconcileEvent[];
  /** Rows of the window not listed (more than MAX_EVENTS_PER_WINDOW). */
  eventsOmitted: number;
  /** A reading of the difference, for people; null when there is nothing to say. */
  hint: string | null;
}

export interface ReconcileGroup {
  stripeCustomerId: string;
  eventName: string;
  tenantIds: string[];
  meterId: string | null;
  /** Why this pair could not be compared (e.g. no meter for the event name); null when it was. */
  problem: string | null;
  /** What ours and Stripe's are: the quantities summed (a sum meter) or the events counted (a count meter). */
  measure: 'quantity' | 'events';
  ours: number;
  stripe: number;
  match: boolean;
  windows: ReconcileWindow[];
}

export interface ReconcileReport {
  from: string;
  to: string;
  tenantId: string | null;
  /** True when every window of every pair matches. */
  match: boolean;
  summary: { pairs: number; windows: number; matching: number; differing: number; ours: number; stripe: number };
  groups: ReconcileGroup[];
  notes: string[];
}

export interface ReconcileDeps {
  db: Queryable;
  /** The PostgreSQL schema of the tables. */
  schema: Schema;
  stripe: Pick<Stripe, 'billing'>;
  /**
   * Awaited before each call to Stripe (the meter list, each pair's summaries): the scheduled run
   * takes its calls from the account-wide pace (src/stripe/rate-limit.ts) so it never crowds out
   * deliveries. The CLI's one-off run goes without.
   */
  pace?: () => Promise<void>;
  /** MAX_WINDOWS unless given (a test's smaller one; the scheduled run's none: Infinity). */
  maxWindows?: number;
  /**
   * Whether each window that differs or holds unsettled rows lists its rows (up to
   * MAX_EVENTS_PER_WINDOW each), for the report an operator reads. The scheduled run keeps only
   * counts: after an outage, every customer's window holds unsettled rows, and listing them all
   * would load millions of rows into the worker that delivers.
   */
  listEvents?: boolean;
}

/**
 * The most (customer, meter, hour) windows one reconciliation compares: each is a window of the
 * report (about 400 bytes of JSON), and each customer and meter a call to Stripe.
 */
export const MAX_WINDOWS = 100_000;

/** Pairs whose summaries are asked of Stripe at once (each call still takes its turn in the pace). */
const SUMMARIES_AT_ONCE = 8;

/** Hour-aligned [from, to): from rounded down, to rounded up. */
export function alignRange(from: Date, to: Date): { from: Date; to: Date } {
  return {
    from: new Date(Math.floor(from.getTime() / HOUR_MS) * HOUR_MS),
    to: new Date(Math.ceil(to.getTime() / HOUR_MS) * HOUR_MS),
  };
}

const iso = (d: Date | null) => (d ? d.toISOString() : null);
const groupKey = (customer: string, eventName: string) => `${customer}\u0000${eventName}`;
const windowKey = (customer: string, eventName: string, start: number) => `${customer}\u0000${eventName}\u0000${start}`;

/** Compares every (customer, event name) pair with rows in [from, to); `from`/`to` must be hour-aligned. */
export async function reconcile(deps: ReconcileDeps, opts: { from: Date; to: Date; tenantId?: string | undefined }): Promise<ReconcileReport> {
  const start = Math.floor(opts.from.getTime() / 1000);
  const end = Math.floor(opts.to.getTime() / 1000);
  const maxWindows = deps.maxWindows ?? MAX_WINDOWS;
  const rows = await reconcileWindows(deps.db, deps.schema, { ...opts, limit: Number.isFinite(maxWindows) ? maxWindows + 1 : null });
  if (rows.length > maxWindows) {
    // Refused before any call to Stripe (one per customer and meter, hours of them at this size)
    // and before a report too large to hold or print.
    throw new Error(
      `the range holds more than ${maxWindows.toLocaleString('en-US')} (customer, meter, hour) windows to compare: reconcile a shorter range, or one tenant (--tenant)`,
    );
  }

  const pairs = new Map<string, { customer: string; eventName: string; tenants: Set<string>; windows: Map<number, ReconcileWindowRow> }>();
  for (const r of rows) {
    const k = groupKey(r.stripe_customer_id, r.event_name);
    let pair = pairs.get(k);
    if (!pair) pairs.set(k, (pair = { customer: r.stripe_customer_id, eventName: r.event_name, tenants: new Set(), windows: new Map() }));
    for (const t of r.tenant_ids) pair.tenants.add(t);
    pair.windows.set(Number(r.window_start), r);
  }

  const pace = deps.pace ?? (() => Promise.resolve());
  if (pairs.size > 0) await pace();
  const everyMeter = pairs.size > 0 ? await everyMeterByEventName(deps.stripe) : new Map<string, Stripe.Billing.Meter[]>();
  const meters = currentMeters(everyMeter);
  /** The meters of an event name that counted in the range: the active one, and any deactivated since its start. */
  const countingMeters = (eventName: string) =>
    (everyMeter.get(eventName) ?? []).filter((m) => m.status === 'active' || (m.status_transitions?.deactivated_at ?? Infinity) >= start);
  /**
   * How the pair's meters aggregate, when their summaries can be compared with ours (sum, count);
   * undefined: they cannot (a `last` meter, or meters of the range that aggregate differently).
   */
  const formulaOf = (pair: { eventName: string }) => {
    const formula = meters.get(pair.eventName)?.default_aggregation?.formula ?? 'sum';
    if (countingMeters(pair.eventName).some((m) => (m.default_aggregation?.formula ?? 'sum') !== formula)) return undefined;
    return formula === 'sum' || formula === 'count' ? formula : undefined;
  };
  // Stripe's hourly totals of each pair whose meter it has, a few pairs at a time (each paced):
  // one after another, a platform's thousands of pairs outlasted the scheduled run's hour.
  const fetched = new Map<string, { totals: Map<number, number>; problem: string | null }>();
  const askable = [...pairs.entries()].filter(([, pair]) => meters.has(pair.eventName) && formulaOf(pair) !== undefined);
  await forEachLimit(askable, SUMMARIES_AT_ONCE, async ([k, pair]) => {
    try {
      await pace();
      // Every meter of the event name that counted in the range: one replaced in it counted the
      // hours before it was. Each call takes its turn in the pace.
      const totals = new Map<number, number>();
      for (const [i, meter] of countingMeters(pair.eventName).entries()) {
        if (i > 0) await pace();
        for (const [hour, value] of await hourlyEventSummaries(deps.stripe, { meterId: meter.id, customer: pair.customer, start, end })) {
          totals.set(hour, (totals.get(hour) ?? 0) + value);
        }
      }
      fetched.set(k, { totals, problem: null });
    } catch (err) {
      // A refusal for this pair (e.g. a customer Stripe does not know) is a finding, not a crash;
      // no answer at all (connection, 5xx, auth) stops the run.
      const e = err as { type?: string; message?: string };
      if (e.type !== 'StripeInvalidRequestError') throw err;
      fetched.set(k, { totals: new Map(), problem: `Stripe refused the summaries for customer ${pair.customer}: ${e.message ?? String(err)}` });
    }
  });

  const groups: ReconcileGroup[] = [];
  /** Event names whose meters' summaries are not a sum or a count of our events, and why: not compared, said in the notes. */
  const notComparable = new Map<string, string>();
  for (const [k, pair] of pairs) {
    const meter = meters.get(pair.eventName);
    // What Stripe's summary of an hour is: the quantities summed (ours: the delivered rows'
    // quantities) or the events counted (ours: how many were delivered). A `last` meter's is one
    // event's value, which no total of ours matches: comparing it would report drift every hour.
    const formula = formulaOf(pair);
    if (formula === undefined) {
      const formulas = [...new Set(countingMeters(pair.eventName).map((m) => m.default_aggregation?.formula ?? 'sum'))];
      notComparable.set(
        pair.eventName,
        formulas.length > 1
          ? `whose meters in the range aggregate differently (${formulas.join(', ')}: a meter replaced to change its formula), so their summaries add up to no total of ours`
          : `whose meter aggregates by ${meter!.default_aggregation.formula} (its summaries are one event's value, not a total of ours)`,
      );
      continue;
    }
    const { totals: stripeTotals, problem } = meter
      ? fetched.get(k)!
      : { totals: new Map<number, number>(), problem: `Stripe has no meter for event name ${JSON.stringify(pair.eventName)}: it cannot have counted these events` };
    const starts = [...new Set([...pair.windows.keys(), ...[...stripeTotals.entries()].filter(([, v]) => v !== 0).map(([s]) => s)])].sort((a, b) => a - b);
    const windows = starts.map((s): ReconcileWindow => {
      const ours = pair.windows.get(s);
      const oursValue = (formula === 'count' ? ours?.sent_count : ours?.sent_quantity) ?? 0;
      const stripeValue = stripeTotals.get(s) ?? 0;
      return {
        start: new Date(s * 1000).toISOString(),
        end: new Date((s + 3600) * 1000).toISOString(),
        ours: oursValue,
        stripe: stripeValue,
        delta: stripeValue - oursValue,
        match: problem === null && stripeValue === oursValue,
        rows: { sent: ours?.sent_count ?? 0, unsettled: ours?.unsettled_count ?? 0, excluded: ours?.excluded_count ?? 0 },
        events: [],
        eventsOmitted: 0,
        hint: null,
      };
    });
    const ours = windows.reduce((n, w) => n + w.ours, 0);
    const stripe = windows.reduce((n, w) => n + w.stripe, 0);
    groups.push({
      stripeCustomerId: pair.customer,
      eventName: pair.eventName,
      tenantIds: [...pair.tenants].sort(),
      meterId: meter?.id ?? null,
      problem,
      measure: formula === 'count' ? 'events' : 'quantity',
      ours,
      stripe,
      match: problem === null && windows.every((w) => w.match),
      windows,
    });
  }

  if (deps.listEvents ?? true) await attachEvents(deps.db, deps.schema, groups);

  const all = groups.flatMap((g) => g.windows);
  const matching = all.filter((w) => w.match).length;
  const notes = [
    EVENTUAL_CONSISTENCY_NOTE,
    'Ours counts delivered rows only (`sent`, and `accepted` in v2): rows rejected_async (rejected by Stripe after a 200) or cancelled are expected not to be counted by Stripe; ' +
      'rows pending, claimed, dispatched or dead may or may not have reached Stripe and are listed, not counted.',
    'Only Stripe customers with outbox rows in the range are compared: each row under the customer its attempt named, a row never attempted under its tenant\'s mapping in billing_customers now.',
    'A meter that counts events (formula count) is compared with the number of delivered rows, not their quantities.',
    ...[...notComparable].map(
      ([eventName, why]) => `Not compared: event name ${JSON.stringify(eventName)}, ${why}; check it in the Stripe Dashboard.`,
    ),
  ];
  return {
    from: opts.from.toISOString(),
    to: opts.to.toISOString(),
    tenantId: opts.tenantId ?? null,
    match: groups.every((g) => g.match),
    summary: {
      pairs: groups.length,
      windows: all.length,
      matching,
      differing: all.length - matching,
      ours: groups.reduce((n, g) => n + g.ours, 0),
      stripe: groups.reduce((n, g) => n + g.stripe, 0),
    },
    groups,
    notes,
  };
}

/** Lists the rows of every window that differs or holds unsettled rows, and reads the difference. */
async function attachEvents(db: Queryable, schema: Schema, groups: ReconcileGroup[]): Promise<void> {
  const wanted: { stripeCustomerId: string; eventName: string; windowStart: number; tenantIds: string[]; measure: ReconcileGroup['measure']; window: ReconcileWindow }[] = [];
  for (const g of groups) {
    for (const w of g.windows) {
      if (!w.match || w.rows.unsettled > 0) {
        wanted.push({ stripeCustomerId: g.stripeCustomerId, eventName: g.eventName, windowStart: Date.parse(w.start) / 1000, tenantIds: g.tenantIds, measure: g.measure, window: w });
      }
    }
  }
  const rows = await listWindowEvents(db, schema, wanted, MAX_EVENTS_PER_WINDOW);
  const byWindow = new Map(wanted.map((w) => [windowKey(w.stripeCustomerId, w.eventName, w.windowStart), w.window]));
  for (const r of rows) {
    const w = byWindow.get(windowKey(r.stripe_customer_id, r.event_name, Number(r.window_start)));
    if (!w) continue;
    w.events.push({
      key: r.idempotency_key,
      identifier: r.identifier,
      revision: r.identifier_revision,
      tenantId: r.tenant_id,
      quantity: r.quantity,
      status: r.status,
      occurredAt: r.occurred_at.toISOString(),
      sentAt: iso(r.sent_at),
      lastErrorCode: r.last_error_code,
    });
    w.eventsOmitted = Number(r.window_rows) - w.events.length;
  }
  for (const { window, measure } of wanted) window.hint = hintFor(window, measure);
}

function hintFor(w: ReconcileWindow, measure: ReconcileGroup['measure']): string | null {
  const unsettled = w.events.filter((e) => isUnsettled(e.status));
  const unsettledSum = measure === 'events' ? unsettled.length : unsettled.reduce((n, e) => n + e.quantity, 0);
  if (w.match) {
    return unsettled.length > 0
      ? `the window matches without its ${unsettled.length} unsettled row(s) (${unsettled.map((e) => e.status).join(', ')}): Stripe most likely does not hold them`
      : null;
  }
  if (w.delta > 0) {
    if (unsettled.length > 0 && unsettledSum === w.delta) {
      return `Stripe counts ${w.delta} more than our sent rows, exactly the unsettled row(s) listed: they most likely reached Stripe (do not force a resend)`;
    }
    return `Stripe counts ${w.delta} more than our sent rows: an event we did not record as sent reached Stripe, or something other than billing-outbox reports usage for this customer and meter`;
  }
  return `Stripe counts ${-w.delta} less than our sent rows: a row marked sent did not reach Stripe or was rejected later (billing-outbox dead --rejected), or the newest usage is not summarised yet`;
}

/** What a scheduled run is told: the window's length and how far behind now it ends. */
export interface ReconcileRunInput {
  intervalMs: number;
  lagMs: number;
}

/**
 * The window a run at `at` compares: the whole hours that ended at least `lagMs` before it, as many
 * as cover `intervalMs` (at least one). Consecutive runs cover consecutive windows, so every settled
 * hour is compared; a run more often than hourly compares the last settled hour again, which is
 * harmless (it only reads).
 */
export function reconcileWindowAt(at: number, run: ReconcileRunInput): { from: Date; to: Date } {
  const to = Math.floor((at - run.lagMs) / HOUR_MS) * HOUR_MS;
  const hours = Math.min(Math.max(1, Math.ceil(run.intervalMs / HOUR_MS)), MAX_RANGE_MS / HOUR_MS);
  return { from: new Date(to - hours * HOUR_MS), to: new Date(to) };
}

/** Customers listed by name in a run's result; the rest are counted (the run's workflow history stays small). */
export const MAX_DRIFT_CUSTOMERS = 50;
/** Tenants named per drifting pair in a scheduled run's result (a platform may bill thousands as one customer). */
export const MAX_DRIFT_TENANTS = 20;

/** One (customer, meter) pair whose windows differ, in a scheduled run's result. */
export interface DriftingPair {
  stripeCustomerId: string;
  /** The pair's tenants, at most MAX_DRIFT_TENANTS; `tenantsOmitted` counts the rest. */
  tenantIds: string[];
  tenantsOmitted: number;
  eventName: string;
  ours: number;
  stripe: number;
  /** What Stripe counts beyond our sent rows, summed over the pair's windows that count more. */
  stripeMore: number;
  /** What Stripe is missing of our sent rows, summed over the pair's windows that count less. */
  stripeLess: number;
  /** Hours (ISO starts) that differ. */
  windows: string[];
  problem: string | null;
}

/**
 * A scheduled run's result, bounded in size whatever the window held: the workflow returns it (the
 * record of the run, in Temporal's history) and `billing-outbox status` reads the last one.
 */
export interface ReconcileRunResult {
  from: string;
  to: string;
  /** True when every window of every pair matched. */
  match: boolean;
  pairs: number;
  windows: number;
  matching: number;
  differing: number;
  ours: number;
  stripe: number;
  /**
   * The drift, by direction, summed window by window: `stripeMore` is usage Stripe counts that no
   * sent row of ours accounts for (an event sent elsewhere, a dead letter that did get through),
   * `stripeLess` is usage of our sent rows that Stripe did not count (dropped, or rejected after
   * a 200 without the webhook telling us). Within one hour the two can cancel out: summaries are
   * aggregates.
   */
  drift: { stripeMore: number; stripeLess: number };
  /**
   * Stripe-side usage with no row of ours at all: windows where Stripe counts something and the
   * outbox holds no row of that customer and meter (the quantity, and how many such windows).
   */
  stripeOnly: { windows: number; quantity: number };
  /** Rows in the window not yet settled (pending, claimed, dispatched, dead): not counted as ours. */
  unsettledRows: number;
  /** The pairs that differ, most drift first, at most MAX_DRIFT_CUSTOMERS. */
  drifting: DriftingPair[];
  driftingOmitted: number;
  /** Distinct Stripe customers among every drifting pair (listed or not). */
  driftingCustomers: number;
}

/** The bounded record of a run from the full report. */
export function runResult(report: ReconcileReport): ReconcileRunResult {
  let stripeMore = 0;
  let stripeLess = 0;
  const stripeOnly = { windows: 0, quantity: 0 };
  let unsettledRows = 0;
  const drifting: DriftingPair[] = [];
  for (const g of report.groups) {
    const pair: DriftingPair = {
      stripeCustomerId: g.stripeCustomerId,
      tenantIds: g.tenantIds.slice(0, MAX_DRIFT_TENANTS),
      tenantsOmitted: Math.max(0, g.tenantIds.length - MAX_DRIFT_TENANTS),
      eventName: g.eventName,
      ours: g.ours,
      stripe: g.stripe,
      stripeMore: 0,
      stripeLess: 0,
      windows: [],
      problem: g.problem,
    };
    for (const w of g.windows) {
      unsettledRows += w.rows.unsettled;
      if (w.delta > 0) pair.stripeMore += w.delta;
      if (w.delta < 0) pair.stripeLess -= w.delta;
      if (w.stripe > 0 && w.rows.sent + w.rows.unsettled + w.rows.excluded === 0) {
        stripeOnly.windows += 1;
        stripeOnly.quantity += w.stripe;
      }
      if (!w.match) pair.windows.push(w.start);
    }
    stripeMore += pair.stripeMore;
    stripeLess += pair.stripeLess;
    if (!g.match) drifting.push(pair);
  }
  drifting.sort((a, b) => b.stripeMore + b.stripeLess - (a.stripeMore + a.stripeLess) || a.stripeCustomerId.localeCompare(b.stripeCustomerId));
  return {
    from: report.from,
    to: report.to,
    match: report.match,
    pairs: report.summary.pairs,
    windows: report.summary.windows,
    matching: report.summary.matching,
    differing: report.summary.differing,
    ours: report.summary.ours,
    stripe: report.summary.stripe,
    drift: { stripeMore, stripeLess },
    stripeOnly,
    unsettledRows,
    drifting: drifting.slice(0, MAX_DRIFT_CUSTOMERS),
    driftingOmitted: Math.max(0, drifting.length - MAX_DRIFT_CUSTOMERS),
    driftingCustomers: new Set(drifting.map((p) => p.stripeCustomerId)).size,
  };
}
