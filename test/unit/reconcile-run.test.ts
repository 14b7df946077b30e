/** The scheduled run's pure parts: the window it compares, and the bounded result it records. */
import { describe, expect, it } from 'vitest';
import { MAX_DRIFT_CUSTOMERS, MAX_DRIFT_TENANTS, reconcileWindowAt, runResult, type ReconcileGroup, type ReconcileReport, type ReconcileWindow } from '../../src/ops/reconcile.js';

const HOUR = 3_600_000;
const at = (iso: string) => Date.parse(iso);

describe('reconcileWindowAt', () => {
  it('ends at the last whole hour at least the lag old, and covers the interval in whole hours', () => {
    expect(reconcileWindowAt(at('2026-12-03T14:00:00Z'), { intervalMs: HOUR, lagMs: HOUR })).toEqual({
      from: new Date('2026-12-03T12:00:00Z'),
      to: new Date('2026-12-03T13:00:00Z'),
    });
    expect(reconcileWindowAt(at('2026-12-03T14:09:59Z'), { intervalMs: 3 * HOUR, lagMs: 600_000 })).toEqual({
      from: new Date('2026-12-03T10:00:00Z'),
      to: new Date('2026-12-03T13:00:00Z'),
    });
    // More often than hourly: still a whole hour, the last settled one.
    expect(reconcileWindowAt(at('2026-12-03T14:25:00Z'), { intervalMs: 900_000, lagMs: 600_000 })).toEqual({
      from: new Date('2026-12-03T13:00:00Z'),
      to: new Date('2026-12-03T14:00:00Z'),
    });
  });

  it('leaves no hour out between consecutive hourly runs', () => {
    const run = { intervalMs: HOUR, lagMs: HOUR };
    const first = reconcileWindowAt(at('2026-12-03T14:00:00Z'), run);
    const next = reconcileWindowAt(at('2026-12-03T15:00:00Z'), run);
    expect(next.from).toEqual(first.to);
  });
});

function window(start: string, ours: number, stripe: number, rows: Partial<ReconcileWindow['rows']> = {}): ReconcileWindow {
  return {
    start,
    end: new Date(Date.parse(start) + HOUR).toISOString(),
    ours,
    stripe,
    delta: stripe - ours,
    match: ours === stripe,
    rows: { sent: ours > 0 ? 1 : 0, unsettled: 0, excluded: 0, ...rows },
    events: [],
    eventsOmitted: 0,
    hint: null,
  };
}

function group(customer: string, windows: ReconcileWindow[]): ReconcileGroup {
  return {
    stripeCustomerId: customer,
    eventName: 'api_requests',
    tenantIds: [`t-${customer}`],
    meterId: 'mtr_1',
    problem: null,
    measure: 'quantity',
    ours: windows.reduce((n, w) => n + w.ours, 0),
    stripe: windows.reduce((n, w) => n + w.stripe, 0),
    match: windows.every((w) => w.match),
    windows,
  };
}

function report(groups: ReconcileGroup[]): ReconcileReport {
  const all = groups.flatMap((g) => g.windows);
  const matching = all.filter((w) => w.match).length;
  return {
    from: '2026-12-03T00:00:00.000Z',
    to: '2026-12-03T03:00:00.000Z',
    tenantId: null,
    match: groups.every((g) => g.match),
    summary: { pairs: groups.length, windows: all.length, matching, differing: all.length - matching, ours: 0, stripe: 0 },
    groups,
    notes: [],
  };
}

describe('runResult', () => {
  it('sums the drift by direction window by window, names the customers, counts Stripe-only hours', () => {
    const r = runResult(
      report([
        group('cus_ok', [window('2026-12-03T00:00:00.000Z', 5, 5)]),
        group('cus_b', [
          window('2026-12-03T00:00:00.000Z', 7, 2),
          // Stripe counts usage in an hour we hold no row of this customer for.
          window('2026-12-03T01:00:00.000Z', 0, 6, { sent: 0 }),
          window('2026-12-03T02:00:00.000Z', 1, 1, { unsettled: 2 }),
        ]),
      ]),
    );
    expect(r).toMatchObject({ match: false, pairs: 2, differing: 2, drift: { stripeMore: 6, stripeLess: 5 }, stripeOnly: { windows: 1, quantity: 6 }, unsettledRows: 2 });
    expect(r.drifting).toEqual([
      expect.objectContaining({ stripeCustomerId: 'cus_b', stripeMore: 6, stripeLess: 5, windows: ['2026-12-03T00:00:00.000Z', '2026-12-03T01:00:00.000Z'] }),
    ]);
    expect(r.driftingCustomers).toBe(1);
  });

  it('lists at most MAX_DRIFT_CUSTOMERS pairs, most drift first, and counts the rest', () => {
    const groups = Array.from({ length: MAX_DRIFT_CUSTOMERS + 3 }, (_, i) => group(`cus_${String(i).padStart(3, '0')}`, [window('2026-12-03T00:00:00.000Z', 1, 1 + i)]));
    const r = runResult(report(groups));
    expect(r.drifting).toHaveLength(MAX_DRIFT_CUSTOMERS);
    expect(r.drifting[0]!.stripeMore).toBe(MAX_DRIFT_CUSTOMERS + 2);
    expect(r.driftingOmitted).toBe(2);
    // cus_000 matches; every other one drifts.
    expect(r.driftingCustomers).toBe(MAX_DRIFT_CUSTOMERS + 2);
  });

  it('names at most MAX_DRIFT_TENANTS tenants of a drifting pair: 60,000 workspaces billed as one customer keep the result small', () => {
    const shared = { ...group('cus_platform', [window('2026-12-03T00:00:00.000Z', 1, 2)]), tenantIds: Array.from({ length: 60_000 }, (_, i) => `workspace-${i}`) };
    const r = runResult(report([shared]));
    expect(r.drifting[0]!.tenantIds).toHaveLength(MAX_DRIFT_TENANTS);
    expect(r.drifting[0]!.tenantsOmitted).toBe(60_000 - MAX_DRIFT_TENANTS);
    // Temporal refuses a result over 2 MiB; this one is a few kilobytes.
    expect(JSON.stringify(r).length).toBeLessThan(16_384);
  });
});
