/**
 * The request path: the usage row and its outbox row, written in the caller's transaction.
 * One named function per statement; values always travel as typed parameters, never as SQL text.
 */
import type { OutboxStatus } from '../statuses.js';
import { UnreadableRowsError } from '../errors.js';
import type { Schema } from './schema.js';

/**
 * What the request path needs of the caller's transaction: run one statement with positional
 * parameters ($1…) and return its rows. A node-postgres client is one as it is; src/adapters/ make
 * one of a Kysely, Drizzle or Knex transaction. `name` asks for a prepared statement where the
 * driver has them (node-postgres); others may ignore it.
 */
export interface TransactionClient {
  query(statement: { text: string; values: unknown[]; name?: string }): Promise<{ rows: unknown[] }>;
}

/**
 * `statement`'s rows, on the caller's transaction. An answer not shaped as node-postgres's
 * (`{ rows: [...] }`: a driver or ORM plugin that answers the rows alone, or something else) is
 * UnreadableRowsError: the statement has run, and the transaction must be rolled back.
 */
export async function callerRows<Row>(db: TransactionClient, statement: { text: string; values: unknown[]; name?: string }): Promise<Row[]> {
  const answer: unknown = await db.query(statement);
  const rows = (answer as { rows?: unknown } | null | undefined)?.rows;
  if (!Array.isArray(rows)) throw Array.isArray(answer) ? new UnreadableRowsError(answer[0] ?? {}, 'rows alone') : new UnreadableRowsError(answer);
  return rows as Row[];
}

export interface EntryRow {
  id: number;
  idempotency_key: string;
  tenant_id: string;
  usage_id: string;
  event_name: string;
  quantity: number;
  occurred_at: Date;
  status: OutboxStatus;
}

/**
 * An entry row as the caller's driver parsed it, under the one-word names ENTRY_COLUMNS gives it:
 * bigint may arrive as text (node-postgres's default), by the application's settings, never ours;
 * `occurred` is always ISO text in UTC.
 */
export interface CallerEntryRow {
  id: number | string;
  key: string;
  tenant: string;
  usage: string;
  event: string;
  quantity: number | string;
  occurred: string;
  status: OutboxStatus;
}

/**
 * The columns of an entry row as the caller's driver returns them (`o.` names the table in a join).
 *
 * - Each under a lowercase name of one word: an ORM that renames result keys (Kysely's
 *   CamelCasePlugin, a Knex postProcessResponse that camel-cases) leaves such a name as it is;
 *   `tenant_id` came back as `tenantId`, and recordUsage read a known tenant as unknown after its
 *   rows were written.
 * - occurred_at as ISO 8601 text in UTC: the same instant whatever the caller's driver makes of a
 *   timestamptz and whatever the session's TimeZone (@prisma/adapter-pg reads one as if its offset
 *   were +00:00).
 */
export function entryColumns(o = ''): string {
  return `${o}id, ${o}idempotency_key AS key, ${o}tenant_id AS tenant, ${o}usage_id AS usage, ${o}event_name AS event, ${o}quantity,
    to_char(${o}occurred_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"') AS occurred, ${o}status`;
}

/**
 * Writes the usage row and its outbox row, in one round trip, inside the caller's transaction.
 * Written so that no input can raise an error inside that transaction (which would abort it): an
 * unknown tenant inserts nothing, a duplicate hits ON CONFLICT DO NOTHING, and the result says
 * which happened.
 */
export async function insertUsage(
  db: TransactionClient,
  schema: Schema,
  usage: { usageId: string; tenantId: string; eventName: string; quantity: number; occurredAt: Date | null; key: string; traceParent?: string | undefined },
): Promise<{ tenantKnown: boolean; row: CallerEntryRow | undefined }> {
  const rows = await callerRows<Partial<CallerEntryRow> & { known?: unknown }>(db, {
    // Named: prepared once per connection of the application's pool, parsed and planned once.
    name: schema.statementName('record-usage'),
    text: `WITH tenant AS (
       SELECT tenant_id FROM ${schema.billingCustomers} WHERE tenant_id = $2::text
     ), usage AS (
       INSERT INTO ${schema.usageLogs} (id, tenant_id, event_name, quantity, occurred_at)
       SELECT $1::text, tenant_id, $3::text, $4::bigint, COALESCE($5::timestamptz, now()) FROM tenant
       ON CONFLICT (tenant_id, id) DO NOTHING
       RETURNING id, tenant_id, event_name, quantity, occurred_at
     ), queued AS (
       INSERT INTO ${schema.outbox} (tenant_id, usage_id, event_name, quantity, occurred_at, idempotency_key, trace_parent)
       SELECT tenant_id, id, event_name, quantity, occurred_at, $6::text, $7::text FROM usage
       -- No conflict target: whichever unique constraint a duplicate hits, nothing may raise here.
       ON CONFLICT DO NOTHING
       RETURNING ${entryColumns()}
     )
     SELECT EXISTS (SELECT 1 FROM tenant) AS known, q.*
     FROM (SELECT 1) AS one LEFT JOIN queued q ON true`,
    values: [usage.usageId, usage.tenantId, usage.eventName, usage.quantity, usage.occurredAt, usage.key, usage.traceParent ?? null],
  });
  const row = rows[0];
  if (typeof row?.known !== 'boolean') throw new UnreadableRowsError(row);
  return { tenantKnown: row.known, row: row.id == null ? undefined : (row as CallerEntryRow) };
}

/** The outbox entry of one tenant's usage, by its key (derived from the tenant and the usage id). */
export async function findEntryByKey(db: TransactionClient, schema: Schema, tenantId: string, key: string): Promise<CallerEntryRow | undefined> {
  const rows = await callerRows<CallerEntryRow>(db, {
    text: `SELECT ${entryColumns()} FROM ${schema.outbox} WHERE idempotency_key = $2::text AND tenant_id = $1::text`,
    values: [tenantId, key],
  });
  return rows[0];
}

/** A usage row as recorded: what an outbox entry pruned after delivery leaves behind. */
export interface RecordedUsage {
  tenantId: string;
  usageId: string;
  eventName: string;
  quantity: number;
  occurredAt: Date;
}

/**
 * The usage rows of (tenant, usage id) pairs, found whether or not their outbox rows are still
 * there: a usage delivered and pruned (OUTBOX_RETENTION_DAYS) is known by its usage row alone.
 */
export async function findRecordedUsages(db: TransactionClient, schema: Schema, pairs: readonly { tenantId: string; usageId: string }[]): Promise<RecordedUsage[]> {
  // One-word names and UTC text, as entryColumns: the caller's ORM may rename keys (camelCase) or
  // read timestamps in its own way.
  const rows = await callerRows<{ tenant: string; id: string; event: string; quantity: string; occurred: string }>(db, {
    text: `SELECT u.tenant_id AS tenant, u.id, u.event_name AS event, u.quantity::text AS quantity,
            to_char(u.occurred_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"') AS occurred
     FROM ${schema.usageLogs} u
     JOIN unnest($1::text[], $2::text[]) AS k(tenant_id, id) ON u.tenant_id = k.tenant_id AND u.id = k.id`,
    values: [pairs.map((p) => p.tenantId), pairs.map((p) => p.usageId)],
  });
  return rows.map((r) => ({ tenantId: r.tenant, usageId: r.id, eventName: r.event, quantity: Number(r.quantity), occurredAt: new Date(r.occurred) }));
}
