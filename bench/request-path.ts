/**
 * `npm run bench -- request-path`: what recordUsage adds to the application's own transaction. The
 * same transaction, in the same run, on the same connection pool: BEGIN, the application's usage
 * insert, COMMIT — then the same with recordUsage before the COMMIT (one more statement: the
 * usage_logs row and the outbox row). Sequential, one transaction at a time, so each figure is
 * latency, not queueing; interleaved in rounds so that drift of the machine hits both alike.
 */
import { randomUUID } from 'node:crypto';
import { createPool, withTransaction } from '../src/db.js';
import { recordUsage } from '../src/outbox/enqueue.js';
import { freshDatabase, pct, type Report, type Services } from './harness.js';

export async function requestPath(services: Services, report: Report, opts: { events: number }): Promise<void> {
  const db = await freshDatabase(services, 10);
  // The application's own usage table, as it would have one without billing-outbox.
  await db.pool.query(`CREATE TABLE app_usage (id text PRIMARY KEY, tenant_id text NOT NULL, quantity bigint NOT NULL, occurred_at timestamptz NOT NULL DEFAULT now())`);
  const bare: number[] = [];
  const outbox: number[] = [];
  const round = 500;
  const runId = randomUUID().slice(0, 8);
  try {
    for (let done = 0; done < opts.events; done += round) {
      for (let i = done; i < done + round; i++) {
        const t0 = performance.now();
        await withTransaction(db.pool, (c) =>
          c.query('INSERT INTO app_usage (id, tenant_id, quantity) VALUES ($1, $2, $3)', [`${runId}-${i}`, `t${(i % 10) + 1}`, 1]),
        );
        bare.push(performance.now() - t0);
      }
      for (let i = done; i < done + round; i++) {
        const t0 = performance.now();
        await withTransaction(db.pool, async (c) => {
          await c.query('INSERT INTO app_usage (id, tenant_id, quantity) VALUES ($1, $2, $3)', [`${runId}-o${i}`, `t${(i % 10) + 1}`, 1]);
          await recordUsage(c, { usageId: `${runId}-${i}`, tenantId: `t${(i % 10) + 1}`, quantity: 1 });
        });
        outbox.push(performance.now() - t0);
      }
    }
    await concurrently(db.url, runId, report);
  } finally {
    await db.pool.end();
  }
  const row = (name: string, ms: number[]) => {
    const sorted = [...ms].sort((a, b) => a - b);
    return { transaction: name, count: ms.length, p50Ms: round3(pct(sorted, 50)), p99Ms: round3(pct(sorted, 99)), meanMs: round3(ms.reduce((a, b) => a + b, 0) / ms.length) };
  };
  const b = row('BEGIN; INSERT usage; COMMIT', bare);
  const o = row('BEGIN; INSERT usage; recordUsage; COMMIT', outbox);
  report.rows.push(b, o, { transaction: 'ratio (recordUsage / bare)', p50Ms: round3(o.p50Ms / b.p50Ms), p99Ms: round3(o.p99Ms / b.p99Ms), meanMs: round3(o.meanMs / b.meanMs) });
  report.notes.push(
    'one transaction at a time, PostgreSQL on loopback (embedded, fsync on): the difference is one more round trip and what the usage_logs row, the outbox row, their indexes and the NOTIFY trigger add to the commit',
  );
}

const round3 = (x: number) => Math.round(x * 1000) / 1000;

/**
 * The same transactions from WRITERS connections at once, for WRITER_SECONDS each: commits per
 * second and latency, bare, with recordUsage, and with recordUsage on a session that sets
 * `billing_outbox.notify = off` (a transaction that sent a NOTIFY commits under a lock every such
 * commit of the server takes in turn; the others share their WAL flushes).
 */
const WRITERS = 16;
const WRITER_SECONDS = 10;

async function concurrently(url: string, runId: string, report: Report): Promise<void> {
  const shapes: { name: string; notify: boolean; record: boolean }[] = [
    { name: `${WRITERS} at once: BEGIN; INSERT usage; COMMIT`, notify: true, record: false },
    { name: `${WRITERS} at once: … recordUsage; COMMIT (NOTIFY)`, notify: true, record: true },
    { name: `${WRITERS} at once: … recordUsage; COMMIT (billing_outbox.notify = off)`, notify: false, record: true },
  ];
  for (const shape of shapes) {
    // As the benchmark's own pool: the application's table is found in our schema.
    const withPath = new URL(url);
    withPath.searchParams.set('options', '-c search_path=billing_outbox');
    const pool = createPool(withPath.toString(), WRITERS);
    if (!shape.notify) pool.on('connect', (c) => void c.query(`SET billing_outbox.notify = off`));
    const ms: number[] = [];
    const until = performance.now() + WRITER_SECONDS * 1000;
    const started = performance.now();
    let n = 0;
    try {
      await Promise.all(
        Array.from({ length: WRITERS }, async () => {
          while (performance.now() < until) {
            const i = n++;
            const id = `${runId}-${shape.record ? (shape.notify ? 'n' : 'q') : 'b'}${i}`;
            const t0 = performance.now();
            await withTransaction(pool, async (c) => {
              await c.query('INSERT INTO app_usage (id, tenant_id, quantity) VALUES ($1, $2, $3)', [id, `t${(i % 10) + 1}`, 1]);
              if (shape.record) await recordUsage(c, { usageId: id, tenantId: `t${(i % 10) + 1}`, quantity: 1 });
            });
            ms.push(performance.now() - t0);
          }
        }),
      );
    } finally {
      await pool.end();
    }
    const sorted = [...ms].sort((a, b) => a - b);
    report.rows.push({
      transaction: shape.name,
      count: ms.length,
      perSecond: Math.round(ms.length / ((performance.now() - started) / 1000)),
      p50Ms: round3(pct(sorted, 50)),
      p99Ms: round3(pct(sorted, 99)),
    });
  }
}
