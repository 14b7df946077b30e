/**
 * `npx tsx bench/usage-logs-size.ts`: what one usage costs `usage_logs` on disk (it is never pruned:
 * README, OUTBOX_RETENTION_DAYS). 1,000,000 usages of 100 tenants (`tenant-N`), UUID usage ids, the
 * default meter name, in an embedded PostgreSQL; heap and primary key, per row, after VACUUM.
 */
import { withMigratedDatabase } from './embedded-db.js';

await withMigratedDatabase('usage-logs-size', async (pool) => {
  await pool.query(`INSERT INTO billing_customers SELECT 'tenant-' || g, 'cus_' || g FROM generate_series(1, 100) g`);
  // Usage ids as an application's: a UUID each; tenant ids like 'tenant-42'; the default meter name.
  await pool.query(`INSERT INTO usage_logs (id, tenant_id, event_name, quantity, occurred_at)
    SELECT gen_random_uuid()::text, 'tenant-' || (1 + g % 100), 'api_requests', 1 + g % 1000, now() FROM generate_series(1, 1000000) g`);
  await pool.query('VACUUM ANALYZE usage_logs');
  const { rows } = await pool.query(`SELECT pg_relation_size('usage_logs') AS heap, pg_indexes_size('usage_logs') AS idx, pg_total_relation_size('usage_logs') AS total, (SELECT count(*) FROM usage_logs) AS n`);
  const r = rows[0];
  console.log(JSON.stringify({ rows: Number(r.n), heapBytesPerRow: Number(r.heap) / Number(r.n), indexBytesPerRow: Number(r.idx) / Number(r.n), totalBytesPerRow: Number(r.total) / Number(r.n) }));
});
