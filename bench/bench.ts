/**
 * `npm run bench`: reproducible throughput figures on real PostgreSQL and a real Temporal dev server
 * (both started here, embedded), with the local Stripe-compatible server.
 *
 *   npm run bench -- [--events 2000] [--only enqueue,claim,drain]
 *
 * Prints one JSON line per measurement. Compare figures from one run on one machine; the absolute
 * numbers move with the machine and its neighbours.
 */
import { randomUUID } from 'node:crypto';
import { chmod, mkdtemp, rm } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { parseArgs } from 'node:util';
import { bundleWorkflowCode } from '@temporalio/worker';
import { loadConfig } from '../src/config.js';
import { createPool, migrate, withTransaction } from '../src/db.js';
import { startEmbeddedPostgres } from '../src/embedded/postgres.js';
import { startTemporalDevServer } from '../src/embedded/temporal.js';
import { recordUsage } from '../src/outbox/enqueue.js';
import { claimBatch } from '../src/outbox/sql/relay.js';
import { createStripeClient } from '../src/stripe/client.js';
import { LocalStripe } from '../src/stripe/local/server.js';
import { installTemporalRuntime } from '../src/temporal/runtime.js';
import { connectTemporal, startWorker, WORKFLOWS_PATH } from '../src/temporal/worker.js';

const { values } = parseArgs({
  options: {
    events: { type: 'string', default: '2000' },
    only: { type: 'string', default: 'enqueue,claim,drain' },
    rate: { type: 'string', default: '1000' },
    customers: { type: 'string', default: '4' },
  },
});
const N = Number(values.events);
const C = Number(values.customers);
const only = new Set(values.only!.split(','));
installTemporalRuntime(undefined, 'ERROR');

const report = (name: string, figures: Record<string, unknown>) => console.log(JSON.stringify({ bench: name, ...figures }));
const rate = (n: number, ms: number) => Math.round((n / ms) * 1000);
const pct = (sorted: number[], p: number) => sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))]!;

const tmp = await mkdtemp(path.join(os.tmpdir(), 'billing-outbox-bench-'));
await chmod(tmp, 0o755);
const pg = await startEmbeddedPostgres({ dataDir: path.join(tmp, 'pg'), database: 'postgres', persistent: false });
const temporal = await startTemporalDevServer({ dbFile: path.join(tmp, 'temporal.db') });
try {
  async function freshDb() {
    const name = `bench_${randomUUID().slice(0, 8)}`;
    const url = await pg.createDatabase(name);
    await migrate(url);
    const pool = createPool(url, 20);
    await pool.query(`INSERT INTO billing_customers SELECT 't' || g, 'cus_' || g FROM generate_series(1, $1::int) g`, [C]);
    return { url, pool };
  }

  if (only.has('enqueue')) {
    const { pool } = await freshDb();
    for (const concurrency of [1, 8]) {
      const per = Math.floor(N / concurrency);
      const started = performance.now();
      await Promise.all(
        Array.from({ length: concurrency }, async (_, w) => {
          for (let i = 0; i < per; i++) {
            await withTransaction(pool, (c) => recordUsage(c, { usageId: `e${concurrency}-${w}-${i}`, tenantId: `t${(i % C) + 1}`, quantity: 1 }));
          }
        }),
      );
      const ms = performance.now() - started;
      report('enqueue', { concurrency, events: per * concurrency, ms: Math.round(ms), eventsPerSecond: rate(per * concurrency, ms) });
    }
    await pool.end();
  }

  if (only.has('claim')) {
    for (const claimers of [1, 8]) {
      const { pool } = await freshDb();
      await pool.query(
        `INSERT INTO outbox (tenant_id, event_name, quantity, occurred_at, idempotency_key)
         SELECT 't1', 'api_requests', 1, now(), 'k' || g FROM generate_series(1, $1::int) g`,
        [N * 5],
      );
      // A realistic table: many sent rows beside the pending ones.
      await pool.query(
        `INSERT INTO outbox (tenant_id, event_name, quantity, occurred_at, idempotency_key, status)
         SELECT 't1', 'api_requests', 1, now(), 's' || g, 'sent' FROM generate_series(1, 200000) g`,
      );
      await pool.query('ANALYZE outbox');
      let claimed = 0;
      const started = performance.now();
      await Promise.all(
        Array.from({ length: claimers }, async () => {
          for (;;) {
            const rows = await claimBatch(pool, { limit: 200, claimedBy: 'bench', claimId: randomUUID(), leaseMs: 60_000, laneMax: 1_000 });
            if (rows.length === 0) return;
            claimed += rows.length;
          }
        }),
      );
      const ms = performance.now() - started;
      report('claim', { claimers, batch: 200, rows: claimed, sentRowsInTable: 200000, ms: Math.round(ms), rowsPerSecond: rate(claimed, ms) });
      await pool.end();
    }
  }

  if (only.has('drain')) {
    const { url, pool } = await freshDb();
    const stripe = await LocalStripe.start({ meters: ['api_requests'], customers: Array.from({ length: C }, (_, i) => `cus_${i + 1}`) });
    const config = loadConfig({
      TEMPORAL_ADDRESS: temporal.address,
      TEMPORAL_TASK_QUEUE: `bench-${randomUUID()}`,
      STRIPE_API_BASE: stripe.url,
      STRIPE_API_KEY: 'sk_test_bench',
      STRIPE_RATE_LIMIT_PER_SECOND: values.rate!,
      RELAY_COUNT: '2',
      LOG_LEVEL: 'silent',
    });
    const t = await connectTemporal(temporal.address, 'default');
    const bundle = await bundleWorkflowCode({ workflowsPath: WORKFLOWS_PATH, logger: { trace() {}, debug() {}, info() {}, warn() {}, error() {}, log() {} } });
    const worker = await startWorker({
      config, databaseUrl: url, pool, stripe: createStripeClient(config.stripe), connection: t.connection, client: t.client,
      workflowBundle: { code: bundle.code },
    });
    // Backlog first (as after an outage), then measure the drain.
    await withTransaction(pool, async (c) => {
      for (let i = 0; i < N; i++) await recordUsage(c, { usageId: `d-${i}`, tenantId: `t${(i % C) + 1}`, quantity: 1 });
    });
    const started = performance.now();
    for (;;) {
      const { rows } = await pool.query(`SELECT count(*)::int AS n FROM outbox WHERE status = 'sent'`);
      if (rows[0].n >= N) break;
      await new Promise((r) => setTimeout(r, 100));
    }
    const ms = performance.now() - started;
    const lat = (await pool.query(`SELECT extract(epoch FROM sent_at - created_at) * 1000 AS ms FROM outbox ORDER BY 1`)).rows.map((r: { ms: number }) => Number(r.ms));
    report('drain', {
      events: N, customers: C, relays: 2, rateLimit: Number(values.rate), ms: Math.round(ms), eventsPerSecond: rate(N, ms),
      stripeEvents: stripe.events().length, commitToAckMsP50: Math.round(pct(lat, 50)), commitToAckMsP99: Math.round(pct(lat, 99)),
    });
    // An idle pipeline: single events committed one at a time. The relay is asleep on LISTEN; what
    // wakes it is the NOTIFY at commit (the polling fallback alone would take up to RELAY_POLL_INTERVAL_MS).
    for (let i = 0; i < 20; i++) {
      await withTransaction(pool, (c) => recordUsage(c, { usageId: `idle-${i}`, tenantId: 't1', quantity: 1 }));
      await new Promise((r) => setTimeout(r, 300));
    }
    for (;;) {
      const { rows } = await pool.query(`SELECT count(*)::int AS n FROM outbox WHERE status = 'sent' AND idempotency_key LIKE 'usage_log:idle-%'`);
      if (rows[0].n >= 20) break;
      await new Promise((r) => setTimeout(r, 100));
    }
    const idle = await pool.query<{ dispatch: number; ack: number }>(
      `SELECT extract(epoch FROM dispatched_at - created_at) * 1000 AS dispatch, extract(epoch FROM sent_at - created_at) * 1000 AS ack
         FROM outbox WHERE idempotency_key LIKE 'usage_log:idle-%'`,
    );
    const dispatch = idle.rows.map((r) => Number(r.dispatch)).sort((a, b) => a - b);
    const ack = idle.rows.map((r) => Number(r.ack)).sort((a, b) => a - b);
    report('idle', {
      events: 20, pollIntervalMs: config.relay.pollIntervalMs,
      commitToDispatchedMsP50: Math.round(pct(dispatch, 50)), commitToDispatchedMsMax: Math.round(dispatch.at(-1)!),
      commitToAckMsP50: Math.round(pct(ack, 50)), commitToAckMsMax: Math.round(ack.at(-1)!),
    });
    await worker.shutdown();
    await t.clientConnection.close();
    await t.connection.close();
    await stripe.close();
    await pool.end();
  }
} finally {
  await temporal.stop();
  await pg.stop();
  await rm(tmp, { recursive: true, force: true });
}
