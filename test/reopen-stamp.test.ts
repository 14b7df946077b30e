/**
 * A dead letter reopened with the time its closed run may have reached Stripe by (a backup from
 * before its attempts) is stamped as first attempted then under the identifier that attempt used:
 * with STRIPE_IDENTIFIER_NAMESPACE the namespaced one, or its next attempt would resend the bare
 * key, which Stripe never saw, and bill it twice.
 */
import { randomUUID } from 'node:crypto';
import { expect, it } from 'vitest';
import { storedIdentifier } from '../src/outbox/sql/delivery.js';
import { reopenDeadLetter } from '../src/outbox/sql/operator.js';
import { useDatabase } from './hooks.js';

const t = useDatabase({ customers: { acme: 'cus_acme' } });

async function deadLetter(firstAttemptedAt: Date | null): Promise<string> {
  const key = `reopen:${randomUUID()}`;
  await t.pool.query(
    `INSERT INTO outbox (tenant_id, event_name, quantity, occurred_at, idempotency_key, usage_id, status, dead_at, first_attempted_at, attempt_count, last_error_code, last_error_message)
     VALUES ('acme', 'api_requests', 1, now(), $1, $1, 'dead', now(), $2, CASE WHEN $2::timestamptz IS NULL THEN 0 ELSE 1 END, 'workflow_closed', 'test')`,
    [key, firstAttemptedAt],
  );
  return key;
}

const rowOf = async (key: string) => (await t.pool.query('SELECT first_attempted_at, attempt_count, stripe_identifier FROM outbox WHERE idempotency_key = $1', [key])).rows[0];

it('stamps a never-attempted row with the namespaced identifier its first attempt used; leaves one attempted before as it was', async () => {
  const reachedBy = new Date(Date.now() - 3_600_000);
  const never = await deadLetter(null);
  await reopenDeadLetter(t.pool, t.schema, never, reachedBy, storedIdentifier(never, 0, 'ns1'));
  expect(await rowOf(never)).toEqual({ first_attempted_at: reachedBy, attempt_count: 1, stripe_identifier: `ns1/${never}` });

  const before = new Date(Date.now() - 7_200_000);
  const attempted = await deadLetter(before);
  await reopenDeadLetter(t.pool, t.schema, attempted, reachedBy, storedIdentifier(attempted, 0, 'ns1'));
  // First attempted before any namespace was stamped on it: under the bare key, kept so.
  expect(await rowOf(attempted)).toEqual({ first_attempted_at: before, attempt_count: 1, stripe_identifier: null });

  // No namespace: the key itself, stored as null.
  const plain = await deadLetter(null);
  await reopenDeadLetter(t.pool, t.schema, plain, reachedBy, storedIdentifier(plain, 0, ''));
  expect((await rowOf(plain)).stripe_identifier).toBeNull();
});
