/**
 * The claim serves tenants in turn: one tenant's backlog, however deep, never keeps another
 * tenant's event out of the next claim (the bound stated on claimBatch), in both modes, and the
 * claim reads at most a batch of any lane, never the backlog behind it, and a row or two of each
 * lane when many tenants wait.
 */
import { randomUUID } from 'node:crypto';
import { afterEach, describe, expect, it } from 'vitest';
import type { Queryable } from '../src/db.js';
import { CALL_LANE_MAX_IN_FLIGHT, STREAM_LANE_MAX_IN_FLIGHT } from '../src/config.js';
import { claimBatch, claimStatement, type ClaimOptions } from '../src/outbox/sql/relay.js';
import { schemaFor } from '../src/outbox/sql/schema.js';
import { useDatabase } from './hooks.js';

const OTHERS = Array.from({ length: 20 }, (_, i) => `quiet${i + 1}`);
const t = useDatabase({ customers: { flood: 'cus_flood', ...Object.fromEntries(OTHERS.map((o) => [o, `cus_${o}`])) } });
afterEach(() => t.pool.query(`UPDATE outbox SET status = 'sent' WHERE status IN ('pending', 'claimed', 'dispatched')`));

/** 5,000 claimable rows of one tenant, then one row of each other tenant: theirs are the newest. */
async function flood(): Promise<void> {
  const run = randomUUID().slice(0, 8);
  await t.pool.query(
    `INSERT INTO outbox (tenant_id, event_name, quantity, occurred_at, idempotency_key, usage_id)
     SELECT 'flood', 'api_requests', 1, now(), $1 || ':flood:' || g, 'flood-' || g FROM generate_series(1, 5000) g`,
    [run],
  );
  await t.pool.query(
    `INSERT INTO outbox (tenant_id, event_name, quantity, occurred_at, idempotency_key, usage_id)
     SELECT o, 'api_requests', 1, now(), $2 || ':quiet:' || o, 'quiet' FROM unnest($1::text[]) o`,
    [OTHERS, run],
  );
  await t.pool.query('ANALYZE outbox');
}

/**
 * Every row the claim's scans of the outbox produced or threw away, over all their loops: EXPLAIN
 * ANALYZE of exactly what claimStatement sends, rolled back. `alias`: only the scans of the outbox
 * under that alias in the statement (`f`: the count of what each lane has in flight).
 */
async function rowsRead(opts: ClaimOptions, alias?: string): Promise<number> {
  let sent: { text: string; values: unknown[] } | undefined;
  const capture: Queryable = {
    query: ((text: string, values: unknown[]) => ((sent = { text, values }), Promise.resolve({ rows: [] }))) as unknown as Queryable['query'],
  };
  await claimStatement(capture, schemaFor(), opts);
  const client = await t.pool.connect();
  try {
    await client.query('BEGIN');
    const { rows } = await client.query(`EXPLAIN (ANALYZE, FORMAT JSON) ${sent!.text}`, sent!.values);
    await client.query('ROLLBACK');
    let read = 0;
    const walk = (node: Record<string, unknown>): void => {
      if (node['Relation Name'] === 'outbox' && (alias === undefined || node['Alias'] === alias)) {
        const loops = Number(node['Actual Loops'] ?? 1);
        read += (Number(node['Actual Rows'] ?? 0) + Number(node['Rows Removed by Filter'] ?? 0)) * loops;
      }
      for (const child of (node['Plans'] as Record<string, unknown>[] | undefined) ?? []) walk(child);
    };
    walk((rows[0]['QUERY PLAN'] as { Plan: Record<string, unknown> }[])[0]!.Plan);
    return read;
  } finally {
    client.release();
  }
}

const options = (laneMax: number): ClaimOptions => ({ limit: 50, claimedBy: 'r', claimId: randomUUID(), claimTimeoutMs: 60_000, laneMax });

describe('a fair claim', () => {
  for (const [mode, laneMax] of [['v1', CALL_LANE_MAX_IN_FLIGHT], ['v2', STREAM_LANE_MAX_IN_FLIGHT]] as const) {
    it(`${mode}, lanes of ${laneMax}: the first claim holds every other tenant's event, whatever one tenant's backlog`, async () => {
      await flood();
      const rows = (await claimBatch(t.pool, t.schema, options(laneMax))).rows;
      const tenants = rows.map((r) => r.tenant_id);
      expect(tenants.filter((x) => x !== 'flood').sort()).toEqual([...OTHERS].sort());
      // The flood takes what the others leave: its lane's room in v1, the rest of the batch in v2.
      expect(tenants.filter((x) => x === 'flood')).toHaveLength(Math.min(laneMax, 50 - OTHERS.length));
      // And its oldest rows, in order: fairness across tenants, oldest first within one.
      const floodKeys = rows.filter((r) => r.tenant_id === 'flood').map((r) => Number(r.idempotency_key.split(':')[2])).sort((a, b) => a - b);
      expect(floodKeys).toEqual(Array.from({ length: floodKeys.length }, (_, i) => i + 1));
    });
  }

  it('the flood tenant stays within its lane limit over claims after claims', async () => {
    await flood();
    const first = (await claimBatch(t.pool, t.schema, options(4))).rows;
    expect(first.filter((r) => r.tenant_id === 'flood')).toHaveLength(4);
    // Its four are still claimed: no room, and nothing else waits.
    expect((await claimBatch(t.pool, t.schema, options(4))).rows).toEqual([]);
  });

  it("tells the relay which lanes were quiet and which were held back (the lane window's signals)", async () => {
    await flood();
    const first = (await claimBatch(t.pool, t.schema, options(4))).rows;
    // The others: nothing in flight, nothing more waiting. The flood: nothing in flight yet, 4,996 more.
    for (const row of first) {
      expect(row.lane_in_flight).toBe(0);
      expect(row.lane_held).toBe(row.tenant_id === 'flood');
    }
    // Two of the flood's four finish, and one more event of a quiet tenant arrives.
    const done = first.filter((r) => r.tenant_id === 'flood').slice(0, 2).map((r) => r.id);
    await t.pool.query(`UPDATE outbox SET status = 'sent' WHERE id = ANY($1::bigint[])`, [done]);
    await t.pool.query(`INSERT INTO outbox (tenant_id, event_name, quantity, occurred_at, idempotency_key, usage_id) VALUES ('quiet1', 'api_requests', 1, now(), $1, $1)`, [randomUUID()]);
    const second = (await claimBatch(t.pool, t.schema, options(4))).rows;
    const byTenant = Object.fromEntries(['flood', 'quiet1'].map((x) => [x, second.filter((r) => r.tenant_id === x).map((r) => [r.lane_in_flight, r.lane_held])]));
    expect(byTenant).toEqual({ flood: [[2, true], [2, true]], quiet1: [[1, false]] });
    // The batch holds a lane back too: one row of a lane of two at a batch of one.
    await t.pool.query(`UPDATE outbox SET status = 'sent' WHERE status IN ('pending', 'claimed', 'dispatched')`);
    await t.pool.query(
      `INSERT INTO outbox (tenant_id, event_name, quantity, occurred_at, idempotency_key, usage_id) SELECT 'quiet2', 'api_requests', 1, now(), $1 || g, 'quiet-' || g FROM generate_series(1, 2) g`,
      [randomUUID()],
    );
    const one = (await claimBatch(t.pool, t.schema, { ...options(4), limit: 1 })).rows;
    expect(one.map((r) => [r.tenant_id, r.lane_in_flight, r.lane_held])).toEqual([['quiet2', 0, true]]);
    const last = (await claimBatch(t.pool, t.schema, { ...options(4), limit: 1 })).rows;
    expect(last.map((r) => [r.tenant_id, r.lane_in_flight, r.lane_held])).toEqual([['quiet2', 1, false]]);
  });

  it('leaves a paused lane alone (the lane window below its floor) and serves the others', async () => {
    await flood();
    const rows = (await claimBatch(t.pool, t.schema, { ...options(4), paused: [{ tenantId: 'flood', eventName: 'api_requests' }, { tenantId: 'quiet1', eventName: 'other_meter' }] })).rows;
    expect(rows.map((r) => r.tenant_id).sort()).toEqual([...OTHERS].sort());
    // Unpaused, it is claimed as before.
    expect(((await claimBatch(t.pool, t.schema, options(4))).rows).map((r) => r.tenant_id)).toEqual(['flood', 'flood', 'flood', 'flood']);
  });

  it('reads at most a batch of any lane: the plan of the statement the relay sends, run', async () => {
    await flood();
    // 21 lanes found, at most 50 rows of each read, 50 locked and updated: a few hundred, not 5,000,
    // even under the highest lane limit LANE_MAX_IN_FLIGHT accepts (10,000).
    expect(await rowsRead(options(10_000))).toBeLessThan(500);
  });

  it('reads a row or two of each lane when many tenants wait (their share of the batch), not a batch of each', async () => {
    // As after an outage: 300 tenants with 60 rows each, written interleaved.
    await t.addCustomers(Object.fromEntries(Array.from({ length: 300 }, (_, i) => [`many${i + 1}`, `cus_many${i + 1}`])));
    await t.pool.query(
      `INSERT INTO outbox (tenant_id, event_name, quantity, occurred_at, idempotency_key, usage_id)
       SELECT 'many' || m, 'api_requests', 1, now(), $1 || ':' || r || ':' || m, r || '-' || m
         FROM generate_series(1, 60) r, generate_series(1, 300) m ORDER BY r, m`,
      [randomUUID().slice(0, 8)],
    );
    await t.pool.query('ANALYZE outbox');
    for (const laneMax of [CALL_LANE_MAX_IN_FLIGHT, STREAM_LANE_MAX_IN_FLIGHT]) {
      // 300 lanes found, two rows of each read (the one taken and one to tell it held more), 50
      // locked and updated: about a thousand. A batch of each would be 300 × 51.
      expect(await rowsRead(options(laneMax))).toBeLessThan(1_500);
    }
    // Fifty tenants, each its oldest row, each lane holding more.
    const rows = (await claimBatch(t.pool, t.schema, options(STREAM_LANE_MAX_IN_FLIGHT))).rows;
    expect(new Set(rows.map((r) => r.tenant_id)).size).toBe(50);
    expect(rows.every((r) => r.idempotency_key.split(':')[1] === '1' && r.lane_held)).toBe(true);
  });

  it('counts what a full lane has in flight only up to its limit: lanes with more in flight than that cost the claim no more', async () => {
    const before = await rowsRead(options(CALL_LANE_MAX_IN_FLIGHT), 'f');
    // 200 tenants with 40 events in flight each (a lower LANE_MAX_IN_FLIGHT since, a bulk retry) and one waiting.
    await t.addCustomers(Object.fromEntries(Array.from({ length: 200 }, (_, i) => [`busy${i + 1}`, `cus_busy${i + 1}`])));
    await t.pool.query(
      `INSERT INTO outbox (tenant_id, event_name, quantity, occurred_at, idempotency_key, usage_id, status, dispatched_at)
       SELECT 'busy' || m, 'api_requests', 1, now(), $1 || ':' || r || ':' || m, r || '-' || m,
              CASE WHEN r <= 40 THEN 'dispatched' ELSE 'pending' END, CASE WHEN r <= 40 THEN now() END
         FROM generate_series(1, 41) r, generate_series(1, 200) m`,
      [randomUUID().slice(0, 8)],
    );
    await t.pool.query('ANALYZE outbox');
    // Each full lane's count reads 4 of its 40 rows in flight: 800 in all. Counting all 40 would be 8,000.
    expect((await rowsRead(options(CALL_LANE_MAX_IN_FLIGHT), 'f')) - before).toBeLessThanOrEqual(200 * CALL_LANE_MAX_IN_FLIGHT);
    // Full, they give nothing; the others' rows are claimed as before.
    expect(((await claimBatch(t.pool, t.schema, options(CALL_LANE_MAX_IN_FLIGHT))).rows).filter((r) => r.tenant_id.startsWith('busy'))).toEqual([]);
  });

  it("counts as waiting only the tenants with a row to claim: a lane wholly under a live lease leaves the others' share whole", async () => {
    await t.pool.query(`INSERT INTO outbox (tenant_id, event_name, quantity, occurred_at, idempotency_key, usage_id) VALUES ('quiet1', 'api_requests', 1, now(), $1, $1)`, [randomUUID()]);
    expect(((await claimBatch(t.pool, t.schema, { ...options(STREAM_LANE_MAX_IN_FLIGHT), limit: 1 })).rows).map((r) => r.tenant_id)).toEqual(['quiet1']);
    await t.pool.query(
      `INSERT INTO outbox (tenant_id, event_name, quantity, occurred_at, idempotency_key, usage_id)
       SELECT 'flood', 'api_requests', 1, now(), $1 || ':flood:' || g, 'flood-' || g FROM generate_series(1, 500) g`,
      [randomUUID().slice(0, 8)],
    );
    // quiet1's row is claimed (its lease runs): the flood is the only tenant waiting, and takes the batch.
    const rows = (await claimBatch(t.pool, t.schema, options(STREAM_LANE_MAX_IN_FLIGHT))).rows;
    expect(rows.map((r) => r.tenant_id)).toEqual(Array(50).fill('flood'));
  });

  it("takes every tenant's oldest row before any tenant's second when their rows are more than the batch", async () => {
    // Three rows of each tenant, written tenant by tenant: by id alone, or lane by lane, the first
    // seventeen tenants would fill the batch of 50.
    await t.pool.query(
      `INSERT INTO outbox (tenant_id, event_name, quantity, occurred_at, idempotency_key, usage_id)
       SELECT o, 'api_requests', 1, now(), $2 || ':' || o || ':' || r, 'three-' || r FROM unnest($1::text[]) o, generate_series(1, 3) r ORDER BY o, r`,
      [OTHERS, randomUUID().slice(0, 8)],
    );
    const rows = (await claimBatch(t.pool, t.schema, options(STREAM_LANE_MAX_IN_FLIGHT))).rows;
    expect(rows).toHaveLength(50);
    expect(new Set(rows.map((r) => r.tenant_id)).size).toBe(OTHERS.length);
  });

  /** `n` tenants `lane1`…`lane<n>` with `rows` claimable rows each, written interleaved. */
  async function lanes(n: number, rows: number): Promise<void> {
    await t.addCustomers(Object.fromEntries(Array.from({ length: n }, (_, i) => [`lane${i + 1}`, `cus_lane${i + 1}`])));
    await t.pool.query(
      `INSERT INTO outbox (tenant_id, event_name, quantity, occurred_at, idempotency_key, usage_id)
       SELECT 'lane' || m, 'api_requests', 1, now(), $3 || ':' || r || ':' || m, r || '-' || m
         FROM generate_series(1, $2::int) r, generate_series(1, $1::int) m ORDER BY r, m`,
      [n, rows, randomUUID().slice(0, 8)],
    );
    await t.pool.query('ANALYZE outbox');
  }

  it('looks at no more lanes than lanesPerClaim however many wait, and its claims, each after where the last stopped, go round every lane once', async () => {
    await lanes(300, 20);
    const opts = { ...options(CALL_LANE_MAX_IN_FLIGHT), lanesPerClaim: 40 };
    // 40 lanes found, a few rows of each read, 50 locked and updated: about 300. All 300 lanes would be over 900.
    expect(await rowsRead(opts)).toBeLessThan(400);
    const claimed: string[][] = [];
    let after: ClaimOptions['after'] = null;
    for (;;) {
      const claim = await claimBatch(t.pool, t.schema, { ...opts, claimId: randomUUID(), after });
      claimed.push([...new Set(claim.rows.map((r) => r.tenant_id))]);
      if (claim.next === null) break;
      after = claim.next;
    }
    // 40 lanes a claim, each in one claim only, until the lanes run out.
    expect(claimed.map((tenants) => tenants.length)).toEqual([40, 40, 40, 40, 40, 40, 40, 20]);
    expect(claimed.flat().sort()).toEqual(Array.from({ length: 300 }, (_, i) => `lane${i + 1}`).sort());
  });

  it('a batch that ends within the first turn: the next claim starts after the last lane given its turn, not again at the first lanes', async () => {
    await lanes(120, 2);
    const first = await claimBatch(t.pool, t.schema, options(STREAM_LANE_MAX_IN_FLIGHT));
    expect(new Set(first.rows.map((r) => r.tenant_id)).size).toBe(50);
    expect(first.next).not.toBeNull();
    const second = await claimBatch(t.pool, t.schema, { ...options(STREAM_LANE_MAX_IN_FLIGHT), after: first.next });
    // Fifty other tenants' oldest rows, not the first fifty's second rows.
    expect(second.rows.filter((r) => first.rows.some((f) => f.tenant_id === r.tenant_id))).toEqual([]);
    expect(new Set(second.rows.map((r) => r.tenant_id)).size).toBe(50);
    expect(second.rows.every((r) => r.idempotency_key.split(':')[1] === '1')).toBe(true);
    // The last twenty lanes, then their second rows: the lanes ran out, the next claim starts at the first.
    const third = await claimBatch(t.pool, t.schema, { ...options(STREAM_LANE_MAX_IN_FLIGHT), after: second.next });
    expect(new Set(third.rows.map((r) => r.tenant_id)).size).toBe(20);
    expect(third.next).toBeNull();
  });

  it('keeps to the lane index when the statistics say one tenant holds the whole outbox', async () => {
    await flood();
    // What ANALYZE concludes with 1,000,000 rows of one tenant and a few of others (its sample sees
    // one tenant): with the lane as equalities, the planner then read each lane from the primary
    // key in id order, through the flood, once per lane (bench/claim-plan.ts: 37 s per claim).
    await t.pool.query(`ALTER TABLE outbox ALTER COLUMN tenant_id SET (n_distinct = 1), ALTER COLUMN event_name SET (n_distinct = 1)`);
    try {
      await t.pool.query('ANALYZE outbox');
      for (const laneMax of [CALL_LANE_MAX_IN_FLIGHT, STREAM_LANE_MAX_IN_FLIGHT]) expect(await rowsRead(options(laneMax))).toBeLessThan(500);
    } finally {
      await t.pool.query(`ALTER TABLE outbox ALTER COLUMN tenant_id RESET (n_distinct), ALTER COLUMN event_name RESET (n_distinct)`);
      await t.pool.query('ANALYZE outbox');
    }
  });
});
