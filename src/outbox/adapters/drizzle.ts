/**
 * recordUsage inside a Drizzle transaction (node-postgres or postgres.js driver):
 *
 *   await db.transaction(async (tx) => {
 *     await tx.insert(jobs).values(job);
 *     await recordUsage(fromDrizzle(tx), { tenantId, usageId: job.id, quantity: 1 });
 *   });
 *
 * The statements name billing-outbox's schema themselves (`{ schema }`, recordUsage's third
 * argument, default billing_outbox): the transaction's search_path is neither read nor changed.
 */
import { Param, sql, type SQL } from 'drizzle-orm';
import { NotATransactionError } from '../errors.js';
import type { TransactionClient } from '../sql/enqueue.js';

/** The statement as Drizzle SQL: the text between placeholders raw, each `$n` its value as a parameter. */
function toDrizzleSql(text: string, values: unknown[]): SQL {
  const chunks = text.split(/\$(\d+)/);
  return sql.join(chunks.map((chunk, i) => (i % 2 === 0 ? sql.raw(chunk) : new Param(withZone(values[Number(chunk) - 1])))));
}

/**
 * A Date as ISO text with its zone (the statements cast it: `$5::timestamptz`). Drizzle's postgres.js
 * driver replaces postgres.js's timestamp serializers with ones that pass a value through as it is,
 * and postgres.js cannot send a Date as it is: every usage with an occurredAt failed, and with it the
 * caller's transaction.
 */
function withZone(value: unknown): unknown {
  return value instanceof Date ? value.toISOString() : value;
}

export function fromDrizzle(db: { execute(query: SQL): PromiseLike<unknown> }): TransactionClient {
  // A transaction (PgTransaction) can roll itself back; the database object cannot.
  if (typeof (db as { rollback?: unknown }).rollback !== 'function') throw new NotATransactionError('a Drizzle database', 'the `tx` of db.transaction(async (tx) => …)');
  return {
    async query({ text, values }) {
      const result = await db.execute(toDrizzleSql(text, values));
      // node-postgres answers a QueryResult, postgres.js the rows themselves.
      return { rows: Array.isArray(result) ? result : (result as { rows: unknown[] }).rows };
    },
  };
}
