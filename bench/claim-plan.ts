/**
 * `npx tsx bench/claim-plan.ts`: the plan of the relay's claim under two backlogs.
 * - One tenant's flood: 1,000,000 claimable rows of one tenant ("flood") and one row each of 50
 *   others, written after the flood (the others' events are the newest).
 * - Many tenants waiting, as after an outage: 2,000 tenants with 150 rows each, interleaved; then
 *   the same with 99 of each tenant's rows in flight (dispatched), as while that backlog drains.
 * - Very many lanes waiting: 100,000 tenants with 3 rows each, as after an outage at a deployment
 *   with that many customers (`--only-lanes` runs this one alone).
 * For each mode, as the relay calls claimBatch (batch 100; LANE_MAX_IN_FLIGHT as each API's
 * default: 4 for v1, 100 for v2): EXPLAIN (ANALYZE, BUFFERS) of the statement claimStatement sends,
 * rolled back so that both modes see the same table, the rows its scans of the outbox read, and
 * which tenants the batch holds. Only PostgreSQL (embedded); nothing else is started.
 */
import { randomUUID } from 'node:crypto';
import type { Queryable } from '../src/db.js';
import { CALL_LANE_MAX_IN_FLIGHT, STREAM_LANE_MAX_IN_FLIGHT } from '../src/config.js';
import { claimStatement } from '../src/outbox/sql/relay.js';
import { schemaFor } from '../src/outbox/sql/schema.js';
import { withMigratedDatabase, type BenchPool } from './embedded-db.js';

type ClaimOptions = Parameters<typeof claimStatement>[2];
type Pool = BenchPool;

const FLOOD = 1_000_000;
const OTHERS = 50;
const BATCH = 100;
const MANY_TENANTS = 2_000;
const MANY_ROWS = 150;
const IN_FLIGHT_EACH = STREAM_LANE_MAX_IN_FLIGHT - 1;
const MOST_LANES = 100_000;
const MOST_LANES_ROWS = 3;
const onlyLanes = process.argv.includes('--only-lanes');

/** Every row the plan's scans of the outbox produced or threw away, over all their loops. */
function rowsRead(node: Record<string, unknown>): number {
  const own = node['Relation Name'] === 'outbox' ? (Number(node['Actual Rows'] ?? 0) + Number(node['Rows Removed by Filter'] ?? 0)) * Number(node['Actual Loops'] ?? 1) : 0;
  return own + ((node['Plans'] as Record<string, unknown>[] | undefined) ?? []).reduce((sum, child) => sum + rowsRead(child), 0);
}

/** The claim of each mode on the table as it is, each run rolled back. */
async function explainBoth(pool: Pool, scenario: string, describe: (rows: { tenant_id: string }[]) => string): Promise<void> {
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
      // The rows taken (the statement answers one row of nulls, with where it stopped, when it takes none).
      const rows = (await client.query<{ id: string | null; tenant_id: string }>(sent!.text, sent!.values)).rows.filter((r) => r.id !== null);
      const ms = performance.now() - t0;
      await client.query('ROLLBACK');
      await client.query('BEGIN');
      const json = await client.query(`EXPLAIN (ANALYZE, FORMAT JSON) ${sent!.text}`, sent!.values);
      await client.query('ROLLBACK');
      await client.query('BEGIN');
      const explained = await client.query(`EXPLAIN (ANALYZE, BUFFERS) ${sent!.text}`, sent!.values);
      await client.query('ROLLBACK');
      const read = rowsRead((json.rows[0]['QUERY PLAN'] as { Plan: Record<string, unknown> }[])[0]!.Plan);
      console.log(`\n== ${scenario}, ${mode} (laneMax ${laneMax}): claimed ${rows.length}, ${describe(rows)}, ${read.toLocaleString('en')} rows read, ${ms.toFixed(1)} ms`);
      console.log(explained.rows.map((r: Record<string, string>) => r['QUERY PLAN']).join('\n'));
    } finally {
      client.release();
    }
  }
}

await withMigratedDatabase('claim-plan', async (pool) => {
  await pool.query(
    `INSERT INTO billing_customers SELECT 'flood', 'cus_flood' UNION ALL SELECT 'other' || g, 'cus_other_' || g FROM generate_series(1, $1::int) g`,
    [Math.max(OTHERS, MANY_TENANTS, MOST_LANES)],
  );
  if (!onlyLanes) await smallerBacklogs(pool);
  // Very many lanes waiting: the claim's cost is bounded by the lanes it looks at, not by those waiting.
  await interleavedBacklog(pool, 'lanes', MOST_LANES, MOST_LANES_ROWS);
});

/**
 * A backlog after an outage: `tenants` tenants (other1…) with `rows` rows each waiting, written
 * interleaved (each tenant's oldest rows as old as the others'), then each mode's claim on it.
 */
async function interleavedBacklog(pool: Pool, tag: string, tenants: number, rows: number): Promise<void> {
  await pool.query('TRUNCATE outbox');
  await pool.query(
    `INSERT INTO outbox (tenant_id, event_name, quantity, occurred_at, idempotency_key, usage_id)
     SELECT 'other' || t, 'api_requests', 1, now(), $3 || '-' || r || '-' || t, r || '-' || t
       FROM generate_series(1, $2::int) r, generate_series(1, $1::int) t ORDER BY r, t`,
    [tenants, rows, tag],
  );
  await pool.query('VACUUM ANALYZE outbox');
  await explainBoth(pool, `${tenants.toLocaleString('en')} tenants with ${rows} rows each`, (claimed) => `tenants in the batch ${new Set(claimed.map((r) => r.tenant_id)).size}`);
}

async function smallerBacklogs(pool: Pool): Promise<void> {
    // One tenant's flood, then one row each of 50 others (the newest rows).
    await pool.query(
      `INSERT INTO outbox (tenant_id, event_name, quantity, occurred_at, idempotency_key, usage_id)
       SELECT 'flood', 'api_requests', 1, now(), 'flood-' || g, 'flood-' || g FROM generate_series(1, $1::int) g`,
      [FLOOD],
    );
    await pool.query(
      `INSERT INTO outbox (tenant_id, event_name, quantity, occurred_at, idempotency_key, usage_id)
       SELECT 'other' || g, 'api_requests', 1, now(), 'other-' || g, 'other-' || g FROM generate_series(1, $1::int) g`,
      [OTHERS],
    );
    await pool.query('VACUUM ANALYZE outbox');
    await explainBoth(pool, `flood of ${FLOOD.toLocaleString('en')} beside ${OTHERS} others`, (rows) => {
      const others = new Set(rows.filter((r) => r.tenant_id !== 'flood').map((r) => r.tenant_id)).size;
      return `other tenants in the batch ${others}/${OTHERS}`;
    });

    await interleavedBacklog(pool, 'many', MANY_TENANTS, MANY_ROWS);

    // The same backlog with every lane nearly full, as while it drains: IN_FLIGHT_EACH of each
    // tenant's rows dispatched (v2's lanes one short of full; v1's full), the rest waiting.
    await pool.query(
      `UPDATE outbox SET status = 'dispatched', dispatched_at = now() WHERE id IN (
         SELECT id FROM (SELECT id, row_number() OVER (PARTITION BY tenant_id ORDER BY id) AS n FROM outbox) r WHERE r.n <= $1::int)`,
      [IN_FLIGHT_EACH],
    );
    await pool.query('VACUUM ANALYZE outbox');
    await explainBoth(
      pool,
      `${MANY_TENANTS.toLocaleString('en')} tenants with ${IN_FLIGHT_EACH} rows each in flight and ${MANY_ROWS - IN_FLIGHT_EACH} waiting`,
      (rows) => `tenants in the batch ${new Set(rows.map((r) => r.tenant_id)).size}`,
    );
}
