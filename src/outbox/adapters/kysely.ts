/**
 * recordUsage inside a Kysely transaction (PostgreSQL dialect):
 *
 *   await db.transaction().execute(async (trx) => {
 *     await trx.insertInto('jobs').values(job).execute();
 *     await recordUsage(fromKysely(trx), { tenantId, usageId: job.id, quantity: 1 });
 *   });
 *
 * The statements name billing-outbox's schema themselves (`{ schema }`, recordUsage's third
 * argument, default billing_outbox): the transaction's search_path is neither read nor changed.
 */
import { CompiledQuery, type Kysely } from 'kysely';
import type { TransactionClient } from '../sql/enqueue.js';

export function fromKysely(db: Pick<Kysely<never>, 'executeQuery'>): TransactionClient {
  return {
    async query({ text, values }) {
      return { rows: (await db.executeQuery(CompiledQuery.raw(text, values))).rows as unknown[] };
    },
  };
}
