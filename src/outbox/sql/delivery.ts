/**
 * The usage workflow's bookkeeping: one attempt begun, the row sent, dead, or back in flight.
 * One named function per statement; values always travel as typed parameters, never as SQL text.
 */
import type { Queryable } from '../../db.js';
import { AT_STRIPE, DELIVERED, UNBILLED, type OutboxStatus } from '../statuses.js';
import type { EntryRow } from './enqueue.js';
import type { HandOff } from './lease.js';
import { stripeIdentifierFor } from '../keys.js';
import { attemptCustomer } from './customers.js';
import type { Schema } from './schema.js';

export interface AttemptRow {
  status: OutboxStatus;
  attempt_count: number;
  event_name: string;
  quantity: number;
  occurred_at: Date;
  first_attempted_at: Date;
  /** The customer this attempt names (the tenant's mapping now); for a row already at Stripe, the one it was billed to. */
  stripe_customer_id: string | null;
  /** When the row was committed: the start of the commit-to-acknowledgement latency. */
  created_at: Date;
  /** When the row was last put in flight (by a relay, an operator's retry, a rebill). */
  dispatched_at: Date | null;
  /**
   * The meter-event identifier this attempt sends (src/outbox/keys.ts `stripeIdentifierFor`): the
   * one stored on the row, fixed at its first attempt or by a rebill; the key when none is stored.
   */
  identifier: string;
  /**
   * The identifier's revision (0 until a rebill): the attempt marks the row delivered only while
   * it is still the row's (`markDelivered`, `markSentAndHandOff`).
   */
  identifier_revision: number;
}

/**
 * Starts one delivery attempt: counts it (unless the row is already sent), stamps the first
 * attempt time, and reads what to send, in one statement. No row when the row is missing or when
 * its first attempt is older than `safeWindowMs` and `force` is off: resending then could be
 * billed twice, so it is not even counted as an attempt. A forced attempt past the window stamps
 * itself as the first of a new one.
 *
 * With `lease`, the attempt also extends that holder's (customer, meter) lease to cover the call,
 * and begins only if the holder still has it (`leaseHeld`): a lease handed over briefly
 * (./lease.ts `handOffLease`) or one that lapsed is never called on. The lease must also be the
 * pair the call is made with (the customer is read by this same statement): a lease of the
 * customer the tenant was mapped to before a remap is not held for this call.
 */
export async function beginAttempt(
  db: Queryable,
  schema: Schema,
  key: string,
  opts: {
    workflowId: string;
    safeWindowMs: number;
    force: boolean;
    lease?: { holder: string; leaseMs: number };
    /** STRIPE_IDENTIFIER_NAMESPACE ('' or absent: none). */
    identifierNamespace?: string;
  },
): Promise<{ leaseHeld: boolean; row: AttemptRow | undefined }> {
  const { rows } = await db.query<AttemptRow & { lease_held: boolean; found: boolean }>({
    // Named: prepared once per connection, parsed and planned once, not on every event.
    name: schema.statementName('begin-attempt'),
    text: `WITH extended AS (
       UPDATE ${schema.meterLeases} l SET expires_at = clock_timestamp() + $7::int * interval '1 millisecond'
        WHERE l.holder = $6::text AND l.expires_at > clock_timestamp()
          -- Only the lease of the pair this attempt calls with: the row's meter and the customer it
          -- names (attemptCustomer), read below in the same snapshot. A tenant remapped since the
          -- lease was taken leaves it on the old customer: the attempt queues again for the new pair.
          AND EXISTS (SELECT 1 FROM ${schema.outbox} lo
                       WHERE lo.idempotency_key = $1::text AND lo.event_name = l.event_name
                         AND ${attemptCustomer(schema, 'lo')} = l.stripe_customer_id)
       RETURNING 1
     ), attempt AS (
       UPDATE ${schema.outbox} o
          SET attempt_count = o.attempt_count + CASE WHEN o.status = ANY($5::text[]) THEN 0 ELSE 1 END,
              -- A forced attempt past the window starts a new one: Stripe dedups the attempts that
              -- follow against this call, so they need no force (the operator reconciled first).
              first_attempted_at = CASE
                WHEN $4::boolean AND o.first_attempted_at <= now() - $3::bigint * interval '1 millisecond' THEN now()
                ELSE COALESCE(o.first_attempted_at, now()) END,
              workflow_id = COALESCE(o.workflow_id, $2::text),
              -- The identifier is fixed by the first attempt (or a rebill) and never changes after:
              -- a row first attempted under its key (NULL, first_attempted_at set: no namespace
              -- then) stays so, whatever the namespace is now. $8: NULL when it is the key.
              stripe_identifier = COALESCE(o.stripe_identifier, CASE WHEN o.first_attempted_at IS NULL THEN $8::text END),
              -- The customer this attempt names (attemptCustomer; reconciliation compares the row
              -- with it); a row already at Stripe keeps the one it was billed to.
              billed_customer_id = CASE WHEN o.status = ANY($5::text[]) THEN o.billed_customer_id
                ELSE ${attemptCustomer(schema, 'o')} END,
              updated_at = now()
        WHERE o.idempotency_key = $1::text
          AND ($6::text IS NULL OR EXISTS (SELECT 1 FROM extended))
          AND (o.status = ANY($5::text[]) OR $4::boolean OR o.first_attempted_at IS NULL
               OR o.first_attempted_at > now() - $3::bigint * interval '1 millisecond')
        RETURNING o.status, o.attempt_count, o.event_name, o.quantity, o.occurred_at, o.first_attempted_at, o.dispatched_at, o.created_at,
                  COALESCE(o.stripe_identifier, o.idempotency_key) AS identifier, o.identifier_revision,
                  o.billed_customer_id AS stripe_customer_id
     )
     SELECT ($6::text IS NULL OR EXISTS (SELECT 1 FROM extended)) AS lease_held, a.status IS NOT NULL AS found, a.*,
            -- Bookkeeping only (the attempt count, the first attempt's time, the lease), on the
            -- path of every call: the commit does not wait for the WAL flush. A crash of PostgreSQL
            -- can lose the last fraction of a second of it, which at worst starts the 23 h resend
            -- window that much later, well inside its hour of margin.
            set_config('synchronous_commit', 'off', true) AS async_commit
       FROM (SELECT 1) AS one LEFT JOIN attempt a ON true`,
    values: [
      key,
      opts.workflowId,
      opts.safeWindowMs,
      opts.force,
      [...AT_STRIPE],
      opts.lease?.holder ?? null,
      opts.lease?.leaseMs ?? 0,
      storedIdentifier(key, 0, opts.identifierNamespace ?? ''),
    ],
  });
  const r = rows[0]!;
  const { lease_held, found, ...row } = r;
  return { leaseHeld: lease_held, row: found ? (row as AttemptRow) : undefined };
}

/** What the row stores for an identifier: null when it is the key itself (the common case). */
export function storedIdentifier(key: string, revision: number, namespace: string): string | null {
  const identifier = stripeIdentifierFor(key, revision, namespace);
  return identifier === key ? null : identifier;
}

/**
 * The SET clauses that stamp a row recording no attempt as first attempted at `at` (an SQL
 * expression; NULL stamps nothing): counted as an attempt, so that one taken back later never clears
 * the stamp, and under `identifier` (an SQL expression: storedIdentifier of the attempt it stands
 * for, null for the key), the one that attempt sent. A row that records an attempt keeps its own.
 * Used where an attempt may have reached Stripe unrecorded: a reopen, `restored`, the sweep.
 */
export function firstAttemptStamp(alias: string, at: string, identifier: string): string {
  const stamping = `${alias}.first_attempted_at IS NULL AND ${at} IS NOT NULL`;
  return `first_attempted_at = COALESCE(${alias}.first_attempted_at, ${at}),
              stripe_identifier = CASE WHEN ${stamping} THEN COALESCE(${alias}.stripe_identifier, ${identifier}) ELSE ${alias}.stripe_identifier END,
              attempt_count = CASE WHEN ${stamping} THEN greatest(${alias}.attempt_count, 1) ELSE ${alias}.attempt_count END`;
}

/**
 * Takes back an attempt begun but not made (our own pace put it off): the count goes down again,
 * and the first attempt's time is cleared if this was the first and no other has begun since (an
 * attempt that outlived its timeout is taken back after the next one began, which may have called).
 */
export async function undoAttempt(db: Queryable, schema: Schema, key: string, opts: { wasFirst: boolean }): Promise<void> {
  await db.query(
    `UPDATE ${schema.outbox} SET attempt_count = greatest(attempt_count - 1, 0),
            first_attempted_at = CASE WHEN $2::boolean AND attempt_count <= 1 THEN NULL ELSE first_attempted_at END, updated_at = now()
      WHERE idempotency_key = $1::text AND status <> ALL($3::text[])`,
    [key, opts.wasFirst, [...AT_STRIPE]],
  );
}

export interface OutboxRow extends EntryRow {
  attempt_count: number;
  last_error_code: string | null;
  last_error_message: string | null;
  claimed_by: string | null;
  processing_deadline: Date | null;
  workflow_id: string | null;
  first_attempted_at: Date | null;
  created_at: Date;
  dispatched_at: Date | null;
  sent_at: Date | null;
  dead_at: Date | null;
}

export async function findRowByKey(db: Queryable, schema: Schema, key: string): Promise<OutboxRow | undefined> {
  const { rows } = await db.query<OutboxRow>(`SELECT * FROM ${schema.outbox} WHERE idempotency_key = $1::text`, [key]);
  return rows[0];
}

/**
 * Stores the error of a failed attempt on the row, so listings show why it is retrying. `refused`:
 * Stripe refused the event for good (not "already exists"), so it holds nothing under this
 * identifier: the customer the attempt named is forgotten, and a retry after a remap names the
 * tenant's new one (attemptCustomer).
 */
export async function recordAttemptError(db: Queryable, schema: Schema, key: string, code: string, message: string, opts: { refused?: boolean } = {}): Promise<void> {
  await db.query(
    `UPDATE ${schema.outbox} SET last_error_code = $2::text, last_error_message = $3::text, updated_at = now(),
            billed_customer_id = CASE WHEN $5::boolean THEN NULL ELSE billed_customer_id END
      WHERE idempotency_key = $1::text AND status <> ALL($4::text[])`,
    [key, code, message.slice(0, 1000), [...AT_STRIPE], opts.refused === true],
  );
}

/**
 * The row is delivered: `sent` (v1) or `accepted` (the v2 stream). Its lane has room again, so idle
 * relays are woken (schema.outboxChannel, at commit) to claim the lane's next event, as they are for
 * dead letters.
 *
 * Only under the identifier revision the attempt sent (`revision`, from `beginAttempt`): a row
 * rebilled meanwhile (src/ops/rebill.ts: a new identifier, not sent yet) is not the attempt's to
 * mark. Stripe's answer to the old identifier says nothing of the new one; marking the row would
 * leave the rebilled event unbilled. Returns the attempts counted, or null when nothing was marked.
 */
export async function markDelivered(
  db: Queryable,
  schema: Schema,
  key: string,
  status: (typeof DELIVERED)[number],
  revision: number,
): Promise<Marked> {
  const { rows } = await db.query<{ attempt_count: number; first: boolean }>(
    `WITH sent AS (
       UPDATE ${schema.outbox}
          SET status = $4::text, sent_at = COALESCE(sent_at, now()), last_error_code = NULL, last_error_message = NULL,
              claim_id = NULL, processing_deadline = NULL, dead_at = NULL, updated_at = now()
        WHERE idempotency_key = $1::text AND status <> ALL($2::text[]) AND identifier_revision = $5::int
        RETURNING attempt_count, sent_at = now() AS first
     )
     SELECT attempt_count, first, pg_notify($3::text, '') FROM sent`,
    [key, [...UNBILLED], schema.outboxChannel, status, revision],
  );
  return { attempts: rows[0]?.attempt_count ?? null, first: rows[0]?.first ?? false };
}

/**
 * What a delivered mark did: the attempts counted (null: not marked, the row moved on), and whether
 * this mark is the one that made the row delivered (false for a second attempt's mark of a row
 * already delivered: a v2 attempt that timed out and its retry share one stream request, and both
 * mark the row). Counted once, by the first.
 */
export interface Marked {
  attempts: number | null;
  first: boolean;
}

/**
 * `markDelivered` (as `sent`) and the hand-off of the (customer, meter) lease to the next waiting
 * delivery (./lease.ts `handOffLease`) in one round trip: the common end of every v1 delivery.
 * Returns the attempts counted (null: not marked, as in `markDelivered`: the row was rebilled under
 * another identifier revision, or Stripe's later validation rejected it, or it was cancelled) and
 * the hand-offs made (NOTIFY at commit; the caller tells its own process's waiters at once). The
 * lease is handed on either way.
 */
export async function markSentAndHandOff(
  db: Queryable,
  schema: Schema,
  key: string,
  holder: string,
  handOffMs: number,
  revision: number,
): Promise<Marked & { handOffs: HandOff[] }> {
  const { rows } = await db.query<{ attempt_count: number | null; first: boolean | null; hand_offs: HandOff[] | null }>({
    // Named: prepared once per connection, parsed and planned once, not on every event.
    name: schema.statementName('mark-sent-and-hand-off'),
    text: `WITH sent AS (
       UPDATE ${schema.outbox}
          SET status = 'sent', sent_at = COALESCE(sent_at, now()), last_error_code = NULL, last_error_message = NULL,
              claim_id = NULL, processing_deadline = NULL, dead_at = NULL, updated_at = now()
        WHERE idempotency_key = $1::text AND status <> ALL($2::text[]) AND identifier_revision = $7::int
        RETURNING attempt_count, sent_at = now() AS first
     )
     SELECT (SELECT attempt_count FROM sent) AS attempt_count, (SELECT first FROM sent) AS first,
            (SELECT json_agg(json_build_object('lease', h.lane, 'nextHolder', h.next_holder))
               FROM ${schema.meterLeaseHandOff}($3::text, $6::int, $5::text) h) AS hand_offs,
            (SELECT pg_notify($4::text, '') FROM sent) AS relays`,
    values: [key, [...UNBILLED], holder, schema.outboxChannel, schema.leaseChannel, handOffMs, revision],
  });
  return { attempts: rows[0]?.attempt_count ?? null, first: rows[0]?.first ?? false, handOffs: rows[0]?.hand_offs ?? [] };
}

/**
 * What a dead mark leaves: the attempts spent, and when the row's resend window began (null: no
 * attempt reached Stripe; undefined: the row was not made dead, as when it is already sent).
 * `atStripe`: the row was not made dead because it is at Stripe already (an earlier try's call got
 * through after its attempt had timed out, or an error report or a cancel came first): its status.
 */
export interface DeadMark {
  attempts: number;
  firstAttemptedAt?: number | null;
  atStripe?: (typeof AT_STRIPE)[number];
}

/** The row becomes a dead letter carrying its final error. A sent row is never made dead. */
export async function markRowDead(db: Queryable, schema: Schema, key: string, code: string, message: string): Promise<DeadMark> {
  const { rows } = await db.query<{ attempt_count: number; first_attempted_ms: number | string | null }>(
    `WITH dead AS (
       UPDATE ${schema.outbox}
          SET status = 'dead', dead_at = now(), last_error_code = $2::text, last_error_message = $3::text,
              claim_id = NULL, processing_deadline = NULL, updated_at = now()
        WHERE idempotency_key = $1::text AND status <> ALL($4::text[])
        RETURNING attempt_count, first_attempted_at
     )
     SELECT attempt_count, floor(extract(epoch FROM first_attempted_at) * 1000)::float8 AS first_attempted_ms, pg_notify($5::text, '') FROM dead`,
    [key, code, message.slice(0, 1000), [...AT_STRIPE], schema.outboxChannel],
  );
  const row = rows[0];
  if (!row) {
    const found = await db.query<{ status: (typeof AT_STRIPE)[number]; attempt_count: number }>(
      `SELECT status, attempt_count FROM ${schema.outbox} WHERE idempotency_key = $1::text AND status = ANY($2::text[])`,
      [key, [...AT_STRIPE]],
    );
    const atStripe = found.rows[0];
    return atStripe ? { attempts: atStripe.attempt_count, atStripe: atStripe.status } : { attempts: 0 };
  }
  return { attempts: row.attempt_count, firstAttemptedAt: row.first_attempted_ms === null ? null : Number(row.first_attempted_ms) };
}

/** An operator's retry reopened the dead letter in its open run: the row is back in flight. */
export async function markRowReopened(db: Queryable, schema: Schema, key: string): Promise<void> {
  await db.query(
    `UPDATE ${schema.outbox} SET status = 'dispatched', dispatched_at = now(), dead_at = NULL, updated_at = now()
      WHERE idempotency_key = $1::text AND status = 'dead'`,
    [key],
  );
}

/** The statements the delivery activity runs, bound to its pool (a fake in the activity's unit tests). */
export interface DeliveryStore {
  beginAttempt(key: string, opts: Parameters<typeof beginAttempt>[3]): ReturnType<typeof beginAttempt>;
  undoAttempt(key: string, opts: { wasFirst: boolean }): Promise<void>;
  findRow(key: string): Promise<Pick<OutboxRow, 'first_attempted_at' | 'status' | 'last_error_code' | 'last_error_message'> | undefined>;
  recordAttemptError(key: string, code: string, message: string, opts?: { refused?: boolean }): Promise<void>;
  markDelivered(key: string, status: (typeof DELIVERED)[number], revision: number): ReturnType<typeof markDelivered>;
  markSentAndHandOff(key: string, holder: string, handOffMs: number, revision: number): ReturnType<typeof markSentAndHandOff>;
  markRowDead(key: string, code: string, message: string): Promise<DeadMark>;
  markRowReopened(key: string): Promise<void>;
}

export function deliveryStore(db: Queryable, schema: Schema, opts: { identifierNamespace?: string } = {}): DeliveryStore {
  return {
    beginAttempt: (key, o) => beginAttempt(db, schema, key, { ...o, identifierNamespace: opts.identifierNamespace ?? '' }),
    undoAttempt: (key, opts) => undoAttempt(db, schema, key, opts),
    findRow: (key) => findRowByKey(db, schema, key),
    recordAttemptError: (key, code, message, o) => recordAttemptError(db, schema, key, code, message, o),
    markDelivered: (key, status, revision) => markDelivered(db, schema, key, status, revision),
    markSentAndHandOff: (key, holder, handOffMs, revision) => markSentAndHandOff(db, schema, key, holder, handOffMs, revision),
    markRowDead: (key, code, message) => markRowDead(db, schema, key, code, message),
    markRowReopened: (key) => markRowReopened(db, schema, key),
  };
}
