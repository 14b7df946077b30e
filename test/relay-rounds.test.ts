/**
 * A relay goes round every lane waiting when more wait than one claim looks at: it claims again at
 * once after a claim that stopped short of the last lane, instead of waiting for a notification or
 * the poll, and stops only once its claims have looked at every lane.
 */
import { randomUUID } from 'node:crypto';
import { Client } from '@temporalio/client';
import { MockActivityEnvironment } from '@temporalio/testing';
import { NativeConnection } from '@temporalio/worker';
import { afterAll, beforeAll, expect, it } from 'vitest';
import { createRelayActivities, type RelayResult } from '../activities/relay.js';
import { OutboxNotifier } from '../src/outbox/notifier.js';
import { createTestDb, testConfig, type TestDb } from './helpers.js';
import { seedCustomers } from './hooks.js';

const TENANTS = 30;
let db: TestDb;
let connection: NativeConnection;

beforeAll(async () => {
  db = await createTestDb();
  await seedCustomers(db.pool, Object.fromEntries(Array.from({ length: TENANTS }, (_, i) => [`round${i + 1}`, `cus_round${i + 1}`])));
  connection = await NativeConnection.connect({ address: testConfig().temporal.address });
});

afterAll(async () => {
  await connection?.close();
  await db?.drop();
});

it('claims lane after lane, a few at a time, without waiting in between, until it has looked at every lane', async () => {
  // One row of each tenant, committed before the relay starts listening: no notification wakes it.
  await db.pool.query(
    `INSERT INTO outbox (tenant_id, event_name, quantity, occurred_at, idempotency_key, usage_id)
     SELECT 'round' || m, 'api_requests', 1, now(), $1 || ':' || m, m::text FROM generate_series(1, $2::int) m`,
    [randomUUID().slice(0, 8), TENANTS],
  );
  // A task queue no worker polls: the starts are all that happens (eager starts, as the worker's:
  // over a native connection). A poll far longer than the call.
  const config = testConfig({ RELAY_POLL_INTERVAL_MS: '60000', TEMPORAL_TASK_QUEUE: `tq-rounds-${randomUUID().slice(0, 8)}` });
  const notifier = new OutboxNotifier(db.url);
  try {
    const client = new Client({ connection, namespace: config.temporal.namespace });
    const relay = createRelayActivities({ db: db.pool, client, notifier, config, runForMs: 3_000, lanesPerClaim: 4 }).relayOutbox;
    const result = (await new MockActivityEnvironment().run(relay, 'relay-rounds')) as RelayResult;
    // Eight claims of at most four lanes each, one after the other; a relay waiting after the first
    // would have started four.
    expect(result.started).toBe(TENANTS);
    const { rows } = await db.pool.query<{ n: number }>(`SELECT count(*)::int AS n FROM outbox WHERE status = 'dispatched'`);
    expect(rows[0]!.n).toBe(TENANTS);
  } finally {
    await notifier.close();
  }
});
