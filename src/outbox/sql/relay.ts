/**
 * The relay's statements: claim a batch of outbox rows under a lease, and hand them to Temporal.
 * One named function per statement; values always travel as typed parameters, never as SQL text.
 */
import type pg from 'pg';
import { answeredWithin, BEGIN_SHORT, connectionLost, releaseAfter, type Queryable } from '../../db.js';
import { TemporalErrorCodes } from '../../../workflows/shared.js';
import { AWAITING_RELAY, IN_FLIGHT } from '../statuses.js';
import type { Lane } from '../lane-window.js';
import type { Schema } from './schema.js';

export interface ClaimedRow {
  id: number;
  idempotency_key: string;
  tenant_id: string;
  /** For the workflow's summary in the Web UI. */
  event_name: string;
  quantity: string;
  occurred_at: Date;
  /** The W3C traceparent the row was recorded under (src/tracing.ts), or null. */
  trace_parent: string | null;
  /** What the row's lane had in flight (claimed or dispatched) before this claim. */
  lane_in_flight: number;
  /** Whether the row's lane had more claimable rows than its room, or its tenant's share of the batch, let this claim take. */
  lane_held: boolean;
}

/**
 * Claims serialise on this advisory lock for the milliseconds of the claim statement (see below):
 * its first key; the second is the schema's (`Schema.claimLockKey`), so that two deployments in one
 * database never wait on each other's claims.
 */
const CLAIM_LOCK = 727_274_002;

/**
 * Claims up to `limit` rows for one relay, serving tenants in turn: each tenant's oldest claimable
 * row first, then each tenant's second oldest, and so on (within a turn, in lane order). At most
 * `laneMax` of a lane (tenant, event name) are claimed or dispatched at once, counting what the
 * lane already has in flight: the rest of its backlog waits here, where tenants take turns, and not
 * in Temporal, whose queues and CPU every tenant shares.
 *
 * A claim looks at no more than `lanesPerClaim` lanes with claimable rows (LANES_PER_CLAIM), in
 * lane order, starting after the lane where the process's last claim stopped (`after`; it answers
 * where it stopped as `next`): its cost is bounded by that, not by how many lanes wait, and the
 * claims go round every lane waiting. Within a turn, lanes are served in that order, so a batch
 * that runs out within the first turn stops at a lane and the next claim starts after it.
 *
 * The bound: whatever the backlog of any other tenant, a tenant's oldest claimable row is in one of
 * the next two claims of a relay (the rest of a round, then the next from the first lane) whenever
 * at most `limit` tenants and `lanesPerClaim` lanes have claimable rows (one turn each fits in the
 * batch). A flood of one tenant costs everyone else at most a claim or two's wait, not its backlog.
 * With more waiting, tenants take their turns round the lanes, a batch of turns per claim: a
 * tenant's new event waits for the round to reach its lane (at most one turn of each other lane
 * waiting), not behind another tenant's backlog.
 *
 * Design: one statement. A recursive skip scan over `outbox_lane_idx` lists the lanes that have
 * claimable rows (one index probe per lane, whatever their backlog); for each, what it has in
 * flight is counted on `outbox_in_flight_idx`, and its oldest claimable rows are read from
 * `outbox_lane_idx` up to what the lane can give this claim: its room, and its tenant's share of
 * the batch (`limit` less one row for each other tenant waiting, since each of them has a turn
 * before this tenant's second; at least one). Those rows are numbered per tenant (its turn), and
 * the first `limit` by (turn, id) are locked with `FOR UPDATE SKIP LOCKED` (rows another
 * transaction holds are skipped, never waited for) and taken by an `UPDATE … RETURNING` guarded by
 * the same "still claimable" condition, so a row is only ever taken while pending or after its
 * previous claim timed out. The cost is three index probes per lane looked at (found, its
 * in-flight count, its rows) and at most (`limit` / 2 + 1)² rows read in all with one lane per
 * tenant (T tenants waiting give at most `limit` − T + 2 rows each): never the depth of a backlog,
 * nor the number of lanes waiting, nor the millions of sent rows (test/fairness.test.ts checks the
 * rows this very statement reads; bench/claim-plan.ts measures it with one tenant's 1,000,000 rows
 * pending, with 2,000 tenants waiting and with 100,000; docs/performance.md has the figures).
 *
 * The lane limit needs one view of every claim: two relays counting a lane's room at the same
 * time would both fill it. So the statement runs under a transaction-scoped advisory lock, taken
 * before the statement's snapshot; claims wait on each other for the claim itself (milliseconds),
 * never for the workflow starts that follow it.
 *
 * Tried, with `npx tsx bench/claim-plan.ts` (1,000,000 pending rows of one tenant, then one row
 * each of 50 others; batch 100; EXPLAIN ANALYZE, docs/performance.md):
 * - Before: each lane's rows up to its room (1,000,000 for the stream), the oldest `limit` of all,
 *   and the lane written as equalities. v2: the batch was the flood's 100 oldest rows (0 of the 50
 *   others), 1,000,050 rows read, 1.0 M buffers, 46.6 s under the claim lock. v1 was fair but took
 *   37.2 s too: the planner read each lane from the primary key in id order, filtering by lane.
 * - Turns per tenant, each lane read up to min(room, `limit`), the lane as a range of the lane
 *   index: 150 rows read, 2,000–3,500 buffers hit, 3.7 ms in either mode, the 50 others all in the
 *   first batch. But with 2,000 tenants waiting (150 rows each, as after an outage), v2 read
 *   204,301 rows, 576 ms under the claim lock; v1 12,301 rows, 115 ms.
 * - Each lane read up to its tenant's share of the batch as well, and only lanes with a claimable
 *   row counted as waiting (the skip scan skips lanes whose rows are all under a live lease, which
 *   would shrink the share and leave the batch short): 6,301 rows, 93 ms (v2) and 75 ms (v1) with
 *   2,000 tenants; the flood's figures unchanged. Chosen. A separate probe for each lane's oldest
 *   claimable row, to count the tenants waiting, cost 2,000 probes more (v1 176 ms).
 * - Every lane waiting looked at, tenants beyond `limit` taken by the age of their oldest rows:
 *   100,000 lanes waiting (3 rows each) cost 1,006 ms per claim under the claim lock, 300,301 rows
 *   read, and a slower disk or more lanes passed the 5-s answer time, when no claim succeeds again.
 *   At most LANES_PER_CLAIM lanes from where the last claim stopped: 16.7 ms, 3,300 rows. Chosen;
 *   the place is kept in the process (a restart starts from the first lane), not written per claim.
 * Rejected: a plain oldest-first claim (it dispatches a hot customer's whole backlog as workflows
 * polling one lease); lane by lane in the application (a round trip per lane);
 * `DISTINCT ON (tenant, event)` over the backlog (reads every pending row each claim); a counter
 * table per lane maintained on enqueue (a second write on the request path). No new index: `outbox_lane_idx` (tenant_id, event_name, id) is already the per-tenant
 * order; an index led by the tenant over every row draws the skip scan onto the sent history.
 */
export async function claimBatch(
  db: pg.Pool | pg.PoolClient,
  schema: Schema,
  opts: ClaimOptions,
): Promise<Claim> {
  const client = 'release' in db ? db : await db.connect();
  // Each statement takes milliseconds (the lock: another relay's claim): one unanswered past
  // `answerMs` is a connection gone silent, dropped with the error.
  const q = opts.answerMs === undefined ? client : answeredWithin(client, opts.answerMs);
  let failed: unknown;
  try {
    try {
      await beginClaim(q, schema);
      const claim = await claimStatement(q, schema, opts);
      await q.query('COMMIT');
      return claim;
    } catch (err) {
      failed = err;
      if (!connectionLost(err)) await q.query('ROLLBACK').catch(() => undefined);
      throw err;
    }
  } finally {
    if (client !== db) releaseAfter(client as pg.PoolClient, failed);
  }
}

/**
 * Opens a claim's transaction and takes the schema's claim lock. One round trip (constants, so no
 * parameter is needed). A claim lost in a crash of PostgreSQL only puts its rows back to pending
 * (their workflows, if started, refuse a second start): no need to wait for the WAL flush. Ended
 * by PostgreSQL if its connection goes silent before COMMIT (BEGIN_SHORT): the lock would
 * otherwise stop every relay of the schema for as long as the dead session lived.
 */
export async function beginClaim(q: Queryable, schema: Schema): Promise<void> {
  await q.query(`${BEGIN_SHORT}; SET LOCAL synchronous_commit = off; SELECT pg_advisory_xact_lock(${CLAIM_LOCK}, ${schema.claimLockKey})`);
}

export interface ClaimOptions {
  limit: number;
  claimedBy: string;
  claimId: string;
  claimTimeoutMs: number;
  /** LANE_MAX_IN_FLIGHT, or the lane window below it: a lane's events claimed or dispatched at once. */
  laneMax: number;
  /** Lanes this claim leaves alone (the lane window's pause). */
  paused?: Lane[];
  /** Each statement of the claim unanswered this long fails as PostgreSQL away (answeredWithin). */
  answerMs?: number;
  /** The lane this relay's last claim stopped at (`Claim.next`): this one looks at the lanes after it. */
  after?: Lane | null;
  /** The most lanes one claim looks at (LANES_PER_CLAIM). */
  lanesPerClaim?: number;
}

/** A claim's rows, and the lane the relay's next claim looks after (null: from the first lane). */
export interface Claim {
  rows: ClaimedRow[];
  next: Lane | null;
}

type Nullable<T> = { [K in keyof T]: T[K] | null };

/**
 * The most lanes with claimable rows one claim looks at: what bounds its cost (three index probes
 * each) whatever the number of lanes waiting. 100,000 lanes waiting cost about a second per claim
 * when a claim looked at them all (bench/claim-plan.ts).
 */
export const LANES_PER_CLAIM = 1_000;

/**
 * Whether outbox row `row` (an alias) counts against its lane's room: in flight (IN_FLIGHT, passed
 * as `statuses`), dispatched, or claimed under a live lease. The claim counts a lane's room so;
 * a bulk retry too (./operator.ts laneInFlight).
 */
export function inFlightNow(row: string, statuses: string): string {
  return `${row}.status = ANY(${statuses}) AND (${row}.status = 'dispatched' OR ${row}.processing_deadline >= now())`;
}

/** The claim statement itself (exported for the plan test, which EXPLAINs what this sends). */
export async function claimStatement(db: Queryable, schema: Schema, opts: ClaimOptions): Promise<Claim> {
  const { rows } = await db.query<Nullable<ClaimedRow> & { next_tenant_id: string | null; next_event_name: string | null }>(
    `WITH RECURSIVE lanes AS (
       -- The lanes with a claimable row (pending, or claimed under a lease that has run out) after
       -- the lane this relay's last claim stopped at ($10, $11; '' before every lane), in lane
       -- order, numbered (n), at most $12 of them.
       -- None while an operator has paused the relays (pauseRelays).
       (SELECT o.tenant_id, o.event_name, 1 AS n FROM ${schema.outbox} o
         WHERE o.status = ANY($5::text[]) AND (o.tenant_id, o.event_name) > ($10::text, $11::text)
           AND (o.status = 'pending' OR o.processing_deadline < now())
           AND NOT EXISTS (SELECT 1 FROM ${schema.deployment} d WHERE d.relays_paused_at IS NOT NULL)
         ORDER BY o.tenant_id, o.event_name LIMIT 1)
       UNION ALL
       SELECT nxt.tenant_id, nxt.event_name, l.n + 1
         FROM lanes l, LATERAL (
           SELECT o.tenant_id, o.event_name FROM ${schema.outbox} o
            WHERE o.status = ANY($5::text[]) AND (o.tenant_id, o.event_name) > (l.tenant_id, l.event_name)
              AND (o.status = 'pending' OR o.processing_deadline < now())
            ORDER BY o.tenant_id, o.event_name LIMIT 1) nxt
        WHERE l.n < $12::int
     ), room AS (
       -- What the lane has in flight is counted on outbox_in_flight_idx, up to laneMax rows: a
       -- lane with more (a lower LANE_MAX_IN_FLIGHT since, a bulk retry) is full all the same.
       -- A lane the relay has paused ($8, $9: the lane window below its floor) has no room now.
       SELECT l.tenant_id, l.event_name, l.n, n.in_flight,
              CASE WHEN (l.tenant_id, l.event_name) IN (SELECT * FROM unnest($8::text[], $9::text[])) THEN 0
                   ELSE $6::int - n.in_flight END AS free
         FROM lanes l, LATERAL (
           SELECT count(*)::int AS in_flight FROM (
             SELECT 1 FROM ${schema.outbox} f
              WHERE f.tenant_id = l.tenant_id AND f.event_name = l.event_name
                AND ${inFlightNow('f', '$7::text[]')}
              LIMIT $6::int) counted) n
     ), share AS (
       -- The most one tenant can have in this batch: each other tenant waiting has a row before its
       -- second (turns, below). A lane's rows beyond that are not read: with many tenants waiting,
       -- a row or two of each.
       SELECT greatest(1, $1::int - count(DISTINCT r.tenant_id)::int + 1) AS n FROM room r WHERE r.free > 0
     ), candidates AS (
       -- One row past what the lane can give (its room, its share) is read, to tell a lane that had
       -- more (held back: a backlog) from one whose rows were all taken; that row is not claimed.
       SELECT c.id, r.tenant_id, r.n AS lane_n, r.in_flight, least(r.free, s.n) AS take,
              row_number() OVER (PARTITION BY r.tenant_id, r.event_name ORDER BY c.id) AS nth,
              count(*) OVER (PARTITION BY r.tenant_id, r.event_name) > least(r.free, s.n) AS lane_held
         FROM room r CROSS JOIN share s, LATERAL (
         SELECT o.id FROM ${schema.outbox} o
          -- The lane as a range of the lane index, not as equalities: with "tenant_id = …" the
          -- planner may take the primary key for the order (id) and filter by lane, and with one
          -- tenant holding most of the backlog it did, walking that backlog once per lane (37 s
          -- with 1,000,000 pending, bench/claim-plan.ts). A range keeps the lane index's order.
          WHERE (o.tenant_id, o.event_name) >= (r.tenant_id, r.event_name)
            AND (o.tenant_id, o.event_name) <= (r.tenant_id, r.event_name)
            AND o.status = ANY($5::text[]) AND (o.status = 'pending' OR o.processing_deadline < now())
          ORDER BY o.tenant_id, o.event_name, o.id LIMIT least(r.free, s.n) + 1) c
        WHERE r.free > 0
     ), ranked AS (
       SELECT c.id, c.lane_n, c.in_flight, c.lane_held, row_number() OVER (PARTITION BY c.tenant_id ORDER BY c.id) AS turn
         FROM candidates c WHERE c.nth <= c.take
     ), turns AS (
       -- Tenants in turn: every tenant's oldest row before any tenant's second; within a turn, in
       -- lane order from where the last claim stopped.
       SELECT r.id, r.lane_n, r.turn, r.in_flight, r.lane_held FROM ranked r ORDER BY r.turn, r.lane_n, r.id LIMIT $1::int
     ), stop AS (
       -- Where this relay's next claim starts looking: after the last lane given its first turn
       -- when the batch ran out within the first turn; else after the last lane looked at, or from
       -- the start when the lanes ran out before $12.
       SELECT CASE WHEN (SELECT count(*) FROM ranked WHERE turn = 1) > $1::int THEN (SELECT max(lane_n) FROM turns WHERE turn = 1)
                   WHEN (SELECT count(*) FROM lanes) >= $12::int THEN $12::int END AS n
     ), next_lane AS (
       SELECT l.tenant_id AS next_tenant_id, l.event_name AS next_event_name FROM stop s LEFT JOIN lanes l ON l.n = s.n
     ), locked AS (
       SELECT o.id, t.in_flight, t.lane_held FROM ${schema.outbox} o JOIN turns t ON t.id = o.id
        ORDER BY o.id FOR UPDATE OF o SKIP LOCKED
     ), taken AS (
       UPDATE ${schema.outbox} o
          SET status = 'claimed', claimed_by = $2::text, claim_id = $3::uuid,
              processing_deadline = clock_timestamp() + $4::int * interval '1 millisecond', updated_at = now()
         FROM locked k
        WHERE o.id = k.id
          AND (o.status = 'pending' OR (o.status = 'claimed' AND o.processing_deadline < now()))
       RETURNING o.id, o.idempotency_key, o.tenant_id, o.event_name, o.quantity::text, o.occurred_at, o.trace_parent,
                 k.in_flight AS lane_in_flight, k.lane_held
     )
     -- The rows taken, each with where the next claim starts; one row of nulls and that when none was.
     SELECT t.*, nl.next_tenant_id, nl.next_event_name FROM next_lane nl LEFT JOIN taken t ON true`,
    [
      opts.limit,
      opts.claimedBy,
      opts.claimId,
      opts.claimTimeoutMs,
      [...AWAITING_RELAY],
      opts.laneMax,
      [...IN_FLIGHT],
      (opts.paused ?? []).map((l) => l.tenantId),
      (opts.paused ?? []).map((l) => l.eventName),
      opts.after?.tenantId ?? '',
      opts.after?.eventName ?? '',
      opts.lanesPerClaim ?? LANES_PER_CLAIM,
    ],
  );
  const first = rows[0];
  return {
    rows: rows.filter((r): r is ClaimedRow & typeof r => r.id !== null).map(({ next_tenant_id: _t, next_event_name: _e, ...row }) => row),
    next: first?.next_tenant_id != null && first.next_event_name != null ? { tenantId: first.next_tenant_id, eventName: first.next_event_name } : null,
  };
}

/**
 * Marks rows dispatched, only while they are still held by this claim. Returns how many were. An
 * earlier failed start's note (recordStartFailure) goes: the start has now succeeded.
 */
export async function markDispatched(db: Queryable, schema: Schema, ids: number[], claimId: string): Promise<number> {
  if (ids.length === 0) return 0;
  const result = await db.query(
    `UPDATE ${schema.outbox}
        SET status = 'dispatched', dispatched_at = now(), workflow_id = idempotency_key,
            claim_id = NULL, processing_deadline = NULL, updated_at = now(),
            last_error_message = CASE WHEN last_error_code = $3::text THEN NULL ELSE last_error_message END,
            last_error_code = NULLIF(last_error_code, $3::text)
      WHERE id = ANY($1::bigint[]) AND status = 'claimed' AND claim_id = $2::uuid`,
    [ids, claimId, TemporalErrorCodes.startFailing],
  );
  return result.rowCount ?? 0;
}

/**
 * A claimed row that no run will ever deliver (Temporal refused its start for good, or its run has
 * closed): a dead letter with the reason, so that it leaves its lane and an operator sees it and
 * can `retry` it once the cause is fixed. Guarded by the claim, as markDispatched is. Wakes the
 * relays: the lane has room again.
 */
export async function markClaimDead(db: Queryable, schema: Schema, id: number, claimId: string, code: string, message: string): Promise<boolean> {
  const { rows } = await db.query(
    `WITH dead AS (
       UPDATE ${schema.outbox}
          SET status = 'dead', dead_at = now(), last_error_code = $3::text, last_error_message = $4::text,
              claim_id = NULL, processing_deadline = NULL, updated_at = now()
        WHERE id = $1::bigint AND claim_id = $2::uuid AND status = 'claimed'
        RETURNING id
     )
     SELECT pg_notify($5::text, '') FROM dead`,
    [id, claimId, code, message.slice(0, 1000), schema.outboxChannel],
  );
  return rows.length > 0;
}

/**
 * A claimed row whose start failed for a reason that may pass: it stays claimed and says why on the
 * row, so `status` counts it and `inspect` shows it; its claim now lapses `retryInMs` from now (or
 * sooner, if it was to), and a relay tries again then. Cleared when a start succeeds
 * (markDispatched).
 */
export async function recordStartFailure(db: Queryable, schema: Schema, id: number, claimId: string, code: string, message: string, retryInMs: number): Promise<void> {
  await db.query(
    `UPDATE ${schema.outbox}
        SET last_error_code = $3::text, last_error_message = $4::text, updated_at = now(),
            processing_deadline = least(processing_deadline, clock_timestamp() + $5::int * interval '1 millisecond')
      WHERE id = $1::bigint AND claim_id = $2::uuid AND status = 'claimed'`,
    [id, claimId, code, message.slice(0, 1000), retryInMs],
  );
}

export interface RelaysPaused {
  at: Date;
  by: string;
  reason: string;
}

/**
 * Pauses every relay of the schema, recorded in operator_actions: from their next claim (each
 * looks at this flag, in its statement) they take nothing. New events wait as pending; those
 * already handed to Temporal go on to Stripe. Answers when they were paused (an earlier pause is
 * kept, with its reason).
 */
export async function pauseRelays(db: Queryable, schema: Schema, by: string, reason: string): Promise<RelaysPaused> {
  const { rows } = await db.query<{ at: Date; by: string; reason: string }>(
    `WITH paused AS (
       UPDATE ${schema.deployment}
          SET relays_paused_at = COALESCE(relays_paused_at, now()), relays_paused_by = COALESCE(relays_paused_by, $1::text),
              relays_paused_reason = COALESCE(relays_paused_reason, $2::text)
       RETURNING relays_paused_at AS at, relays_paused_by AS by, relays_paused_reason AS reason
     ), audit AS (
       INSERT INTO ${schema.operatorActions} (actor, action, forced, outcome, detail) VALUES ($1::text, 'relays.pause', false, 'paused', $2::text)
     )
     SELECT * FROM paused`,
    [by.slice(0, 200), reason.slice(0, 2000)],
  );
  return rows[0]!;
}

/** Resumes the relays paused by pauseRelays, recorded, and wakes them; answers whether they were paused. */
export async function resumeRelays(db: Queryable, schema: Schema, by: string): Promise<boolean> {
  const { rows } = await db.query<{ was: boolean }>(
    `WITH before AS (SELECT relays_paused_at IS NOT NULL AS was FROM ${schema.deployment} FOR UPDATE),
     resumed AS (
       UPDATE ${schema.deployment} SET relays_paused_at = NULL, relays_paused_by = NULL, relays_paused_reason = NULL RETURNING 1
     ), audit AS (
       INSERT INTO ${schema.operatorActions} (actor, action, forced, outcome, detail)
       SELECT $1::text, 'relays.resume', false, CASE WHEN b.was THEN 'resumed' ELSE 'unchanged' END, NULL FROM before b
     )
     SELECT b.was, pg_notify($2::text, '') FROM before b, resumed`,
    [by.slice(0, 200), schema.outboxChannel],
  );
  return rows[0]?.was ?? false;
}

/** Whether an operator has paused the relays: when, by whom, why; null when not. */
export async function relaysPaused(db: Queryable, schema: Schema): Promise<RelaysPaused | null> {
  const { rows } = await db.query<{ at: Date | null; by: string | null; reason: string | null }>(
    `SELECT relays_paused_at AS at, relays_paused_by AS by, relays_paused_reason AS reason FROM ${schema.deployment}`,
  );
  const r = rows[0];
  return r?.at ? { at: r.at, by: r.by ?? '', reason: r.reason ?? '' } : null;
}
