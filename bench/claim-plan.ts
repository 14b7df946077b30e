/**
 * `npx tsx bench/claim-plan.ts`: the plan of the relay's claim with one tenant's flood pending.
 * 1,000,000 claimable rows of one tenant ("flood") and one row each of 50 others, written after the
 * flood (the others' events are the newest). For each mode, as the relay calls claimBatch (batch
 * 100; LANE_MAX_IN_FLIGHT as each API's default: 4 for v1, 100 for v2): EXPLAIN (ANALYZE, BUFFERS) of the
 * statement claimStatement sends, rolled back so that both modes see the same table, and how many of
 * the 50 other tenants the batch holds. Only PostgreSQL (embedded); nothing else is started.
 */
import { randomUUID } from 'node:crypto';
import { chmod, mkdtemp, rm } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import type { Queryable } from '../src/db.js';
import { createPool, migrate } from '../src/db.js';
import { CALL_LANE_MAX_IN_FLIGHT, STREAM_LANE_MAX_IN_FLIGHT } from '../src/config.js';
import { startEmbeddedPostgres } from '../src/embedded/postgres.js';
import { claimStatement } from '../src/outbox/sql/relay.js';
import { schemaFor } from '../src/outbox/sql/schema.js';

type ClaimOptions = Parameters<typeof claimStatement>[2];

const FLOOD = 1_000_000;
const OTHERS = 50;
const BATCH = 100;

const tmp = await mkdtemp(path.join(os.tmpdir(), 'billing-outbox-claim-plan-'));
// PostgreSQL runs as its own user when started by root: it must be able to enter the folder.
await chmod(tmp, 0o755);
const server = await startEmbeddedPostgres({ dataDir: path.join(tmp, 'pg'), database: 'postgres', persistent: false });
try {
  const url = await server.createDatabase('claim_plan');
  await migrate(url);
  const withPath = new URL(url);
  withPath.searchParams.set('options', `-c search_path=${schemaFor().name}`);
  const pool = createPool(withPath.toString(), 2);
  try {
    await pool.query(
      `INSERT INTO billing_customers SELECT 'flood', 'cus_flood' UNION ALL SELECT 'other' || g, 'cus_other_' || g FROM generate_series(1, $1::int) g`,
      [OTHERS],
    );
    await pool.query(
      `INSERT INTO outbox (tenant_id, event_name, quantity, occurred_at, idempotency_key)
       SELECT 'flood', 'api_requests', 1, now(), 'flood-' || g FROM generate_series(1, $1::int) g`,
      [FLOOD],
    );
    await pool.query(
      `INSERT INTO outbox (tenant_id, event_name, quantity, occurred_at, idempotency_key)
       SELECT 'other' || g, 'api_requests', 1, now(), 'other-' || g FROM generate_series(1, $1::int) g`,
      [OTHERS],
    );
    await pool.query('VACUUM ANALYZE outbox');

    for (const [mode, laneMax] of [['v1', CALL_LANE_MAX_IN_FLIGHT], ['v2', STREAM_LANE_MAX_IN_FLIGHT]] as const) {
      const opts: ClaimOptions = { limit: BATCH, claimedBy: 'bench', claimId: randomUUID(), claimTimeoutMs: 60_000, laneMax };
      // Exactly what claimBatch sends, captured rather than rewritten here.
      let sent: { text: string; values: unknown[] } | undefined;
      const capture: Queryable = {
        query: ((text: string, values: unknown[]) => ((sent = { text, values }), Promise.resolve({ rows: [] }))) as unknown as Queryable['query'],
      };
      await claimStatement(capture, schemaFor(), opts);
      const client = await pool.connect();
      try {
        // A first run warms the cache, as a relay's claims do one after another.
        await client.query('BEGIN');
        await client.query(sent!.text, sent!.values);
        await client.query('ROLLBACK');
        await client.query('BEGIN');
        const t0 = performance.now();
        const { rows } = await client.query<{ tenant_id: string }>(sent!.text, sent!.values);
        const ms = performance.now() - t0;
        await client.query('ROLLBACK');
        await client.query('BEGIN');
        const explained = await client.query(`EXPLAIN (ANALYZE, BUFFERS) ${sent!.text}`, sent!.values);
        await client.query('ROLLBACK');
        const others = new Set(rows.filter((r) => r.tenant_id !== 'flood').map((r) => r.tenant_id)).size;
        console.log(`\n== ${mode} (laneMax ${laneMax}): claimed ${rows.length}, other tenants in the batch ${others}/${OTHERS}, ${ms.toFixed(1)} ms`);
        console.log(explained.rows.map((r: Record<string, string>) => r['QUERY PLAN']).join('\n'));
      } finally {
        client.release();
      }
    }
  } finally {
    await pool.end();
  }
} finally {
  await server.stop();
  await rm(tmp, { recursive: true, force: true });
}
