/**
 * Prometheus metrics on real services: the outbox gauges read from PostgreSQL at scrape time, and
 * the worker's counters after real deliveries through Temporal to the local Stripe server.
 */
import http from 'node:http';
import type { AddressInfo } from 'node:net';
import { randomBytes } from 'node:crypto';
import { Registry } from 'prom-client';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { buildApi, type Api } from '../src/api/index.js';
import { CALL_LANE_MAX_IN_FLIGHT, type ApiToken } from '../src/config.js';
import { createPool } from '../src/db.js';
import { createLogger } from '../src/log.js';
import { createMetrics, startMetricsServer, type Metrics } from '../src/metrics.js';
import { idleInFlightAlarmMs, outboxStatus } from '../src/ops/status.js';
import { statusSummary } from '../src/outbox/sql/status.js';
import { refusedForGood, testConfig, usePipeline, waitFor } from './hooks.js';

const reader: ApiToken = { name: 'prometheus', token: `tok_${randomBytes(24).toString('hex')}`, tenants: ['*'], scopes: ['metrics:read'] };

const t = usePipeline({
  // Every call for 'ghost' is refused (a 400): its events die at once.
  customers: { acme: 'cus_acme', ghost: 'cus_ghost' },
  stripe: { meters: ['api_requests'], refuseCustomers: { cus_ghost: refusedForGood('cus_ghost') } },
  // The gauges are read with no worker running; 'counters after real deliveries' starts one.
  worker: false,
  metrics: (pool) => createMetrics(new Registry(), { db: pool }),
});
const { enqueue, waitStatus } = t;
let metrics: Metrics;
let api: Api;

beforeAll(() => {
  metrics = t.metrics!;
  api = buildApi({ config: testConfig({ API_TOKENS: JSON.stringify([reader]) }), db: t.pool, log: createLogger('silent'), metrics });
});

afterAll(async () => {
  await api?.close();
});

/** The value of one sample in Prometheus text, or undefined when the series is absent. */
function sample(text: string, name: string, labels = ''): number | undefined {
  const line = text.split('\n').find((l) => l.startsWith(`${name}${labels} `));
  return line === undefined ? undefined : Number(line.slice(line.lastIndexOf(' ') + 1));
}

async function scrape(): Promise<string> {
  const res = await api.inject({ method: 'GET', url: '/metrics', headers: { authorization: `Bearer ${reader.token}` } });
  expect(res.statusCode).toBe(200);
  return res.body;
}

describe('outbox gauges (no worker running)', () => {
  it('count rows by status and move when usage is enqueued', async () => {
    const before = await scrape();
    const pending = sample(before, 'billing_outbox_rows', '{status="pending"}');
    expect(pending).toBe(0);
    for (const status of ['claimed', 'dispatched', 'sent', 'dead']) expect(sample(before, 'billing_outbox_rows', `{status="${status}"}`)).toBe(0);
    expect(sample(before, 'billing_outbox_oldest_pending_age_seconds')).toBe(0);

    await enqueue('acme', 1);
    await enqueue('acme', 2);
    await enqueue('acme', 3);
    const after = await scrape();
    expect(sample(after, 'billing_outbox_rows', '{status="pending"}')).toBe(3);
    expect(sample(after, 'billing_outbox_rows', '{status="sent"}')).toBe(0);
  });

  it('report the age of the oldest row still waiting for a relay', async () => {
    await enqueue('acme', 4);
    // As if the relays had been down for ten minutes.
    await t.pool.query(`UPDATE outbox SET created_at = now() - interval '10 minutes' WHERE id = (SELECT min(id) FROM outbox)`);
    const age = sample(await scrape(), 'billing_outbox_oldest_pending_age_seconds');
    expect(age).toBeGreaterThanOrEqual(600);
    expect(age).toBeLessThan(660);
  });

  it('report the event in flight untouched longest, and status raises the alarm past two hours, naming it', async () => {
    expect(sample(await scrape(), 'billing_outbox_in_flight_idle_seconds')).toBe(0);
    const key = await enqueue('acme', 5);
    const other = await enqueue('acme', 6);
    // Its run paused in Temporal (or failing its workflow task) three hours ago: no attempt since.
    await t.pool.query(`UPDATE outbox SET status = 'dispatched', updated_at = now() - interval '3 hours' WHERE idempotency_key = $1`, [key]);
    await t.pool.query(`UPDATE outbox SET status = 'dispatched', updated_at = now() - interval '1 minute' WHERE idempotency_key = $1`, [other]);
    const idle = sample(await scrape(), 'billing_outbox_in_flight_idle_seconds');
    expect(idle).toBeGreaterThanOrEqual(3 * 3600);
    expect(idle).toBeLessThan(3 * 3600 + 60);
    const report = await outboxStatus(t.pool, t.schema);
    expect(report.longestIdleInFlight).toEqual({ key, idleSeconds: expect.any(Number) });
    expect(report.alarms).toContainEqual(expect.stringMatching(new RegExp(`^an event in flight untouched for 3 h and more \\(${key}\\).*billing-outbox inspect ${key}`)));
    // Past the longest wait the settings allow a run at work (a 6-hour 429 budget here): no alarm.
    expect(idleInFlightAlarmMs({ maximumIntervalMs: 300_000, maxRateLimitedMs: 3_600_000 })).toBe(2 * 3_600_000);
    expect(idleInFlightAlarmMs({ maximumIntervalMs: 300_000, maxRateLimitedMs: 6 * 3_600_000 })).toBe(7 * 3_600_000);
    expect((await outboxStatus(t.pool, t.schema, { idleAlarmMs: 7 * 3_600_000 })).alarms).toEqual([]);
    // An hour's wait (a long Retry-After) is a run at work: no alarm.
    await t.pool.query(`UPDATE outbox SET updated_at = now() - interval '1 hour' WHERE idempotency_key = $1`, [key]);
    expect((await outboxStatus(t.pool, t.schema)).alarms).toEqual([]);
    // Gone, for the counts of the tests after this one.
    await t.pool.query('DELETE FROM outbox WHERE idempotency_key = ANY($1)', [[key, other]]);
  });

  it('include the default process metrics and the zeroed delivery counters', async () => {
    const text = await scrape();
    expect(text).toContain('process_cpu_user_seconds_total');
    expect(text).toContain('nodejs_eventloop_lag_seconds');
    expect(sample(text, 'billing_outbox_events_sent_total')).toBe(0);
    for (const c of ['retryable', 'rate_limited', 'rejected', 'delivered_duplicate', 'unsafe']) {
      expect(sample(text, 'billing_outbox_stripe_errors_total', `{class="${c}"}`)).toBe(0);
    }
    expect(text).toContain('# TYPE billing_outbox_relay_claim_batch_size histogram');
    expect(text).toContain('# TYPE billing_outbox_commit_to_ack_seconds histogram');
  });

  it('counts sent rows exactly on small tables and estimates them from table statistics on large ones', async () => {
    const insertSent = (n: number) =>
      t.pool.query(
        `INSERT INTO outbox (tenant_id, event_name, quantity, occurred_at, idempotency_key, usage_id, status, sent_at)
         SELECT 'acme', 'api_requests', 1, now(), 'sent-' || gen_random_uuid(), gen_random_uuid(), 'sent', now() FROM generate_series(1, $1::int)`,
        [n],
      );
    await insertSent(500);
    const exact = await statusSummary(t.pool, t.schema);
    expect(exact).toMatchObject({ counts: { sent: 500, pending: 4 }, sentEstimated: false });

    await t.pool.query('ANALYZE outbox');
    const estimated = await statusSummary(t.pool, t.schema, { exactCountBelow: 1 });
    expect(estimated.sentEstimated).toBe(true);
    expect(estimated.counts.pending).toBe(4);
    expect(estimated.counts.sent).toBeGreaterThan(450);
    expect(estimated.counts.sent).toBeLessThan(550);

    // The estimate path does not count: rows added since ANALYZE on the same pages do not show
    // until statistics catch up, while the exact path sees them at once.
    await insertSent(5);
    expect((await statusSummary(t.pool, t.schema)).counts.sent).toBe(505);
    expect((await statusSummary(t.pool, t.schema, { exactCountBelow: 1 })).counts.sent).not.toBe(505);

    expect(sample(await scrape(), 'billing_outbox_rows', '{status="sent"}')).toBe(505);
    await t.pool.query(`DELETE FROM outbox WHERE idempotency_key LIKE 'sent-%'`);
  });

  it('drop the outbox series (and count the failure) when the database is away, without failing the scrape', async () => {
    const deadPool = createPool('postgresql://nobody:secret@127.0.0.1:1/nothing', 1);
    try {
      const broken = createMetrics(new Registry(), { db: deadPool });
      const text = await broken.render();
      expect(sample(text, 'billing_outbox_rows', '{status="pending"}')).toBeUndefined();
      expect(sample(text, 'billing_outbox_status_query_failures_total')).toBe(1);
      expect(text).toContain('process_cpu_user_seconds_total');
    } finally {
      await deadPool.end();
    }
  });
});

describe('the worker-side metrics server', () => {
  it('serves the registry on GET /metrics and appends the Temporal SDK exporter text', async () => {
    const sdk = http.createServer((_req, res) => res.end('# TYPE temporal_worker_task_slots_available gauge\ntemporal_worker_task_slots_available{worker_type="ActivityWorker"} 100\n'));
    await new Promise<void>((resolve) => sdk.listen(0, '127.0.0.1', resolve));
    const own = createMetrics(new Registry(), { temporalSdkUrl: `http://127.0.0.1:${(sdk.address() as AddressInfo).port}/metrics` });
    const server = await startMetricsServer(own, { host: '127.0.0.1', port: 0 });
    try {
      own.eventsSent.inc(2);
      const res = await fetch(server.url);
      expect(res.status).toBe(200);
      const text = await res.text();
      expect(sample(text, 'billing_outbox_events_sent_total')).toBe(2);
      expect(sample(text, 'temporal_worker_task_slots_available', '{worker_type="ActivityWorker"}')).toBe(100);
      // No database given: no outbox gauges pretending to be zero.
      expect(text).not.toContain('billing_outbox_rows');
      expect((await fetch(server.url.replace('/metrics', '/other'))).status).toBe(404);
    } finally {
      await server.close();
      await new Promise((resolve) => sdk.close(resolve));
    }
    const unreachable = createMetrics(new Registry(), { temporalSdkUrl: 'http://127.0.0.1:1/metrics' });
    const text = await unreachable.render();
    expect(text).toContain('# Temporal SDK metrics unavailable');
    expect(text).toContain('billing_outbox_events_sent_total');
  });
});

describe('counters after real deliveries', () => {
  beforeAll(async () => {
    await t.pipeline.addWorker();
  });

  it('count sent events, commit-to-ack latency and relay claims, and the gauges follow', async () => {
    // The rows enqueued above (no worker then) are delivered now too.
    await waitFor('the backlog to drain', async () => {
      const text = await scrape();
      return ['pending', 'claimed', 'dispatched'].every((s) => sample(text, 'billing_outbox_rows', `{status="${s}"}`) === 0);
    });
    const key = await enqueue('acme', 5);
    await waitStatus(key, 'sent');
    const text = await scrape();
    expect(sample(text, 'billing_outbox_events_sent_total')).toBeGreaterThanOrEqual(5);
    expect(sample(text, 'billing_outbox_commit_to_ack_seconds_count')).toBeGreaterThanOrEqual(5);
    // The row backdated by ten minutes lands in the top buckets only.
    expect(sample(text, 'billing_outbox_commit_to_ack_seconds_bucket', '{le="300"}')).toBeLessThan(sample(text, 'billing_outbox_commit_to_ack_seconds_count')!);
    expect(sample(text, 'billing_outbox_relay_claim_batch_size_count')).toBeGreaterThanOrEqual(1);
    expect(sample(text, 'billing_outbox_relay_claim_batch_size_sum')).toBeGreaterThanOrEqual(5);
    expect(sample(text, 'billing_outbox_relay_claim_duration_seconds_count')).toBeGreaterThanOrEqual(sample(text, 'billing_outbox_relay_claim_batch_size_count')!);
    // One tenant's events one at a time: quiet lanes, nothing held, so the window is anywhere between its floor and the lane.
    expect(sample(text, 'billing_outbox_relay_lane_window')).toBeGreaterThanOrEqual(1);
    expect(sample(text, 'billing_outbox_relay_lane_window')).toBeLessThanOrEqual(CALL_LANE_MAX_IN_FLIGHT);
    expect(sample(text, 'billing_outbox_relay_lane_pause_seconds')).toBe(0);
    expect(sample(text, 'billing_outbox_rows', '{status="sent"}')).toBeGreaterThanOrEqual(5);
    expect(sample(text, 'billing_outbox_oldest_pending_age_seconds')).toBe(0);
  });

  it('classify each way a delivery can fail', async () => {
    const errors = async (c: string) => sample(await scrape(), 'billing_outbox_stripe_errors_total', `{class="${c}"}`)!;

    t.stripe.failNext(1, 500);
    const retried = await enqueue('acme', 1);
    await waitStatus(retried, 'sent');
    expect(await errors('retryable')).toBe(1);

    t.stripe.failNext(1, 429);
    const limited = await enqueue('acme', 1);
    await waitStatus(limited, 'sent');
    expect(await errors('rate_limited')).toBe(1);

    t.stripe.dropAfterRecord(2);
    const duplicate = await enqueue('acme', 1);
    await waitStatus(duplicate, 'sent');
    expect(await errors('delivered_duplicate')).toBe(1);

    const rejected = await enqueue('ghost', 1);
    await waitStatus(rejected, 'dead');
    expect(await errors('rejected')).toBe(1);

    // recordUsage refuses usage this old at the door; a row can still age past the window while it waits.
    const tooOld = await enqueue('acme', 1, {
      beforeCommit: (c, k) => c.query(`UPDATE outbox SET occurred_at = now() - interval '40 days' WHERE idempotency_key = $1`, [k]),
    });
    await waitStatus(tooOld, 'dead');
    expect(await errors('unsafe')).toBe(1);
  });
});
