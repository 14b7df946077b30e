/**
 * Dead letters in the database. The dead mark reports the row's resend window to the workflow,
 * whose `retry` Update judges a retry by it: empty when no attempt reached Stripe (a missing
 * customer, a refused key: those attempts are taken back), the row's own time when one did, unknown
 * when the row was not made dead (then its status, when it is at Stripe). And a page of dead letters reads that page, not every dead row.
 */
import { randomUUID } from 'node:crypto';
import { expect, it } from 'vitest';
import { withTransaction } from '../src/db.js';
import { recordUsage } from '../src/outbox/enqueue.js';
import { beginAttempt, markDelivered, markRowDead, undoAttempt } from '../src/outbox/sql/delivery.js';
import { listDeadLetters } from '../src/outbox/sql/operator.js';
import { schemaFor } from '../src/outbox/sql/schema.js';
import { planOf } from './helpers.js';
import { useDatabase } from './hooks.js';

const t = useDatabase({ customers: { acme: 'cus_acme' } });
const schema = schemaFor();

const record = async () => (await withTransaction(t.pool, (c) => recordUsage(c, { usageId: randomUUID(), tenantId: 'acme', quantity: 1 }))).entry.idempotencyKey;
const begin = (key: string) => beginAttempt(t.pool, schema, key, { workflowId: key, safeWindowMs: 3_600_000, force: false });

it('reports no resend window for a row no attempt of which reached Stripe, and the row\'s own for one that did', async () => {
  const never = await record();
  expect(await markRowDead(t.pool, schema, never, 'customer_mapping_missing', 'no customer')).toEqual({ attempts: 0, firstAttemptedAt: null });

  const attempted = await record();
  await begin(attempted);
  const { rows } = await t.pool.query<{ ms: number }>('SELECT floor(extract(epoch FROM first_attempted_at) * 1000)::float8 AS ms FROM outbox WHERE idempotency_key = $1', [attempted]);
  expect(await markRowDead(t.pool, schema, attempted, 'http_500', 'Stripe answered 500')).toEqual({ attempts: 1, firstAttemptedAt: rows[0]!.ms });

  // Sent already (an attempt timed out whose call got through after all): not made dead, nothing
  // said about its window, and the run is told it is at Stripe.
  const sent = await record();
  const begun = await begin(sent);
  expect(await markDelivered(t.pool, schema, sent, 'sent', begun.row!.identifier_revision)).toEqual({ attempts: 1, first: true });
  // Marked again (another attempt's answer): still delivered, not delivered a second time.
  expect(await markDelivered(t.pool, schema, sent, 'sent', begun.row!.identifier_revision)).toEqual({ attempts: 1, first: false });
  expect(await markRowDead(t.pool, schema, sent, 'http_500', 'late')).toEqual({ attempts: 1, atStripe: 'sent' });
  expect((await t.pool.query('SELECT status FROM outbox WHERE idempotency_key = $1', [sent])).rows[0].status).toBe('sent');
});

it("an attempt taken back late (it outlived its timeout, and the next attempt has begun) keeps the first attempt's time: the resend guard and Stripe's error reports still find it", async () => {
  const key = await record();
  const first = await begin(key);
  const second = await begin(key);
  expect([first.row!.attempt_count, second.row!.attempt_count]).toEqual([1, 2]);
  const stamped = (await t.pool.query('SELECT first_attempted_at FROM outbox WHERE idempotency_key = $1', [key])).rows[0].first_attempted_at;
  await undoAttempt(t.pool, schema, key, { wasFirst: first.row!.attempt_count === 1 });
  const after = (await t.pool.query('SELECT attempt_count, first_attempted_at FROM outbox WHERE idempotency_key = $1', [key])).rows[0];
  expect(after).toEqual({ attempt_count: 1, first_attempted_at: stamped });
  // Taken back alone (the only attempt), the stamp goes with it: no call was made.
  const alone = await record();
  const only = await begin(alone);
  await undoAttempt(t.pool, schema, alone, { wasFirst: only.row!.attempt_count === 1 });
  expect((await t.pool.query('SELECT attempt_count, first_attempted_at FROM outbox WHERE idempotency_key = $1', [alone])).rows[0]).toEqual({ attempt_count: 0, first_attempted_at: null });
});

it('reads a page of dead letters from their own index, however many there are and however many were sent', async () => {
  await t.pool.query(
    `INSERT INTO outbox (tenant_id, event_name, quantity, occurred_at, idempotency_key, usage_id, status)
     SELECT 'acme', 'api_requests', 1, now(), 'bulk:' || g, 'bulk-' || g, CASE WHEN g % 2 = 0 THEN 'sent' ELSE 'dead' END FROM generate_series(1, 60000) g`,
  );
  await t.pool.query('ANALYZE outbox');
  // Exactly what `dead` and `retry --all-dead` send for a page deep in the list, planned by PostgreSQL.
  const plan = await planOf(t.pool, (capture) => listDeadLetters(capture, schema, { afterId: 30_000, limit: 500 }));
  expect(plan).toMatch(/Index Scan using outbox_dead_idx/);
  expect(plan).not.toMatch(/Sort|Seq Scan|Bitmap Heap Scan/);
});
