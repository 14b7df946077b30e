import { randomUUID } from 'node:crypto';
import { afterEach, describe, expect, it } from 'vitest';
import { claimBatch, claimStatement, markDispatched } from '../src/outbox/sql/relay.js';
import { planOf } from './helpers.js';
import { useDatabase, waitFor } from './hooks.js';
import { schemaFor } from '../src/outbox/sql/schema.js';

const t = useDatabase({ customers: { acme: 'cus_acme', globex: 'cus_globex' } });
const { row } = t;
// Each test starts with nothing claimable: what one leaves behind must not be claimed by the next.
afterEach(() => t.pool.query(`UPDATE outbox SET status = 'sent' WHERE status IN ('pending', 'claimed', 'dispatched')`));

/**
 * `n` claimable rows keyed `<prefix>1`…`<prefix>n`, written straight into the outbox: what the claim
 * reads is the row alone, and short opaque keys keep the expectations below readable (in the
 * tens of thousands, recordUsage one by one would also be slow).
 */
async function seed(n: number, prefix: string, tenant = 'acme'): Promise<void> {
  await t.pool.query(
    `INSERT INTO outbox (tenant_id, event_name, quantity, occurred_at, idempotency_key, usage_id)
     SELECT $3, 'api_requests', 1, now(), $2 || g, 'usage-' || g FROM generate_series(1, $1) g`,
    [n, prefix, tenant],
  );
}

describe('claiming outbox rows', () => {
  it('8 concurrent claimers over 1,000 rows claim each row exactly once', async () => {
    await seed(1000, 'claim-race:');
    const claimers = Array.from({ length: 8 }, (_, i) => `claimer-${i}`);
    const claimedBy = new Map<number, string[]>();
    await Promise.all(
      claimers.map(async (name) => {
        for (;;) {
          const rows = (await claimBatch(t.pool, t.schema, { limit: 37, claimedBy: name, claimId: randomUUID(), claimTimeoutMs: 60_000, laneMax: 1_000 })).rows;
          if (rows.length === 0) return;
          for (const r of rows) claimedBy.set(r.id, [...(claimedBy.get(r.id) ?? []), name]);
        }
      }),
    );
    expect(claimedBy.size).toBe(1000);
    const twice = [...claimedBy.entries()].filter(([, who]) => who.length > 1);
    expect(twice).toEqual([]);
    // More than one claimer got work: the claims really ran side by side.
    expect(new Set([...claimedBy.values()].map((w) => w[0])).size).toBeGreaterThan(1);
    const { rows } = await t.pool.query(`SELECT count(*)::int AS n FROM outbox WHERE idempotency_key LIKE 'claim-race:%' AND status = 'claimed'`);
    expect(rows[0].n).toBe(1000);
    await t.pool.query(`UPDATE outbox SET status = 'sent' WHERE idempotency_key LIKE 'claim-race:%'`);
  });

  it('claims oldest first and leaves dispatched, sent and dead rows alone', async () => {
    await seed(3, 'order:');
    await t.pool.query(`UPDATE outbox SET status = 'dead' WHERE idempotency_key = 'order:1'`);
    const rows = (await claimBatch(t.pool, t.schema, { limit: 10, claimedBy: 'x', claimId: randomUUID(), claimTimeoutMs: 60_000, laneMax: 1_000 })).rows;
    expect(rows.map((r) => r.idempotency_key)).toEqual(['order:2', 'order:3']);
    await t.pool.query(`UPDATE outbox SET status = 'sent' WHERE idempotency_key LIKE 'order:%' AND status <> 'dead'`);
  });

  it('gives a row back once its claim times out, and the old claim can no longer mark it', async () => {
    await seed(1, 'lease:');
    const first = randomUUID();
    const a = (await claimBatch(t.pool, t.schema, { limit: 10, claimedBy: 'crashed', claimId: first, claimTimeoutMs: 1000, laneMax: 1_000 })).rows;
    expect(a.map((r) => r.idempotency_key)).toEqual(['lease:1']);
    // Within the claim timeout: nobody else can take it.
    expect((await claimBatch(t.pool, t.schema, { limit: 10, claimedBy: 'other', claimId: randomUUID(), claimTimeoutMs: 1000, laneMax: 1_000 })).rows).toEqual([]);
    // Time driven, not slept: the claim's deadline is moved into the past, as the clock would.
    await t.pool.query(`UPDATE outbox SET processing_deadline = now() - interval '1 millisecond' WHERE idempotency_key = 'lease:1'`);
    const second = randomUUID();
    const b = (await claimBatch(t.pool, t.schema, { limit: 10, claimedBy: 'other', claimId: second, claimTimeoutMs: 60_000, laneMax: 1_000 })).rows;
    expect(b.map((r) => r.idempotency_key)).toEqual(['lease:1']);
    // The crashed claimer comes back late: its guarded update finds the row no longer its own.
    expect(await markDispatched(t.pool, t.schema, [a[0]!.id], first)).toBe(0);
    expect(await markDispatched(t.pool, t.schema, [b[0]!.id], second)).toBe(1);
    const { rows } = await t.pool.query(`SELECT status, claimed_by FROM outbox WHERE idempotency_key = 'lease:1'`);
    expect(rows[0]).toEqual({ status: 'dispatched', claimed_by: 'other' });
  });

  it('keeps the claim an index scan with many sent rows: the plan of the statement the relay sends', async () => {
    await t.pool.query(
      `INSERT INTO outbox (tenant_id, event_name, quantity, occurred_at, idempotency_key, usage_id, status)
       SELECT 'acme', 'api_requests', 1, now(), 'bulk-sent:' || g, 'bulk-sent-' || g, 'sent' FROM generate_series(1, 50000) g`,
    );
    // A live backlog: 20 lanes of 1,000 pending rows each, one of them with rows in flight.
    await t.addCustomers(Object.fromEntries(Array.from({ length: 20 }, (_, i) => [`plan-t${i + 1}`, `cus_plan_${i + 1}`])));
    await t.pool.query(
      `INSERT INTO outbox (tenant_id, event_name, quantity, occurred_at, idempotency_key, usage_id)
       SELECT 'plan-t' || (1 + g % 20), 'api_requests', 1, now(), 'plan:' || g, 'plan-' || g FROM generate_series(1, 20000) g`,
    );
    await t.pool.query(`UPDATE outbox SET status = 'dispatched' WHERE idempotency_key IN ('plan:20', 'plan:40')`);
    await t.pool.query('ANALYZE outbox');
    // Exactly what claimBatch sends, as PostgreSQL plans it.
    const plan = await planOf(t.pool, (capture) => claimStatement(capture, schemaFor(), { limit: 100, claimedBy: 'x', claimId: randomUUID(), claimTimeoutMs: 60_000, laneMax: 4 }));
    // Lanes found by a skip scan, each lane's room counted on its in-flight rows and its oldest rows
    // read from its own index range: nothing reads the sent rows, nor the whole backlog.
    expect(plan).toMatch(/Index Scan using outbox_lane_idx[^\n]*\n\s*Index Cond: \(ROW\(tenant_id, event_name\) > ROW/);
    expect(plan).toMatch(/Index Scan using outbox_in_flight_idx/);
    expect(plan).toMatch(/Index Scan using outbox_lane_idx on outbox \w+ [^\n]*\n\s*Index Cond: \(\(ROW\(tenant_id, event_name\) >= ROW/);
    // The outbox, that is: the deployment row (one row: are the relays paused?) is read whole.
    expect(plan).not.toMatch(/(Seq Scan|Bitmap Heap Scan) on outbox/);
  });

  it('never waits on rows another claimer holds: it skips them', async () => {
    await seed(4, 'skip:');
    const holder = await t.pool.connect();
    const claimer = await t.pool.connect();
    try {
      // Another relay's claim in progress: two of the rows locked, uncommitted.
      await holder.query('BEGIN');
      const locked = await holder.query<{ id: number }>(
        `SELECT id FROM outbox WHERE idempotency_key IN ('skip:1', 'skip:2') FOR UPDATE`,
      );
      expect(locked.rows).toHaveLength(2);
      // A claimer that would wait fails here instead of hanging: the lock timeout makes waiting an error.
      await claimer.query(`SET lock_timeout = '2s'`);
      const rows = (await claimBatch(claimer, schemaFor(), { limit: 10, claimedBy: 'second', claimId: randomUUID(), claimTimeoutMs: 60_000, laneMax: 1_000 })).rows;
      expect(rows.map((r) => r.idempotency_key).sort()).toEqual(['skip:3', 'skip:4']);
    } finally {
      await holder.query('ROLLBACK');
      await claimer.query('RESET lock_timeout');
      holder.release();
      claimer.release();
    }
    await t.pool.query(`UPDATE outbox SET status = 'sent' WHERE idempotency_key LIKE 'skip:%'`);
  });

  it('keeps at most laneMax of a lane claimed or dispatched, oldest first, while other lanes flow', async () => {
    await seed(10, 'hot:', 'acme');
    await seed(3, 'other:', 'globex');
    const claim = async () => (await claimBatch(t.pool, t.schema, { limit: 100, claimedBy: 'r', claimId: randomUUID(), claimTimeoutMs: 60_000, laneMax: 2 })).rows;
    const keys = (rows: { idempotency_key: string }[]) => rows.map((r) => r.idempotency_key).sort();
    const first = await claim();
    expect(keys(first)).toEqual(['hot:1', 'hot:2', 'other:1', 'other:2']);
    // hot:1 handed to its workflow: still in flight, so the hot lane has no room.
    await markDispatched(t.pool, t.schema, [first.find((r) => r.idempotency_key === 'hot:1')!.id], (await row('hot:1')).claim_id);
    expect(await claim()).toEqual([]);
    // hot:1 delivered: room for exactly one more, the oldest waiting.
    await t.pool.query(`UPDATE outbox SET status = 'sent' WHERE idempotency_key = 'hot:1'`);
    expect(keys(await claim())).toEqual(['hot:3']);
    // A dead letter is not in flight.
    await t.pool.query(`UPDATE outbox SET status = 'dead' WHERE idempotency_key = 'hot:2'`);
    expect(keys(await claim())).toEqual(['hot:4']);
  });

  it('the guarded update: a claim whose snapshot predates the commit of another claim takes none of its rows', async () => {
    // Claims are serialized by an advisory lock (claimBatch), so this race needs the statement
    // alone: a slow claimer (index scans off, hundreds of thousands of delivered rows to read) has
    // its snapshot the moment its statement starts, and reaches the row locks (after its whole scan
    // and sort) long after a fast claimer took the same rows and committed. The lock it then gets is
    // on rows already claimed: only the UPDATE's "still claimable" condition stops it from claiming
    // them a second time. On a loaded machine the fast claim can outlast the slow scan (the slow
    // claim then skips rows still locked, which proves nothing): the race is run again on more rows.
    let raced = false;
    try {
      for (let round = 1; round <= 3 && !raced; round++) {
        await t.pool.query(
          `INSERT INTO outbox (tenant_id, event_name, quantity, occurred_at, idempotency_key, usage_id, status, sent_at)
           SELECT 'globex', 'api_requests', 1, now(), 'guard-bulk:' || $1::int || ':' || g, $1::int || '-' || g, 'sent', now() FROM generate_series(1, 200000) g`,
          [round],
        );
        await t.pool.query(`DELETE FROM outbox WHERE idempotency_key LIKE 'guard:%'`);
        await seed(20, 'guard:', 'globex');
        const slow = await t.pool.connect();
        try {
          await slow.query(`BEGIN; SET LOCAL enable_indexscan = off; SET LOCAL enable_bitmapscan = off; SET LOCAL enable_indexonlyscan = off`);
          const { rows: me } = await slow.query<{ pid: number }>('SELECT pg_backend_pid() AS pid');
          const slowActive = async () => (await t.pool.query(`SELECT 1 FROM pg_stat_activity WHERE pid = $1 AND state = 'active' AND backend_xmin IS NOT NULL`, [me[0]!.pid])).rows.length > 0;
          const slowClaim = claimStatement(slow, schemaFor(), { limit: 100, claimedBy: 'slow', claimId: randomUUID(), claimTimeoutMs: 60_000, laneMax: 1_000 });
          // Its statement is running: its snapshot is taken (backend_xmin set), its scans under way.
          await waitFor('the slow claim to be running', slowActive, 10_000, 1);
          const fast = (await claimBatch(t.pool, t.schema, { limit: 100, claimedBy: 'fast', claimId: randomUUID(), claimTimeoutMs: 60_000, laneMax: 1_000 })).rows;
          raced = await slowActive();
          const slowRows = await slowClaim;
          await slow.query('COMMIT');
          expect(fast.map((r) => r.idempotency_key).sort()).toEqual(Array.from({ length: 20 }, (_, i) => `guard:${i + 1}`).sort());
          expect(slowRows.rows).toEqual([]);
          const { rows } = await t.pool.query(`SELECT DISTINCT claimed_by FROM outbox WHERE idempotency_key LIKE 'guard:%'`);
          expect(rows).toEqual([{ claimed_by: 'fast' }]);
        } finally {
          slow.release();
        }
      }
      expect(raced, 'the slow claim still scanning when the fast one committed').toBe(true);
    } finally {
      await t.pool.query(`DELETE FROM outbox WHERE idempotency_key LIKE 'guard-bulk:%'`);
    }
  });

  it('holds the lane limit when many claimers race: together they never exceed it', async () => {
    await seed(500, 'race-lane:', 'acme');
    const claimed = await Promise.all(
      Array.from({ length: 8 }, (_, i) => claimBatch(t.pool, t.schema, { limit: 50, claimedBy: `c${i}`, claimId: randomUUID(), claimTimeoutMs: 60_000, laneMax: 3 })),
    );
    expect(claimed.flatMap((c) => c.rows).map((r) => r.idempotency_key).sort()).toEqual(['race-lane:1', 'race-lane:2', 'race-lane:3']);
  });
});
