/**
 * The invariant a chaos run ends on, checked against what Stripe recorded and what the database
 * committed, never against the product's own opinion of itself:
 *
 *   every usage the application committed is exactly one meter event at Stripe, with its value,
 *   customer, event name and timestamp; per (customer, meter) the recorded total equals the
 *   committed total; nothing from a rolled-back transaction is recorded; every outbox row is
 *   settled (delivered, or dead with a reason) and none is left claimed past its lease; every
 *   acknowledged usage was committed; no secret reached any process's log.
 *
 * The one exactly-once verifier: the chaos runner ends on it, and so does `npm run demo`. Against
 * a Stripe whose record cannot be read here (the demo pointed at a real account) it checks the
 * database's side only, and says so (`stripeRead: false`).
 */
import { readdir, readFile } from 'node:fs/promises';
import path from 'node:path';
import { DELIVERED } from '../src/outbox/statuses.js';
import type { RecordedMeterEvent } from '../src/embedded/stripe/types.js';
import { usageKey, type Load } from './load.js';
import type { World } from './world.js';

export interface InvariantTable {
  /** Whether Stripe's record was read; without it nothing below about Stripe is checked (all 0). */
  stripeRead: boolean;
  committed: number;
  acknowledged: number;
  recorded: number;
  /** v1: resends Stripe refused as "an event already exists with identifier …"; v2: resent events its dedup dropped. */
  duplicatesRefusedByStripe: number;
  /** Stripe requests beyond the first for an event (v1), or events sent again on the stream (v2). */
  resends: number;
  dead: number;
  lost: number;
  doubleBilled: number;
  wrongFields: number;
  billedButUncommitted: number;
  unsettled: number;
  /** Attempts counted on the outbox rows (each one before its call), and the events that needed more than one. */
  attempts: number;
  retried: number;
}

/** Committed and recorded totals of one (customer, meter). */
export interface PairTotals {
  customer: string;
  eventName: string;
  /** Committed usages. */
  events: number;
  committed: number;
  /** Undefined when Stripe's record was not read. */
  recorded: number | undefined;
}

export interface CheckResult {
  table: InvariantTable;
  violations: string[];
  /** Per (customer, meter), sorted. */
  pairs: PairTotals[];
}

interface CommittedRow {
  tenant_id: string;
  usage_id: string;
  event_name: string;
  quantity: string;
  occurred_at_s: string;
  customer: string;
  outbox_rows: number;
  idempotency_key: string | null;
  status: string | null;
  attempt_count: number;
  last_error_code: string | null;
  last_error_message: string | null;
}

const MAX_LISTED = 10;

/**
 * What the check reads: the database, Stripe's record (the local server's; absent when it cannot
 * be read), and the secrets to look for in the logs.
 */
export type Observed = Pick<World, 'pool' | 'secrets'> & { stripe: Pick<World['stripe'], 'flushStream' | 'events' | 'requests' | 'streamRequests'> | undefined };

/** `logDir`: the folder of every process's `*.log`, searched for the secrets (none given: not searched). */
export async function checkInvariant(world: Observed, load: Pick<Load, 'acknowledged' | 'uncommitted'>, logDir?: string): Promise<CheckResult> {
  const violations: string[] = [];
  const violate = (what: string) => {
    if (violations.length < 200) violations.push(what);
  };

  // v2: the stream validates later; let Stripe finish deciding on everything it has taken.
  const stripe = world.stripe;
  stripe?.flushStream();
  const events = stripe ? stripe.events().filter((e) => !e.cancelled) : [];
  const byIdentifier = new Map<string, RecordedMeterEvent[]>();
  for (const e of events) byIdentifier.set(e.identifier, [...(byIdentifier.get(e.identifier) ?? []), e]);

  const { rows } = await world.pool.query<CommittedRow>(`
    SELECT u.tenant_id, u.id AS usage_id, u.event_name, u.quantity::text,
           floor(extract(epoch FROM u.occurred_at))::bigint::text AS occurred_at_s,
           c.stripe_customer_id AS customer,
           count(o.id)::int AS outbox_rows,
           min(o.idempotency_key) AS idempotency_key, min(o.status) AS status,
           COALESCE(min(o.attempt_count), 0)::int AS attempt_count,
           min(o.last_error_code) AS last_error_code, min(o.last_error_message) AS last_error_message
      FROM usage_logs u
      JOIN billing_customers c ON c.tenant_id = u.tenant_id
      LEFT JOIN outbox o ON o.tenant_id = u.tenant_id AND o.usage_id = u.id
     GROUP BY u.tenant_id, u.id, u.event_name, u.quantity, u.occurred_at, c.stripe_customer_id`);

  const table: InvariantTable = {
    stripeRead: stripe !== undefined,
    committed: rows.length,
    acknowledged: load.acknowledged.size,
    recorded: events.length,
    duplicatesRefusedByStripe: 0,
    resends: 0,
    dead: 0,
    lost: 0,
    doubleBilled: 0,
    wrongFields: 0,
    billedButUncommitted: 0,
    unsettled: 0,
    attempts: 0,
    retried: 0,
  };

  const committedKeys = new Set<string>();
  const committedTotals = new Map<string, number>();
  const recordedTotals = new Map<string, number>();
  const pairs = new Map<string, PairTotals>();
  for (const row of rows) {
    committedKeys.add(usageKey(row.tenant_id, row.usage_id));
    const pair = `${row.customer} ${row.event_name}`;
    committedTotals.set(pair, (committedTotals.get(pair) ?? 0) + Number(row.quantity));
    const totals = pairs.get(pair) ?? { customer: row.customer, eventName: row.event_name, events: 0, committed: 0, recorded: stripe ? 0 : undefined };
    totals.events++;
    totals.committed += Number(row.quantity);
    pairs.set(pair, totals);
    table.attempts += row.attempt_count;
    if (row.attempt_count > 1) table.retried++;
    if (row.outbox_rows !== 1 || !row.idempotency_key) {
      violate(`usage ${row.tenant_id}/${row.usage_id} has ${row.outbox_rows} outbox rows (must be 1, written in its transaction)`);
      table.lost++;
      continue;
    }
    const recorded = byIdentifier.get(row.idempotency_key) ?? [];
    const delivered = (DELIVERED as readonly string[]).includes(row.status ?? '');
    if (row.status === 'dead') {
      table.dead++;
      // No fault in the catalogue makes an event undeliverable, and the retry budget outlasts them all.
      violate(`${row.idempotency_key} is dead (${row.last_error_code}: ${row.last_error_message})`);
    } else if (!delivered) {
      table.unsettled++;
      violate(`${row.idempotency_key} is still ${row.status} after the drain`);
    }
    if (!stripe) continue;
    if (recorded.length === 0) {
      table.lost++;
      violate(`${row.idempotency_key} (${row.status}) was committed and never recorded by Stripe`);
      continue;
    }
    if (recorded.length > 1) {
      table.doubleBilled++;
      violate(`${row.idempotency_key} was recorded ${recorded.length} times`);
    }
    const e = recorded[0]!;
    const mismatches = [
      e.customer !== row.customer && `customer ${e.customer} ≠ ${row.customer}`,
      e.eventName !== row.event_name && `event name ${e.eventName} ≠ ${row.event_name}`,
      String(e.value) !== row.quantity && `value ${e.value} ≠ ${row.quantity}`,
      String(e.timestamp) !== row.occurred_at_s && `timestamp ${e.timestamp} ≠ ${row.occurred_at_s}`,
    ].filter(Boolean);
    if (mismatches.length > 0) {
      table.wrongFields++;
      violate(`${row.idempotency_key}: ${mismatches.join(', ')}`);
    }
  }

  // Everything Stripe recorded belongs to a committed usage.
  const committedIdentifiers = new Set(rows.map((r) => r.idempotency_key));
  for (const e of events) {
    const pair = `${e.customer} ${e.eventName}`;
    recordedTotals.set(pair, (recordedTotals.get(pair) ?? 0) + e.value);
    const totals = pairs.get(pair);
    if (totals) totals.recorded = (totals.recorded ?? 0) + e.value;
    if (!committedIdentifiers.has(e.identifier)) {
      table.billedButUncommitted++;
      violate(`Stripe recorded ${e.identifier}, which no committed usage has`);
    }
  }
  for (const [key, usage] of load.uncommitted) {
    if (committedKeys.has(key)) violate(`usage ${usage.tenantId}/${usage.usageId} was rolled back and is committed`);
  }
  for (const [key, usage] of load.acknowledged) {
    if (!committedKeys.has(key)) violate(`usage ${usage.tenantId}/${usage.usageId} was acknowledged and is not committed`);
  }
  for (const pair of stripe ? new Set([...committedTotals.keys(), ...recordedTotals.keys()]) : []) {
    const committed = committedTotals.get(pair) ?? 0;
    const recorded = recordedTotals.get(pair) ?? 0;
    if (committed !== recorded) violate(`${pair}: committed ${committed}, recorded ${recorded}`);
  }

  const orphans = await world.pool.query<{ n: number }>(`
    SELECT count(*)::int AS n FROM outbox o
     WHERE NOT EXISTS (SELECT 1 FROM usage_logs u WHERE u.tenant_id = o.tenant_id AND u.id = o.usage_id)`);
  if (orphans.rows[0]!.n > 0) violate(`${orphans.rows[0]!.n} outbox rows have no usage row`);
  const overdue = await world.pool.query<{ n: number }>(`SELECT count(*)::int AS n FROM outbox WHERE status = 'claimed' AND processing_deadline < now()`);
  if (overdue.rows[0]!.n > 0) violate(`${overdue.rows[0]!.n} rows are claimed past their lease`);

  if (stripe) countResends(stripe, table);

  if (logDir) {
    for (const file of (await readdir(logDir)).filter((f) => f.endsWith('.log'))) {
      const text = await readFile(path.join(logDir, file), 'utf8');
      for (const secret of world.secrets()) {
        if (secret && text.includes(secret)) violate(`${file} contains a secret (${secret.slice(0, 6)}…)`);
      }
    }
  }

  const sortedPairs = [...pairs.values()].sort((a, b) => a.customer.localeCompare(b.customer) || a.eventName.localeCompare(b.eventName));
  return { table, violations: summarise(violations), pairs: sortedPairs };
}

function countResends(stripe: NonNullable<Observed['stripe']>, table: InvariantTable): void {
  const requests = stripe.requests().filter((r) => r.identifier);
  const perIdentifier = new Map<string, number>();
  for (const r of requests) perIdentifier.set(r.identifier!, (perIdentifier.get(r.identifier!) ?? 0) + 1);
  table.resends = [...perIdentifier.values()].reduce((s, n) => s + n - 1, 0);
  table.duplicatesRefusedByStripe = requests.filter((r) => r.status === 400 && /^An event already exists with identifier /.test(r.errorMessage ?? '')).length;

  // The stream: events sent in requests Stripe took, beyond one per identifier, were dropped by its dedup.
  const taken = stripe.streamRequests().filter((r) => r.status === 200);
  const sentIds = taken.flatMap((r) => r.identifiers).filter((id): id is string => id !== null);
  const streamResends = sentIds.length - new Set(sentIds).size;
  table.resends += streamResends;
  table.duplicatesRefusedByStripe += streamResends;
}

function summarise(violations: string[]): string[] {
  if (violations.length <= MAX_LISTED) return violations;
  return [...violations.slice(0, MAX_LISTED), `… and ${violations.length - MAX_LISTED} more`];
}

export function formatTable(t: InvariantTable): string {
  const rows: [string, number, string][] = [
    ['committed (usage_logs)', t.committed, ''],
    ['acknowledged to clients', t.acknowledged, ''],
    ['recorded by Stripe', t.recorded, 'must equal committed'],
    ['duplicates refused by Stripe', t.duplicatesRefusedByStripe, "identifier dedup at work"],
    ['resends', t.resends, 'calls beyond the first per event'],
    ['dead', t.dead, 'must be 0: no fault here is permanent'],
    ['unsettled after the drain', t.unsettled, 'must be 0'],
    ['lost', t.lost, 'must be 0'],
    ['double-billed', t.doubleBilled, 'must be 0'],
    ['wrong value/customer/meter/time', t.wrongFields, 'must be 0'],
    ['billed but never committed', t.billedButUncommitted, 'must be 0'],
  ];
  const width = Math.max(...rows.map((r) => r[0].length));
  return rows.map(([name, n, note]) => `  ${name.padEnd(width)}  ${String(n).padStart(7)}  ${note}`).join('\n');
}
