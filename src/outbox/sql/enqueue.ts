/**
 * The request path: the usage row and its outbox row, written in the caller's transaction.
 * One named function per statement; values always travel as typed parameters, never as SQL text.
 */
import { pgTypes, type Queryable } from '../../db.js';
import type { OutboxStatus } from '../statuses.js';

export interface EntryRow {
  id: number;
  idempotency_key: string;
  tenant_id: string;
  /** Null only on rows written before migration 005 and never backfilled (none are: 005 backfills). */
  usage_id: string | null;
  event_name: string;
  quantity: number;
  occurred_at: Date;
  status: OutboxStatus;
}

const ENTRY_COLUMNS = 'id, idempotency_key, tenant_id, usage_id, event_name, quantity, occurred_at, status';

/**
 * Writes the usage row and its outbox row, in one round trip, inside the caller's transaction.
 * Written so that no input can raise an error inside that transaction (which would abort it): an
 * unknown tenant inserts nothing, a duplicate hits ON CONFLICT DO NOTHING, and the result says
 * which happened.
 */
export async function insertUsage(
  db: Queryable,
  usage: { usageId: string; tenantId: string; eventName: string; quantity: number; occurredAt: Date | null; key: string },
): Promise<{ tenantKnown: boolean; row: EntryRow | undefined }> {
  const { rows } = await db.query<Partial<EntryRow> & { tenant_known: boolean }>({
    // Named: prepared once per connection of the application's pool, parsed and planned once.
    name: 'billing-outbox/record-usage',
    text: `WITH tenant AS (
       SELECT tenant_id FROM billing_customers WHERE tenant_id = $2::text
     ), usage AS (
       INSERT INTO usage_logs (id, tenant_id, event_name, quantity, occurred_at)
       SELECT $1::text, tenant_id, $3::text, $4::bigint, COALESCE($5::timestamptz, now()) FROM tenant
       ON CONFLICT (tenant_id, id) DO NOTHING
       RETURNING id, tenant_id, event_name, quantity, occurred_at
     ), queued AS (
       INSERT INTO outbox (tenant_id, usage_id, event_name, quantity, occurred_at, idempotency_key)
       SELECT tenant_id, id, event_name, quantity, occurred_at, $6::text FROM usage
       -- No conflict target: whichever unique constraint a duplicate hits, nothing may raise here.
       ON CONFLICT DO NOTHING
       RETURNING ${ENTRY_COLUMNS}
     )
     SELECT EXISTS (SELECT 1 FROM tenant) AS tenant_known, q.*
     FROM (SELECT 1) AS one LEFT JOIN queued q ON true`,
    values: [usage.usageId, usage.tenantId, usage.eventName, usage.quantity, usage.occurredAt, usage.key],
    // The caller's connection: its parsers are the application's, so ours travel with the statement.
    types: pgTypes,
  });
  const row = rows[0]!;
  return { tenantKnown: row.tenant_known, row: row.id == null ? undefined : (row as EntryRow) };
}

/** The outbox entry of one tenant's usage, by its key (derived from the tenant and the usage id). */
export async function findEntryByKey(db: Queryable, tenantId: string, key: string): Promise<EntryRow | undefined> {
  const { rows } = await db.query<EntryRow>({
    text: `SELECT ${ENTRY_COLUMNS} FROM outbox WHERE idempotency_key = $2::text AND tenant_id = $1::text`,
    values: [tenantId, key],
    types: pgTypes,
  });
  return rows[0];
}
