/**
 * recordUsage through a pooler that cannot keep named prepared statements: PgBouncer before 1.21, or
 * 1.21+ with `max_prepared_statements = 0`, in transaction (or statement) pooling.
 *
 *   await recordUsage(withoutPreparedStatements(client), { tenantId, usageId: job.id, quantity: 1 });
 *
 * Why it is needed: recordUsage names its statement so that node-postgres prepares it once per
 * connection. node-postgres remembers that per connection to the pooler, but the pooler hands each
 * transaction any server connection: the next transaction's Bind reaches a server that never saw
 * the Parse ("prepared statement … does not exist"), or a second client's Parse reaches one that
 * already has it ("… already exists"). Unnamed, each statement is parsed in its own transaction,
 * which a transaction pooler keeps on one server connection. The Kysely, Drizzle, Knex and Prisma
 * adapters never name statements and need none of this.
 */
import { refuseOutsideTransaction } from '../errors.js';
import type { TransactionClient } from '../sql/enqueue.js';

/**
 * Each statement through it is refused (NotATransactionError) when what it wraps is a pool or a
 * client outside a transaction, as recordUsage would refuse them: the wrapper hides what it wraps.
 * Checked per statement, not when wrapped: a client may be wrapped before its BEGIN.
 */
export function withoutPreparedStatements(client: TransactionClient): TransactionClient {
  return {
    query: async ({ text, values }) => {
      refuseOutsideTransaction(client);
      return client.query({ text, values });
    },
  };
}
