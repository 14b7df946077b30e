/**
 * A start Temporal refuses for good must not loop: on a second dev server of its own that enforces
 * `limit.maxIDLength=60`, events whose key (the workflow id) is longer end dead with Temporal's
 * answer, while the same tenant's other events go on through the same lane.
 */
import { randomUUID } from 'node:crypto';
import { Client } from '@temporalio/client';
import { MockActivityEnvironment } from '@temporalio/testing';
import { Registry } from 'prom-client';
import { createRelayActivities, START_RETRY_MS, type RelayResult } from '../activities/relay.js';
import { OutboxNotifier } from '../src/outbox/notifier.js';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { Config } from '../src/config.js';
import { withTransaction } from '../src/db.js';
import { startTemporalDevServer, type DevServer } from '../src/embedded/temporal.js';
import { LocalStripe } from '../src/embedded/stripe/server.js';
import { createMetrics, type Metrics } from '../src/metrics.js';
import { DeadLetterRetrier } from '../src/ops/retry.js';
import { outboxStatus } from '../src/ops/status.js';
import { recordUsage } from '../src/outbox/enqueue.js';
import { TemporalErrorCodes } from '../workflows/shared.js';
import { addCustomer, createTestDb, startTestPipeline, testConfig, waitFor, type TestDb, type TestPipeline } from './helpers.js';
import { schemaFor } from '../src/outbox/sql/schema.js';

const MAX_ID_LENGTH = 60;

let server: DevServer;
let db: TestDb;
let stripe: LocalStripe;
let config: Config;
let metrics: Metrics;
let pipeline: TestPipeline;

beforeAll(async () => {
  server = await startTemporalDevServer({ dynamicConfig: [`limit.maxIDLength=${MAX_ID_LENGTH}`] });
  db = await createTestDb();
  stripe = await LocalStripe.start({ meters: ['api_requests'], customers: ['cus_acme'] });
  await addCustomer(db.pool, 'acme', 'cus_acme');
  config = testConfig({
    TEMPORAL_ADDRESS: server.address,
    // The relay workflows' ids carry the task queue: short enough for the limit.
    TEMPORAL_TASK_QUEUE: `tq-${randomUUID().slice(0, 8)}`,
    STRIPE_API_BASE: stripe.url,
    STRIPE_API_KEY: 'sk_test_start_refused',
    LANE_MAX_IN_FLIGHT: '2',
    RELAY_CLAIM_TIMEOUT_MS: '1000',
  });
  metrics = createMetrics(new Registry());
  pipeline = await startTestPipeline({ db, config, metrics });
});

afterAll(async () => {
  await pipeline?.stop();
  await stripe?.close();
  await db?.drop();
  await server?.stop();
});

async function enqueue(usageId: string): Promise<string> {
  const r = await withTransaction(db.pool, (c) => recordUsage(c, { usageId, tenantId: 'acme', quantity: 1 }));
  return r.entry.idempotencyKey;
}

async function row(key: string) {
  const { rows } = await db.pool.query('SELECT * FROM outbox WHERE idempotency_key = $1', [key]);
  return rows[0];
}

const waitStatus = (key: string, status: string, timeoutMs = 30_000) =>
  waitFor(`${key} to be ${status}`, async () => ((await row(key))?.status === status ? row(key) : undefined), timeoutMs);

describe('a start Temporal refuses', () => {
  it('leaves the row dead with Temporal’s answer, and the lane goes on', async () => {
    // More refused events than the lane holds (LANE_MAX_IN_FLIGHT=2), then one that fits: before,
    // the refused ones stayed claimed, were claimed again forever, and held the lane shut.
    const long = [1, 2, 3].map((i) => enqueue(`${'long-usage-id-'.repeat(5)}${i}`));
    const refused = await Promise.all(long);
    for (const key of refused) expect(Buffer.byteLength(key)).toBeGreaterThan(MAX_ID_LENGTH);
    const short = await enqueue(`s-${randomUUID().slice(0, 8)}`);

    await waitStatus(short, 'sent');
    expect(stripe.events().filter((e) => e.identifier === short)).toHaveLength(1);
    for (const key of refused) {
      const dead = await waitStatus(key, 'dead');
      expect(dead.last_error_code).toBe(TemporalErrorCodes.startRefused);
      expect(dead.last_error_message).toMatch(/^INVALID_ARGUMENT: .*WorkflowId exceeds maximum allowed length/);
    }
    expect((await metrics.startFailures.get()).values.find((v) => v.labels.reason === 'refused')?.value).toBeGreaterThanOrEqual(3);
    const status = await outboxStatus(db.pool, schemaFor());
    expect(status.deadByErrorCode).toContainEqual({ code: TemporalErrorCodes.startRefused, count: 3 });
    expect(status.counts.claimed).toBe(0);

    // The reopen path meets the same refusal: the row stays dead, with the reason, not in flight.
    const retrier = new DeadLetterRetrier({ db: db.pool, schema: schemaFor(), client: pipeline.client, config, now: Date.now });
    const retried = await retrier.retryKey(refused[0]!, { force: false, requestedBy: 'test' });
    expect(retried).toMatchObject({ outcome: 'failed' });
    expect(retried.message).toMatch(/WorkflowId exceeds maximum allowed length|Failed to start Workflow/);
    expect((await row(refused[0]!)).status).toBe('dead');
  });
});

describe('a start that fails for a reason that may pass', () => {
  it('is tried again, and meanwhile counted by status, the metric and the log; a start that works clears it', async () => {
    // A database of its own, with no worker on it: only the relays this test runs claim its rows.
    const own = await createTestDb();
    const notifier = new OutboxNotifier(own.url);
    try {
      await addCustomer(own.pool, 'acme', 'cus_acme');
      const r = await withTransaction(own.pool, (c) => recordUsage(c, { usageId: randomUUID(), tenantId: 'acme', quantity: 1 }));
      const key = r.entry.idempotencyKey;
      const unavailable = Object.assign(new Error('14 UNAVAILABLE: connection refused'), { code: 14, details: 'connection refused', metadata: {} });
      const failing = { workflow: { start: () => Promise.reject(unavailable) } } as unknown as Client;
      const logged: { msg: string; fields: Record<string, unknown> }[] = [];
      const relayWith = (client: Client, queue = config.temporal.taskQueue) =>
        createRelayActivities({
          db: own.pool,
          client,
          notifier,
          config: { ...config, temporal: { ...config.temporal, taskQueue: queue } },
          runForMs: 1_500,
          metrics,
          log: (msg, fields) => logged.push({ msg, fields }),
        }).relayOutbox;
      const before = (await metrics.startFailures.get()).values.find((v) => v.labels.reason === 'transient')?.value ?? 0;

      const result = (await new MockActivityEnvironment().run(relayWith(failing), 'relay-failing')) as RelayResult;
      expect(result.failedToStart).toBeGreaterThanOrEqual(1);
      expect(result.refused).toBe(0);
      const { rows } = await own.pool.query('SELECT status, last_error_code, last_error_message FROM outbox WHERE idempotency_key = $1', [key]);
      expect(rows[0]).toMatchObject({ status: 'claimed', last_error_code: TemporalErrorCodes.startFailing });
      expect(rows[0].last_error_message).toContain('UNAVAILABLE');
      expect((await outboxStatus(own.pool, schemaFor())).startFailing).toBe(1);
      expect((await metrics.startFailures.get()).values.find((v) => v.labels.reason === 'transient')?.value).toBeGreaterThan(before);
      expect(logged.some((l) => l.fields.key === key && /failed to start/.test(l.msg))).toBe(true);

      // Temporal back (a task queue no worker polls: only the start matters here): dispatched, the note gone.
      await new Promise((resolve) => setTimeout(resolve, Number(config.relay.claimTimeoutMs)));
      const working = new Client({ connection: pipeline.connection, namespace: config.temporal.namespace });
      await new MockActivityEnvironment().run(relayWith(working, `tq-idle-${randomUUID().slice(0, 8)}`), 'relay-working');
      const { rows: after } = await own.pool.query('SELECT status, last_error_code, last_error_message FROM outbox WHERE idempotency_key = $1', [key]);
      expect(after[0]).toEqual({ status: 'dispatched', last_error_code: null, last_error_message: null });
      expect((await outboxStatus(own.pool, schemaFor())).startFailing).toBe(0);
    } finally {
      await notifier.close();
      await own.drop();
    }
  });

  it(`is tried again ${START_RETRY_MS / 1000} s after it failed, not when a long claim would lapse`, async () => {
    const own = await createTestDb();
    const notifier = new OutboxNotifier(own.url);
    try {
      await addCustomer(own.pool, 'acme', 'cus_acme');
      const r = await withTransaction(own.pool, (c) => recordUsage(c, { usageId: randomUUID(), tenantId: 'acme', quantity: 1 }));
      const unavailable = Object.assign(new Error('14 UNAVAILABLE: connection refused'), { code: 14, details: 'connection refused', metadata: {} });
      const failing = { workflow: { start: () => Promise.reject(unavailable) } } as unknown as Client;
      const longClaims = { ...config, relay: { ...config.relay, claimTimeoutMs: 600_000 } };
      const relayWith = (client: Client, queue = config.temporal.taskQueue) =>
        createRelayActivities({ db: own.pool, client, notifier, config: { ...longClaims, temporal: { ...config.temporal, taskQueue: queue } }, runForMs: 1_000 }).relayOutbox;

      await new MockActivityEnvironment().run(relayWith(failing), 'relay-failing');
      const { rows } = await own.pool.query<{ status: string; in_ms: number }>(
        'SELECT status, extract(epoch FROM processing_deadline - now()) * 1000 AS in_ms FROM outbox WHERE idempotency_key = $1',
        [r.entry.idempotencyKey],
      );
      expect(rows[0]!.status).toBe('claimed');
      expect(Number(rows[0]!.in_ms)).toBeLessThanOrEqual(START_RETRY_MS);

      await new Promise((resolve) => setTimeout(resolve, START_RETRY_MS));
      const working = new Client({ connection: pipeline.connection, namespace: config.temporal.namespace });
      await new MockActivityEnvironment().run(relayWith(working, `tq-idle-${randomUUID().slice(0, 8)}`), 'relay-working');
      const { rows: after } = await own.pool.query('SELECT status FROM outbox WHERE idempotency_key = $1', [r.entry.idempotencyKey]);
      expect(after[0]).toEqual({ status: 'dispatched' });
    } finally {
      await notifier.close();
      await own.drop();
    }
  });
});
