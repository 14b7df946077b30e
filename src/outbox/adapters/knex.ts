/**
 * recordUsage inside a Knex transaction (client `pg`):
 *
 *   await knex.transaction(async (trx) => {
 *     await trx('jobs').insert(job);
 *     await recordUsage(fromKnex(trx), { tenantId, usageId: job.id, quantity: 1 });
 *   });
 *
 * The statements name billing-outbox's schema themselves (`{ schema }`, recordUsage's third
 * argument, default billing_outbox): the transaction's search_path is neither read nor changed.
 */
import type { Knex } from 'knex';
import { NotATransactionError } from '../errors.js';
import type { TransactionClient } from '../sql/enqueue.js';

export function fromKnex(db: Pick<Knex, 'raw'>): TransactionClient {
  if ((db as { isTransaction?: unknown }).isTransaction !== true) throw new NotATransactionError('a Knex instance', 'the `trx` of knex.transaction(async (trx) => …)');
  return {
    async query({ text, values }) {
      // Knex binds `?` in order: each `$n` becomes one, with its value (a `$n` used twice, twice).
      const bindings: Knex.RawBinding[] = [];
      const positional = text.replace(/\$(\d+)/g, (_, n: string) => {
        bindings.push(values[Number(n) - 1] as Knex.RawBinding);
        return '?';
      });
      // The driver's result, or its rows alone where a postProcessResponse answers them.
      const result = (await db.raw(positional, bindings)) as { rows: unknown[] } | unknown[];
      return { rows: Array.isArray(result) ? result : result.rows };
    },
  };
}
