/**
 * `npm run bench -- claim`: the relay's claim statement in a large table: 1,000,000 sent rows, and a
 * live backlog (20,000 pending over 100 lanes, a few in flight). Its plan (EXPLAIN ANALYZE of the
 * statement claimBatch sends, captured) and its latency over repeated claims, each claim rolled
 * back so that every one sees the same table.
 */
import { randomUUID } from 'node:crypto';
import type { Queryable } from '../src/db.js';
import { claimStatement } from '../src/outbox/sql/relay.js';
import { freshDatabase, pct, type Report, type Services } from './harness.js';
import { schemaFor } from '../src/outbox/sql/schema.js';

export async function claim(services: Services, report: Report, opts: { sentRows: number; pending: number; lanes: number; claims: number }): Promise<void> {
  const db = await freshDatabase(services, opts.lanes);
  try {
    await db.pool.query(
      `INSERT INTO outbox (tenant_id, event_name, quantity, occurred_at, idempotency_key, usage_id, status, sent_at)
       SELECT 't' || (1 + g % $2::int), 'api_requests', 1, now(), 'sent-' || g, 'sent-' || g, 'sent', now() FROM generate_series(1, $1::int) g`,
      [opts.sentRows, opts.lanes],
    );
    await db.pool.query(
      `INSERT INTO outbox (tenant_id, event_name, quantity, occurred_at, idempotency_key, usage_id)
       SELECT 't' || (1 + g % $2::int), 'api_requests', 1, now(), 'live-' || g, 'live-' || g FROM generate_series(1, $1::int) g`,
      [opts.pending, opts.lanes],
    );
    await db.pool.query(`UPDATE outbox SET status = 'dispatched' WHERE idempotency_key IN (SELECT 'live-' || g FROM generate_series(1, 200) g)`);
    await db.pool.query('VACUUM ANALYZE outbox');

    const params = { limit: 200, claimedBy: 'bench', claimId: randomUUID(), claimTimeoutMs: 60_000, laneMax: 4 };
    let sent: { text: string; values: unknown[] } | undefined;
    const capture: Queryable = {
      query: ((text: string, values: unknown[]) => ((sent = { text, values }), Promise.resolve({ rows: [] }))) as unknown as Queryable['query'],
    };
    await claimStatement(capture, schemaFor(), params);

    const client = await db.pool.connect();
    const ms: number[] = [];
    let plan = '';
    let claimed = 0;
    try {
      for (let i = 0; i < opts.claims; i++) {
        await client.query('BEGIN');
        const t0 = performance.now();
        const { rows } = await client.query(sent!.text, sent!.values);
        ms.push(performance.now() - t0);
        claimed = rows.filter((r) => r.id !== null).length;
        await client.query('ROLLBACK');
      }
      await client.query('BEGIN');
      const explained = await client.query(`EXPLAIN (ANALYZE, BUFFERS) ${sent!.text}`, sent!.values);
      await client.query('ROLLBACK');
      plan = explained.rows.map((r: Record<string, string>) => r['QUERY PLAN']).join('\n');
    } finally {
      client.release();
    }
    ms.sort((a, b) => a - b);
    report.rows.push({
      sentRows: opts.sentRows,
      pending: opts.pending,
      lanes: opts.lanes,
      rowsPerClaim: claimed,
      claims: opts.claims,
      p50Ms: Math.round(pct(ms, 50) * 100) / 100,
      p99Ms: Math.round(pct(ms, 99) * 100) / 100,
      seqScan: /Seq Scan/.test(plan),
    });
    report.notes.push(`plan (EXPLAIN ANALYZE of the statement the relay sends):\n${plan}`);
  } finally {
    await db.pool.end();
  }
}
