/**
 * The (customer, meter) lease on real PostgreSQL: one holder at a time, the oldest waiting delivery
 * next, handed the lease directly (named in the notification), a waiter that died skipped.
 */
import pg from 'pg';
import { afterAll, beforeAll, expect, it } from 'vitest';
import { OutboxNotifier } from '../src/outbox/notifier.js';
import { beginAttempt } from '../src/outbox/sql/delivery.js';
import { handOffLease, leaseId, tryLease } from '../src/outbox/sql/lease.js';
import { MeterLease } from '../src/stripe/meter-lease.js';
import { addCustomer, createTestDb, type TestDb } from './helpers.js';
import { schemaFor } from '../src/outbox/sql/schema.js';

let db: TestDb;
let listener: pg.Client;
const notices: string[] = [];

beforeAll(async () => {
  db = await createTestDb();
  await addCustomer(db.pool, 'acme', 'cus_acme');
  await db.pool.query(
    `INSERT INTO outbox (tenant_id, event_name, quantity, occurred_at, idempotency_key, usage_id, status)
     SELECT 'acme', 'api_requests', 1, now(), 'lease:' || g, 'lease-' || g, 'dispatched' FROM generate_series(1, 4) g`,
  );
  listener = new pg.Client({ connectionString: db.url });
  await listener.connect();
  listener.on('notification', (n) => notices.push(n.payload ?? ''));
  await listener.query(`LISTEN "${schemaFor().leaseChannel}"`);
});
afterAll(async () => {
  await listener?.end();
  await db?.drop();
});

const take = (key: string, holder: string, waitTtlMs = 5_000) => tryLease(db.pool, schemaFor(), { key, holder, leaseMs: 30_000, waitTtlMs });
const lease = leaseId('cus_acme', 'api_requests');

it('hands the lease to the oldest waiting delivery, named in the notification, skipping one whose place lapsed', async () => {
  expect((await take('lease:3', 'h3')).outcome).toBe('acquired');
  // Three wait: lease:1 (oldest) joined with a place that lapses at once, as if its worker died.
  expect(await take('lease:1', 'h1', 0)).toEqual({ outcome: 'busy', lease });
  expect((await take('lease:4', 'h4')).outcome).toBe('busy');
  expect((await take('lease:2', 'h2')).outcome).toBe('busy');

  expect(await handOffLease(db.pool, schemaFor(), 'h3', 5_000)).toEqual([{ lease, nextHolder: 'h2' }]);
  const { rows } = await db.pool.query(`SELECT holder FROM meter_leases`);
  expect(rows).toEqual([{ holder: 'h2' }]);
  await expect.poll(() => notices.at(-1)).toBe(`${lease}\u001eh2`);

  // h2 begins its attempt: the lease is extended to cover the call, and it is still h2's.
  const begun = await beginAttempt(db.pool, schemaFor(), 'lease:2', { workflowId: 'w2', safeWindowMs: 3_600_000, force: false, lease: { holder: 'h2', leaseMs: 30_000 } });
  expect(begun.leaseHeld).toBe(true);
  expect(begun.row?.attempt_count).toBe(1);
  // Someone who does not hold it cannot begin an attempt with it, and nothing is counted.
  const intruder = await beginAttempt(db.pool, schemaFor(), 'lease:4', { workflowId: 'w4', safeWindowMs: 3_600_000, force: false, lease: { holder: 'h4', leaseMs: 30_000 } });
  expect(intruder).toEqual({ leaseHeld: false, row: undefined });
  expect((await db.pool.query(`SELECT attempt_count FROM outbox WHERE idempotency_key = 'lease:4'`)).rows[0].attempt_count).toBe(0);

  // Next in line after h2: h4 (h1's place lapsed).
  expect(await handOffLease(db.pool, schemaFor(), 'h2', 5_000)).toEqual([{ lease, nextHolder: 'h4' }]);
  expect(await handOffLease(db.pool, schemaFor(), 'h4', 5_000)).toEqual([{ lease, nextHolder: null }]);
  expect((await db.pool.query(`SELECT count(*)::int AS n FROM meter_leases`)).rows[0].n).toBe(0);
});

it('a newer delivery does not take a free lease while an older one waits for it', async () => {
  await db.pool.query('DELETE FROM meter_lease_waiters');
  expect((await take('lease:1', 'old')).outcome).toBe('acquired');
  expect((await take('lease:2', 'older-waiting')).outcome).toBe('busy');
  // The holder's lease lapses without a hand-off (its worker died): the waiting one is older.
  await db.pool.query(`UPDATE meter_leases SET expires_at = now() - interval '1 second'`);
  expect((await take('lease:4', 'newer')).outcome).toBe('busy');
  expect((await take('lease:2', 'older-waiting')).outcome).toBe('acquired');
});

it('a lease handed to a delivery that never takes it up (its worker died) lapses after the hand-off time, and the next waiter gets it', async () => {
  await db.pool.query('DELETE FROM meter_leases; DELETE FROM meter_lease_waiters');
  expect((await take('lease:1', 'holder')).outcome).toBe('acquired');
  expect((await take('lease:2', 'dies-after-handed')).outcome).toBe('busy');
  expect((await take('lease:3', 'next')).outcome).toBe('busy');
  expect(await handOffLease(db.pool, schemaFor(), 'holder', 5_000)).toEqual([{ lease, nextHolder: 'dies-after-handed' }]);
  // Handed for 5 s, not for the 30 s of a call: within them the next waiter still waits…
  const { rows } = await db.pool.query<{ s: number }>(`SELECT extract(epoch FROM expires_at - now())::float8 AS s FROM meter_leases`);
  expect(rows[0]!.s).toBeGreaterThan(0);
  expect(rows[0]!.s).toBeLessThanOrEqual(5);
  expect((await take('lease:3', 'next')).outcome).toBe('busy');
  // …and once they pass with no attempt begun under it, the next waiter takes it.
  await db.pool.query(`UPDATE meter_leases SET expires_at = now() - interval '1 millisecond'`);
  expect((await take('lease:3', 'next')).outcome).toBe('acquired');
});

it('a tenant remapped to another customer: the lease of the old pair is not held for a call with the new one', async () => {
  await db.pool.query('DELETE FROM meter_leases; DELETE FROM meter_lease_waiters');
  await addCustomer(db.pool, 'movers', 'cus_before');
  await db.pool.query(
    `INSERT INTO outbox (tenant_id, event_name, quantity, occurred_at, idempotency_key, usage_id, status)
     VALUES ('movers', 'api_requests', 1, now(), 'remap:1', 'remap-1', 'dispatched')`,
  );
  expect(await take('remap:1', 'mover')).toEqual({ outcome: 'acquired', lease: leaseId('cus_before', 'api_requests') });
  // Remapped while the delivery holds the lease (or was handed it) and before its attempt begins.
  await addCustomer(db.pool, 'movers', 'cus_after');
  const begin = () => beginAttempt(db.pool, schemaFor(), 'remap:1', { workflowId: 'wr', safeWindowMs: 3_600_000, force: false, lease: { holder: 'mover', leaseMs: 30_000 } });
  // Begun, it would call with cus_after under cus_before's lease: not begun, nothing counted.
  expect(await begin()).toEqual({ leaseHeld: false, row: undefined });
  expect((await db.pool.query(`SELECT attempt_count FROM outbox WHERE idempotency_key = 'remap:1'`)).rows[0].attempt_count).toBe(0);

  // The delivery gives back what it has and queues again: for the new pair, which it then holds.
  expect(await handOffLease(db.pool, schemaFor(), 'mover', 5_000)).toEqual([{ lease: leaseId('cus_before', 'api_requests'), nextHolder: null }]);
  expect(await take('remap:1', 'mover')).toEqual({ outcome: 'acquired', lease: leaseId('cus_after', 'api_requests') });
  const begun = await begin();
  expect(begun.leaseHeld).toBe(true);
  expect(begun.row?.stripe_customer_id).toBe('cus_after');
});

it("a waiter whose earlier hand-off lapsed (the lease another's since) waits for its own turn, not for the old hand-off again on every wake", async () => {
  await db.pool.query('DELETE FROM meter_leases; DELETE FROM meter_lease_waiters');
  const notifier = new OutboxNotifier(db.url);
  notifier.start();
  try {
    const meterLease = new MeterLease(db.pool, schemaFor(), { leaseMs: 30_000, leaseWaitMs: 3_000, leasePollMs: 200, waiterTtlMs: 5_000, handOffMs: 5_000, unansweredHoldMs: 30_000 }, notifier);
    const ctx = { cancellationSignal: new AbortController().signal, sleep: (ms: number) => new Promise<void>((r) => setTimeout(r, ms)), heartbeat: () => undefined };
    // Handed to `late` once, as this process heard (the hand-off's notification long past); the
    // hand-off lapsed, and `other` holds the lease now.
    notifier.handOff(lease, 'late');
    expect((await take('lease:3', 'other')).outcome).toBe('acquired');
    // Woken by others' traffic on the lease meanwhile (a waiter joining, a notification).
    const wakes = setInterval(() => notifier.wake(lease), 100);
    try {
      expect(await meterLease.wait('lease:2', 'late', ctx, 1_500)).toBe('gave_up');
    } finally {
      clearInterval(wakes);
    }
    // Handed to it for real while it waits: taken at once.
    const waiting = meterLease.wait('lease:2', 'late', ctx, 3_000);
    await new Promise((r) => setTimeout(r, 300));
    meterLease.handedOff(await handOffLease(db.pool, schemaFor(), 'other', 5_000));
    expect(await waiting).toBe('acquired');
  } finally {
    await notifier.close();
  }
});
