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
import { NotATransactionError } from '../errors.js';
import type { TransactionClient } from '../sql/enqueue.js';

export function fromKysely(db: Pick<Kysely<never>, 'executeQuery'>): TransactionClient {
  if ((db as { isTransaction?: unknown }).isTransaction === false) throw new NotATransactionError('a Kysely instance', 'the `trx` of db.transaction().execute(async (trx) => …)');
  return {
    async query({ text, values }) {
      return { rows: (await db.executeQuery(CompiledQuery.raw(text, values))).rows as unknown[] };
    },
  };
}
