/**
 * The bulk import's statements (src/ops/import.ts): many usages in one round trip, in a transaction
 * the import opens. The request path's own statement (enqueue.ts) is left as it is: one usage, in
 * the caller's transaction. One named function per statement; values travel as typed arrays.
 */
import { callerRows, entryColumns, type CallerEntryRow, type TransactionClient } from './enqueue.js';
import type { Schema } from './schema.js';

export interface ImportedUsage {
  usageId: string;
  tenantId: string;
  eventName: string;
  quantity: number;
  /** Null: the transaction's time. */
  occurredAt: Date | null;
  key: string;
}

/** What became of each usage of a batch, in the batch's order. */
export interface InsertedUsage {
  tenantKnown: boolean;
  /** False when the usage was there already (or its tenant is unknown): nothing was written for it. */
  inserted: boolean;
}

/**
 * Writes each usage row and its outbox row, for a whole batch at once: the same rows as
 * insertUsage, and like it, no input raises an error (an unknown tenant inserts nothing, a
 * duplicate hits ON CONFLICT DO NOTHING), so one bad line never aborts its batch's transaction.
 * Outbox ids follow the batch's order, so the relay claims an imported file in its order.
 *
 * The batch's (tenant, usage id) pairs must be distinct (src/ops/import.ts sees to it): the join of
 * the inserted rows back to their places relies on it.
 *
 * Rejected alternative: recordUsage once per line. Correct, but one round trip per usage; at a
 * million lines the round trips are the import's whole cost (docs/performance.md has the figure).
 */
export async function insertUsages(db: TransactionClient, schema: Schema, usages: readonly ImportedUsage[]): Promise<InsertedUsage[]> {
  const rows = await callerRows<{ tenant_known: boolean; inserted: boolean }>(db, {
    name: schema.statementName('import-usages'),
    text: `WITH input AS (
       SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[], $5::timestamptz[], $6::text[]) WITH ORDINALITY
         AS i(usage_id, tenant_id, event_name, quantity, occurred_at, idempotency_key, n)
     ), known AS (
       SELECT i.* FROM input i WHERE EXISTS (SELECT 1 FROM ${schema.billingCustomers} c WHERE c.tenant_id = i.tenant_id)
     ), usage AS (
       INSERT INTO ${schema.usageLogs} (id, tenant_id, event_name, quantity, occurred_at)
       SELECT usage_id, tenant_id, event_name, quantity, COALESCE(occurred_at, now()) FROM known ORDER BY n
       ON CONFLICT (tenant_id, id) DO NOTHING
       RETURNING id, tenant_id, event_name, quantity, occurred_at
     ), queued AS (
       INSERT INTO ${schema.outbox} (tenant_id, usage_id, event_name, quantity, occurred_at, idempotency_key)
       SELECT u.tenant_id, u.id, u.event_name, u.quantity, u.occurred_at, k.idempotency_key
       FROM usage u JOIN known k ON k.tenant_id = u.tenant_id AND k.usage_id = u.id
       ORDER BY k.n
       -- No conflict target: whichever unique constraint a duplicate hits, nothing may raise here.
       ON CONFLICT DO NOTHING
       RETURNING tenant_id, usage_id
     )
     SELECT (k.n IS NOT NULL) AS tenant_known, (q.usage_id IS NOT NULL) AS inserted
     FROM input i
     LEFT JOIN known k ON k.n = i.n
     LEFT JOIN queued q ON q.tenant_id = i.tenant_id AND q.usage_id = i.usage_id
     ORDER BY i.n`,
    values: [
      usages.map((u) => u.usageId),
      usages.map((u) => u.tenantId),
      usages.map((u) => u.eventName),
      usages.map((u) => u.quantity),
      usages.map((u) => u.occurredAt),
      usages.map((u) => u.key),
    ],
  });
  return rows.map((r) => ({ tenantKnown: r.tenant_known, inserted: r.inserted }));
}

/** The outbox entries of the given (tenant, key) pairs that exist, in no particular order. */
export async function findEntriesByKeys(db: TransactionClient, schema: Schema, pairs: readonly { tenantId: string; key: string }[]): Promise<CallerEntryRow[]> {
  const rows = await callerRows<CallerEntryRow>(db, {
    text: `SELECT ${entryColumns('o.')}
     FROM ${schema.outbox} o
     JOIN unnest($1::text[], $2::text[]) AS k(tenant_id, idempotency_key)
       ON o.idempotency_key = k.idempotency_key AND o.tenant_id = k.tenant_id`,
    values: [pairs.map((p) => p.tenantId), pairs.map((p) => p.key)],
  });
  return rows;
}
