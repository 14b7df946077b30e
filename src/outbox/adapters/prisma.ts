/**
 * recordUsage inside a Prisma interactive transaction (Prisma 6.16+ / 7 with a PostgreSQL driver
 * adapter such as @prisma/adapter-pg):
 *
 *   await prisma.$transaction(async (tx) => {
 *     await tx.job.create({ data: job });
 *     await recordUsage(fromPrisma(tx), { tenantId, usageId: job.id, quantity: 1 });
 *   });
 *
 * Nothing of Prisma is imported: any transaction client with `$queryRawUnsafe` fits (the client
 * itself is refused: each statement on it would commit on its own).
 */
import { NotATransactionError } from '../errors.js';
import type { TransactionClient } from '../sql/enqueue.js';

export function fromPrisma(db: { $queryRawUnsafe(query: string, ...values: unknown[]): PromiseLike<unknown> }): TransactionClient {
  // The client itself connects; the one an interactive transaction hands over has no $connect.
  if (typeof (db as { $connect?: unknown }).$connect === 'function') throw new NotATransactionError('a Prisma client', 'the `tx` of prisma.$transaction(async (tx) => …)');
  return {
    async query({ text, values }) {
      // Prisma binds `$n` itself and answers the rows, bigint columns as BigInt (recordUsage reads
      // numbers with Number(), which takes those). A Date goes as ISO text with its zone:
      // @prisma/adapter-pg sends a Date as UTC wall-clock time without one, which PostgreSQL reads
      // in the session's TimeZone (on a server not set to UTC, usage would be stored hours off).
      return { rows: (await db.$queryRawUnsafe(text, ...values.map(withZone))) as unknown[] };
    },
  };
}

function withZone(value: unknown): unknown {
  if (value instanceof Date) return value.toISOString();
  return Array.isArray(value) ? value.map(withZone) : value;
}
