/**
 * What operators read and change: dead letters, one event's row, reopening one, cancellations, and
 * the audit log.
 * One named function per statement; values always travel as typed parameters, never as SQL text.
 */
import type { Queryable } from '../../db.js';
import { DELIVERED, IN_FLIGHT, UNSETTLED } from '../statuses.js';
import type { Schema } from './schema.js';
import { attemptCustomer } from './customers.js';
import { inFlightNow } from './relay.js';
import { firstAttemptStamp } from './delivery.js';

/**
 * An outbox row as the operator sees it, with the Stripe customer its attempts name
 * (`attemptCustomer`): the one an earlier attempt named, else the one its tenant is billed as now.
 */
export interface OperatorRow {
  id: number;
  idempotency_key: string;
  tenant_id: string;
  event_name: string;
  quantity: string;
  status: string;
  attempt_count: number;
  last_error_code: string | null;
  last_error_message: string | null;
  occurred_at: Date;
  created_at: Date;
  first_attempted_at: Date | null;
  dead_at: Date | null;
  stripe_customer_id: string | null;
  /** When the latest rebill gave the row its identifier revision; null when never rebilled. */
  rebilled_at: Date | null;
}

const operatorColumns = (schema: Schema) => `o.id, o.idempotency_key, o.tenant_id, o.event_name, o.quantity::text, o.status, o.attempt_count, o.last_error_code,
  o.last_error_message, o.occurred_at, o.created_at, o.first_attempted_at, o.dead_at,
  ${attemptCustomer(schema, 'o')} AS stripe_customer_id, o.rebilled_at`;

export interface DeadLetterFilter {
  tenantId?: string | undefined;
  errorCode?: string | undefined;
}

/**
 * One page of dead letters after `afterId`, oldest first. Keyset paging (not OFFSET): a bulk retry
 * moves rows out of `dead` while it pages, which would make OFFSET skip rows, and each page costs
 * the same however deep it is.
 */
export async function listDeadLetters(
  db: Queryable,
  schema: Schema,
  opts: DeadLetterFilter & { afterId: number; limit: number },
): Promise<OperatorRow[]> {
  const { rows } = await db.query<OperatorRow>(
    `SELECT ${operatorColumns(schema)} FROM ${schema.outbox} o
      WHERE o.status = 'dead' AND o.id > $1::bigint
        AND ($2::text IS NULL OR o.tenant_id = $2::text)
        AND ($3::text IS NULL OR o.last_error_code = $3::text)
      ORDER BY o.id
      LIMIT $4::int`,
    [opts.afterId, opts.tenantId ?? null, opts.errorCode ?? null, opts.limit],
  );
  return rows;
}

export async function countDeadLetters(db: Queryable, schema: Schema, filter: DeadLetterFilter): Promise<number> {
  const { rows } = await db.query<{ count: number }>(
    `SELECT count(*) AS count FROM ${schema.outbox}
      WHERE status = 'dead' AND ($1::text IS NULL OR tenant_id = $1::text) AND ($2::text IS NULL OR last_error_code = $2::text)`,
    [filter.tenantId ?? null, filter.errorCode ?? null],
  );
  return rows[0]!.count;
}

/** What a lane (tenant, meter) has in flight, counted as the claim counts it (./relay.ts inFlightNow). A bulk retry gives a lane no more than its room. */
export async function laneInFlight(db: Queryable, schema: Schema, tenantId: string, eventName: string): Promise<number> {
  const { rows } = await db.query<{ n: number }>(
    `SELECT count(*)::int AS n FROM ${schema.outbox} o
      WHERE o.tenant_id = $1::text AND o.event_name = $2::text AND ${inFlightNow('o', '$3::text[]')}`,
    [tenantId, eventName, [...IN_FLIGHT]],
  );
  return rows[0]!.n;
}

export async function findOperatorRow(db: Queryable, schema: Schema, key: string): Promise<OperatorRow | undefined> {
  const { rows } = await db.query<OperatorRow>(`SELECT ${operatorColumns(schema)} FROM ${schema.outbox} o WHERE o.idempotency_key = $1::text`, [key]);
  return rows[0];
}

/**
 * Takes a dead letter back in flight before an operator starts a new workflow run for it. The
 * `status = 'dead'` guard is the lock: of two operators reopening the same event at once, the
 * second one's UPDATE re-checks the row after the first commits, finds it dispatched, and returns
 * nothing, so only one of them goes on to start a run. A sent row can never match. Returns the
 * previous dead_at, for `restoreDeadLetter` if the start fails. `reachedStripeBy`: when the event
 * is known to have reached Stripe at the latest (its run completed then), kept as its first attempt
 * if the row has none (a backup from before it), so that PostgreSQL's resend guard (beginAttempt)
 * counts its window from there, by the database's clock rather than the operator's.
 */
export async function reopenDeadLetter(
  db: Queryable,
  schema: Schema,
  key: string,
  reachedStripeBy?: Date,
  /** What the row stores as its identifier when first attempted now (storedIdentifier: null for the key itself). */
  firstIdentifier: string | null = null,
): Promise<{ tenant_id: string; previous_dead_at: Date | null } | undefined> {
  const { rows } = await db.query<{ tenant_id: string; previous_dead_at: Date | null }>(
    `WITH prev AS (
       SELECT id, dead_at FROM ${schema.outbox} WHERE idempotency_key = $1::text AND status = 'dead' FOR UPDATE
     )
     UPDATE ${schema.outbox} o
        SET status = 'dispatched', dispatched_at = now(), dead_at = NULL,
            -- The run that reached Stripe, as an attempt under the identifier it would have had then
            -- (beginAttempt keeps a stamped row's identifier): with STRIPE_IDENTIFIER_NAMESPACE, not the bare key.
            ${firstAttemptStamp('o', '$2::timestamptz', '$3::text')},
            workflow_id = COALESCE(o.workflow_id, o.idempotency_key), updated_at = now()
       FROM prev
      WHERE o.id = prev.id AND o.status = 'dead'
     RETURNING o.tenant_id, prev.dead_at AS previous_dead_at`,
    [key, reachedStripeBy ?? null, firstIdentifier],
  );
  return rows[0];
}

/** Undoes `reopenDeadLetter` when no run could be started: the row is a dead letter again. */
export async function restoreDeadLetter(db: Queryable, schema: Schema, key: string, deadAt: Date | null): Promise<boolean> {
  const result = await db.query(
    `UPDATE ${schema.outbox} SET status = 'dead', dead_at = COALESCE($2::timestamptz, now()), updated_at = now()
      WHERE idempotency_key = $1::text AND status = 'dispatched'`,
    [key, deadAt],
  );
  return (result.rowCount ?? 0) > 0;
}

/** A row as a rebill reads it: the operator's view plus its identifier and revision. */
export interface RebillCandidateRow extends OperatorRow {
  identifier_revision: number;
  /** The identifier Stripe got for the current revision: the stored one, or the key. */
  identifier: string;
  rejected_at: Date | null;
}

export async function findRebillCandidate(db: Queryable, schema: Schema, key: string): Promise<RebillCandidateRow | undefined> {
  const { rows } = await db.query<RebillCandidateRow>(
    `SELECT ${operatorColumns(schema)}, o.identifier_revision, COALESCE(o.stripe_identifier, o.idempotency_key) AS identifier, o.rejected_at
       FROM ${schema.outbox} o WHERE o.idempotency_key = $1::text`,
    [key],
  );
  return rows[0];
}

/**
 * Gives an event Stripe rejected a new identifier and puts it back in flight, in one guarded
 * statement: only from `rejected_async` at revision `fromRevision`, so of two operators rebilling
 * at once exactly one moves it (the other's UPDATE finds the row changed and matches nothing). The
 * attempt count, the first attempt's time, the customer it was sent to and the time sent start again: the new identifier has
 * never been sent, so Stripe's 24-hour dedup window starts with its own first attempt, and `cancel`'s
 * window with its acceptance. Returns the row's tenant, or
 * nothing when another operator (or anything else) changed the row first.
 */
export async function rebillRejected(
  db: Queryable,
  schema: Schema,
  key: string,
  next: { fromRevision: number; identifier: string },
): Promise<{ tenant_id: string } | undefined> {
  const { rows } = await db.query<{ tenant_id: string }>(
    `UPDATE ${schema.outbox}
        SET status = 'dispatched', identifier_revision = $2::int + 1, stripe_identifier = $3::text,
            dispatched_at = now(), rebilled_at = now(), first_attempted_at = NULL, attempt_count = 0, dead_at = NULL, sent_at = NULL,
            billed_customer_id = NULL, claim_id = NULL, processing_deadline = NULL,
            workflow_id = COALESCE(workflow_id, idempotency_key), updated_at = now()
      WHERE idempotency_key = $1::text AND status = 'rejected_async' AND identifier_revision = $2::int
     RETURNING tenant_id`,
    [key, next.fromRevision, next.identifier],
  );
  return rows[0];
}

/**
 * Undoes `rebillRejected` when no run could deliver it: back to `rejected_async`, keeping the new
 * revision. Only while nothing was attempted under it (first_attempted_at still NULL): that
 * identifier never reached Stripe, so "Stripe does not count it" stays true of it.
 */
export async function restoreRejected(db: Queryable, schema: Schema, key: string, revision: number): Promise<boolean> {
  const result = await db.query(
    `UPDATE ${schema.outbox} SET status = 'rejected_async', updated_at = now()
      WHERE idempotency_key = $1::text AND status = 'dispatched' AND identifier_revision = $2::int AND first_attempted_at IS NULL`,
    [key, revision],
  );
  return (result.rowCount ?? 0) > 0;
}

export interface OperatorAction {
  actor: string;
  action: 'retry' | 'customers.set' | 'cancel' | 'rebill' | 'import' | 'prune' | 'restored';
  key: string | null;
  tenantId: string | null;
  forced: boolean;
  outcome: string;
  detail: string | null;
}

export async function recordOperatorAction(db: Queryable, schema: Schema, a: OperatorAction): Promise<void> {
  await db.query(
    `INSERT INTO ${schema.operatorActions} (actor, action, idempotency_key, tenant_id, forced, outcome, detail)
     VALUES ($1::text, $2::text, $3::text, $4::text, $5::boolean, $6::text, $7::text)`,
    [a.actor.slice(0, 200), a.action, a.key, a.tenantId, a.forced, a.outcome, a.detail?.slice(0, 2000) ?? null],
  );
}

/**
 * An action's audit row written before the action, as `started` (its detail: what is asked), for
 * finishOperatorAction to complete: one cut short (Ctrl-C in `retry --wait`, an import stopped
 * half-way, a crash) still leaves the row saying it began. Returns the row's id.
 */
export async function startOperatorAction(db: Queryable, schema: Schema, a: Omit<OperatorAction, 'outcome'>): Promise<string> {
  const { rows } = await db.query<{ id: string }>(
    `INSERT INTO ${schema.operatorActions} (actor, action, idempotency_key, tenant_id, forced, outcome, detail)
     VALUES ($1::text, $2::text, $3::text, $4::text, $5::boolean, 'started', $6::text) RETURNING id::text`,
    [a.actor.slice(0, 200), a.action, a.key, a.tenantId, a.forced, a.detail?.slice(0, 2000) ?? null],
  );
  return rows[0]!.id;
}

/** The outcome of the action whose row startOperatorAction wrote. */
export async function finishOperatorAction(db: Queryable, schema: Schema, id: string, outcome: string, detail: string | null): Promise<void> {
  await db.query(`UPDATE ${schema.operatorActions} SET outcome = $2::text, detail = $3::text WHERE id = $1::bigint`, [id, outcome, detail?.slice(0, 2000) ?? null]);
}

export interface OperatorActionRow {
  at: Date;
  actor: string;
  action: string;
  forced: boolean;
  outcome: string;
  detail: string | null;
}

/** The most recent operator actions on one event, newest first. */
export async function listOperatorActions(db: Queryable, schema: Schema, key: string, limit: number): Promise<OperatorActionRow[]> {
  const { rows } = await db.query<OperatorActionRow>(
    `SELECT at, actor, action, forced, outcome, detail FROM ${schema.operatorActions}
      WHERE idempotency_key = $1::text ORDER BY at DESC, id DESC LIMIT $2::int`,
    [key, limit],
  );
  return rows;
}

/** One event's row as `billing-outbox inspect` shows it. */
export interface InspectedRow {
  id: number;
  idempotency_key: string;
  tenant_id: string;
  usage_id: string;
  event_name: string;
  quantity: number;
  occurred_at: Date;
  status: string;
  attempt_count: number;
  last_error_code: string | null;
  last_error_message: string | null;
  workflow_id: string | null;
  created_at: Date;
  first_attempted_at: Date | null;
  dispatched_at: Date | null;
  sent_at: Date | null;
  dead_at: Date | null;
  /** The identifier Stripe got (the stored one, or the key) and its revision (rebills). */
  identifier: string;
  identifier_revision: number;
}

export async function findInspectedRow(db: Queryable, schema: Schema, key: string): Promise<InspectedRow | undefined> {
  const { rows } = await db.query<InspectedRow>(
    `SELECT id, idempotency_key, tenant_id, usage_id, event_name, quantity, occurred_at, status, attempt_count, last_error_code,
            last_error_message, workflow_id, created_at, first_attempted_at, dispatched_at, sent_at, dead_at,
            COALESCE(stripe_identifier, idempotency_key) AS identifier, identifier_revision
       FROM ${schema.outbox} WHERE idempotency_key = $1::text`,
    [key],
  );
  return rows[0];
}

// ---- Cancellation (src/ops/cancel.ts) ----

/**
 * After Stripe accepted the cancellation: the row stops counting as billed. Guarded by
 * delivered (`sent` or `accepted`) so a row that moved meanwhile (rejected by Stripe's later validation, or
 * cancelled by another operator) is not overwritten. Returns whether it was this call that did it.
 */
export async function markCancelled(db: Queryable, schema: Schema, key: string): Promise<boolean> {
  const result = await db.query(
    `UPDATE ${schema.outbox} SET status = 'cancelled', cancelled_at = now(), updated_at = now()
      WHERE idempotency_key = $1::text AND status = ANY($2::text[])`,
    [key, [...DELIVERED]],
  );
  return (result.rowCount ?? 0) > 0;
}

export interface CancelCandidateRow {
  idempotency_key: string;
  tenant_id: string;
  event_name: string;
  quantity: number;
  status: string;
  occurred_at: Date;
  sent_at: Date | null;
  rejected_at: Date | null;
  cancelled_at: Date | null;
  last_error_code: string | null;
  /** The identifier Stripe got (the stored one, or the key): what a cancel names. */
  identifier: string;
  /** How long ago it was sent (ms), by the clock that stamped sent_at: the database's, not the caller's. */
  sent_age_ms: number | null;
}

export async function findCancelCandidate(db: Queryable, schema: Schema, key: string): Promise<CancelCandidateRow | undefined> {
  const { rows } = await db.query<CancelCandidateRow>(
    `SELECT idempotency_key, tenant_id, event_name, quantity, status, occurred_at, sent_at, rejected_at, cancelled_at, last_error_code,
            COALESCE(stripe_identifier, idempotency_key) AS identifier,
            (extract(epoch FROM clock_timestamp() - sent_at) * 1000)::float8 AS sent_age_ms
       FROM ${schema.outbox} WHERE idempotency_key = $1::text`,
    [key],
  );
  return rows[0];
}

/**
 * After a restore from a backup taken at `backupTakenAt`: every unsettled row (pending, claimed,
 * dispatched or dead) never attempted may have been delivered after the backup (the row's attempt
 * was lost with it), and Stripe's identifier dedup lasts 24 hours. Each is stamped as first
 * attempted at the backup's time, or at its own creation if later (a row written during the backup,
 * or since), under the identifier that attempt would have used (`identifierOf`: with
 * STRIPE_IDENTIFIER_NAMESPACE, not the bare key), and counted as an attempt (so that one taken back
 * never clears the stamp). The resend guard (beginAttempt, `retry`) does the rest: sent while
 * inside the window from there, refused past it (`identifier_window_expired`: reconcile, then
 * `retry --force`). Rows attempted before keep their stamp. In batches of `batchSize` rows, each its
 * own statement; recorded in operator_actions at the end. Returns how many rows were stamped.
 */
export async function stampRestored(
  db: Queryable,
  schema: Schema,
  opts: { backupTakenAt: Date; actor: string; identifierOf: (key: string) => string | null; batchSize?: number },
): Promise<number> {
  let stamped = 0;
  for (let after = 0; ; ) {
    const { rows } = await db.query<{ id: string; idempotency_key: string }>(
      `SELECT id::text, idempotency_key FROM ${schema.outbox}
        WHERE status = ANY($1::text[]) AND first_attempted_at IS NULL AND id > $2::bigint ORDER BY id LIMIT $3::int`,
      [[...UNSETTLED], after, opts.batchSize ?? 5_000],
    );
    if (rows.length === 0) break;
    after = Number(rows[rows.length - 1]!.id);
    const result = await db.query(
      `UPDATE ${schema.outbox} o
          SET ${firstAttemptStamp('o', 'greatest($1::timestamptz, o.created_at)', 'u.identifier')}, updated_at = now()
         FROM unnest($2::bigint[], $3::text[]) AS u(id, identifier)
        WHERE o.id = u.id AND o.status = ANY($4::text[]) AND o.first_attempted_at IS NULL`,
      [opts.backupTakenAt, rows.map((r) => r.id), rows.map((r) => opts.identifierOf(r.idempotency_key)), [...UNSETTLED]],
    );
    stamped += result.rowCount ?? 0;
  }
  await recordOperatorAction(db, schema, {
    actor: opts.actor,
    action: 'restored',
    key: null,
    tenantId: null,
    forced: false,
    outcome: 'stamped',
    detail: `${stamped} unsettled row(s) never attempted stamped as first attempted at ${opts.backupTakenAt.toISOString()} (or at their creation, if later)`,
  });
  return stamped;
}

/** The latest action of this kind in operator_actions: when and by whom; undefined if none. */
export async function lastOperatorAction(db: Queryable, schema: Schema, action: OperatorAction['action']): Promise<{ at: Date; actor: string } | undefined> {
  const { rows } = await db.query<{ at: Date; actor: string }>(`SELECT at, actor FROM ${schema.operatorActions} WHERE action = $1::text ORDER BY id DESC LIMIT 1`, [action]);
  return rows[0];
}

/**
 * Records the STRIPE_IDENTIFIER_NAMESPACE a worker starts with as the deployment's (every worker,
 * at start). Returns the one recorded before, if another ('' for none; null before any worker).
 */
export async function recordIdentifierNamespace(db: Queryable, schema: Schema, namespace: string): Promise<string | null | undefined> {
  // The row locked before it is read: two workers starting at once each see the other's value.
  const { rows } = await db.query<{ before: string | null }>(
    `WITH old AS (SELECT identifier_namespace AS before FROM ${schema.deployment} FOR UPDATE)
     UPDATE ${schema.deployment} d SET identifier_namespace = $1::text FROM old RETURNING old.before`,
    [namespace],
  );
  const before = rows[0]?.before ?? null;
  return before === namespace ? undefined : before;
}

/**
 * The identifier namespace operator commands stamp and rebill with: the one the deployment's
 * workers last started with, when this process has none (a CLI run from a shell without
 * STRIPE_IDENTIFIER_NAMESPACE would stamp bare keys where the workers sent `<namespace>/<key>`, and
 * a resend under another identifier is billed twice); `configured` while no worker has started.
 * Two different ones are refused: which is right (a namespace changed since a backup was taken,
 * a CLI pointed at another deployment's database) is the operator's to say.
 */
export async function identifierNamespaceOf(db: Queryable, schema: Schema, configured: string): Promise<string> {
  const { rows } = await db.query<{ identifier_namespace: string | null }>(`SELECT identifier_namespace FROM ${schema.deployment}`);
  const recorded = rows[0]?.identifier_namespace ?? null;
  if (recorded === null) return configured;
  if (configured !== '' && configured !== recorded) {
    throw new NamespaceMismatchError(
      `STRIPE_IDENTIFIER_NAMESPACE is ${JSON.stringify(configured)} here, but this database records ${JSON.stringify(recorded)} as the one its workers last started with: ` +
        'identifiers stamped with another would be resent as new events, and billed twice. Run without STRIPE_IDENTIFIER_NAMESPACE to use the recorded one. ' +
        "After a restore it is the backup's, the one the events waiting in the backup were sent with after it was taken, unless the namespace changed first " +
        '(then set that one, and reconcile the hours around the change). The record is made at each worker start: a start that could not write it left the one before.',
    );
  }
  return recorded;
}

/** An operator command's STRIPE_IDENTIFIER_NAMESPACE other than the one the workers started with. */
export class NamespaceMismatchError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'NamespaceMismatchError';
  }
}
