import { spawn } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import path from 'node:path';
import pg from 'pg';
import { afterAll, expect, inject, it } from 'vitest';
import { recordUsage } from '../src/outbox/enqueue.js';
import { applyMigrations, createPool, migrate, withTransaction } from '../src/db.js';
import { mapTenant } from '../src/ops/customers.js';
import { databaseUrlFor, waitFor, withSearchPath } from './helpers.js';
import { schemaFor } from '../src/outbox/sql/schema.js';

const name = `bo_migrate_${randomUUID().replace(/-/g, '').slice(0, 10)}`;

/**
 * Migrations as the next version would ship them, applied on top of this version's schema: the
 * runner's rules (an index built CONCURRENTLY, a column added in a short transaction) tried on
 * files that change a live outbox, as this version's own single file never does.
 */
const NEXT = path.join(import.meta.dirname, 'fixtures', 'migrations-next');
const NEXT_FILES = ['900_next_index.sql', '901_next_column.sql'];

afterAll(async () => {
  const admin = new pg.Client({ connectionString: inject('adminDatabaseUrl') });
  await admin.connect();
  await admin.query(`DROP DATABASE IF EXISTS ${name} WITH (FORCE)`);
  await admin.end();
});

function runMigrate(url: string, env: Record<string, string> = {}): Promise<{ code: number | null; out: string }> {
  return new Promise((resolve) => {
    const child = spawn('npm', ['run', '--silent', 'migrate'], { env: { ...process.env, DATABASE_URL: url, ...env } });
    let out = '';
    child.stdout.on('data', (b: Buffer) => (out += b.toString()));
    child.stderr.on('data', (b: Buffer) => (out += b.toString()));
    child.on('exit', (code) => resolve({ code, out }));
  });
}

it('npm run migrate is safe when several processes migrate at once', async () => {
  const admin = new pg.Client({ connectionString: inject('adminDatabaseUrl') });
  await admin.connect();
  await admin.query(`CREATE DATABASE ${name}`);
  await admin.end();
  const url = databaseUrlFor(name);

  // One as a deployment runs it (the image's NODE_ENV=production), with no Stripe key or Temporal
  // certificate: migrate needs the database alone.
  const results = await Promise.all([runMigrate(url), runMigrate(url), runMigrate(url, { NODE_ENV: 'production', STRIPE_API_KEY: '' })]);
  for (const r of results) expect(r.code, r.out).toBe(0);
  // Exactly one process applied the migrations; the others found nothing left to do.
  expect(results.filter((r) => r.out.includes('applied 001_schema.sql'))).toHaveLength(1);
  // The password never reaches the output.
  for (const r of results) expect(r.out).not.toContain(new URL(url).password);

  const c = new pg.Client({ connectionString: withSearchPath(url, schemaFor().name) });
  await c.connect();
  const { rows } = await c.query('SELECT name FROM schema_migrations ORDER BY name');
  await c.end();
  expect(rows.map((r: { name: string }) => r.name)[0]).toBe('001_schema.sql');
}, 60_000);

it("a role that may use the schema's tables but not create in it (the API's, the workers' under least privilege) finds nothing to migrate and starts", async () => {
  const url = databaseUrlFor(name);
  const role = `bo_rw_${randomUUID().replace(/-/g, '').slice(0, 8)}`;
  const owner = new pg.Client({ connectionString: url });
  await owner.connect();
  const schema = schemaFor().quoted;
  await owner.query(`CREATE ROLE ${role} LOGIN PASSWORD 'p'`);
  await owner.query(`GRANT USAGE ON SCHEMA ${schema} TO ${role}`);
  await owner.query(`GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA ${schema} TO ${role}`);
  await owner.query(`GRANT USAGE ON ALL SEQUENCES IN SCHEMA ${schema} TO ${role}`);
  await owner.end();
  const ownerPool = createPool(url, 1);
  await mapTenant(ownerPool, schemaFor(), 'least', 'cus_least', 'test');
  await ownerPool.end();
  const asRole = new URL(url);
  asRole.username = role;
  asRole.password = 'p';
  expect(await migrate(asRole.toString())).toEqual([]);
  // The grants docs/operations.md names are enough to record usage.
  const pool = createPool(asRole.toString(), 1);
  try {
    const recorded = await withTransaction(pool, (c) => recordUsage(c, { usageId: 'least-1', tenantId: 'least', quantity: 2 }));
    expect(recorded.created).toBe(true);
  } finally {
    await pool.end();
  }
}, 60_000);

it('refuses a database that is not UTF-8, naming its encoding, and creates nothing in it', async () => {
  const ascii = `${name}_ascii`;
  const admin = new pg.Client({ connectionString: inject('adminDatabaseUrl') });
  await admin.connect();
  try {
    await admin.query(`CREATE DATABASE ${ascii} ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0`);
    const url = databaseUrlFor(ascii);
    await expect(migrate(url)).rejects.toThrow(/uses the encoding SQL_ASCII; billing-outbox needs UTF8/);
    const c = new pg.Client({ connectionString: url });
    await c.connect();
    const { rows } = await c.query(`SELECT 1 FROM pg_namespace WHERE nspname = $1`, [schemaFor().name]);
    await c.end();
    expect(rows).toEqual([]);
  } finally {
    await admin.query(`DROP DATABASE IF EXISTS ${ascii} WITH (FORCE)`);
    await admin.end();
  }
});

it('npm run migrate without DATABASE_URL fails with a clear message', async () => {
  const env = { ...process.env };
  delete env.DATABASE_URL;
  const r = await new Promise<{ code: number | null; out: string }>((resolve) => {
    const child = spawn('npm', ['run', '--silent', 'migrate'], { env });
    let out = '';
    child.stderr.on('data', (b: Buffer) => (out += b.toString()));
    child.on('exit', (code) => resolve({ code, out }));
  });
  expect(r.code).not.toBe(0);
  expect(r.out).toMatch(/DATABASE_URL: is not set/);
});

it("migrate() from an application whose DATABASE_URL is unset or empty says so, not a driver's TypeError", async () => {
  for (const missing of [undefined, '', null]) {
    await expect(migrate(missing as unknown as string)).rejects.toThrow(/migrate needs a PostgreSQL connection string .*is DATABASE_URL set\?/);
  }
});

it('a migration leaves recordUsage writing while it builds an index over a big outbox and adds a column', async () => {
  // MIGRATE_TEST_ROWS=1000000 for the full-size run (docs/operations.md quotes it).
  const rowCount = Number(process.env.MIGRATE_TEST_ROWS ?? 200_000);
  const big = `bo_migrate_online_${randomUUID().replace(/-/g, '').slice(0, 8)}`;
  const admin = new pg.Client({ connectionString: inject('adminDatabaseUrl') });
  await admin.connect();
  await admin.query(`CREATE DATABASE ${big}`);
  await admin.end();
  const url = databaseUrlFor(big);
  const pool = createPool(withSearchPath(url, schemaFor().name), 4);
  try {
    await migrate(url);
    await mapTenant(pool, schemaFor(), 'acme', 'cus_acme', 'test');
    // A delivered history: what a long-running deployment's outbox holds.
    await pool.query(
      `INSERT INTO outbox (tenant_id, usage_id, event_name, quantity, occurred_at, idempotency_key, status, sent_at)
       SELECT 'acme', 'old-' || g, 'api_requests', 1, now() - interval '1 day', 'u:acme:old-' || g, 'sent', now()
         FROM generate_series(1, $1::int) AS g`,
      [rowCount],
    );
    await pool.query('VACUUM ANALYZE outbox');

    // Usage recorded one transaction after another for as long as the migration runs.
    const latencies: { startedAt: number; ms: number }[] = [];
    let migrating = true;
    const recorder = (async () => {
      for (let i = 0; migrating; i++) {
        const startedAt = performance.now();
        await withTransaction(pool, (c) => recordUsage(c, { usageId: `during-${i}`, tenantId: 'acme', quantity: 1 }));
        latencies.push({ startedAt, ms: performance.now() - startedAt });
      }
    })();
    const started = performance.now();
    const applied = await applyMigrations(url, NEXT);
    const took = performance.now() - started;
    migrating = false;
    await recorder;

    // The index is built concurrently, the column added with no default (no rewrite): both must
    // leave the inserts running.
    expect(applied).toEqual(NEXT_FILES);
    // Every recording that overlapped the migration, blocked ones included.
    const during = latencies.filter((l) => l.startedAt < started + took && l.startedAt + l.ms > started);
    const slowest = Math.max(...during.map((l) => l.ms));
    console.log(`migrate over ${rowCount} rows: ${Math.round(took)} ms; ${during.length} usages recorded meanwhile, slowest ${slowest.toFixed(1)} ms`);
    // Writes went on: commits all through the migration, none held for a large part of it (a
    // transactional CREATE INDEX holds a SHARE lock: an insert waits for the whole build).
    expect(during.length).toBeGreaterThanOrEqual(5);
    expect(slowest).toBeLessThan(took / 2);

    // The index stands, valid, and serves the statements it was made for.
    const { rows: indexes } = await pool.query<{ name: string; valid: boolean }>(
      `SELECT c.relname AS name, i.indisvalid AS valid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE c.relname = 'outbox_next_idx'`,
    );
    expect(indexes).toEqual([{ name: 'outbox_next_idx', valid: true }]);
    const plan = (await pool.query(`EXPLAIN SELECT idempotency_key FROM outbox WHERE created_at < now() - interval '1 day'`)).rows
      .map((r: Record<string, string>) => r['QUERY PLAN'])
      .join('\n');
    expect(plan).toContain('outbox_next_idx');
  } finally {
    await pool.end();
    const a = new pg.Client({ connectionString: inject('adminDatabaseUrl') });
    await a.connect();
    await a.query(`DROP DATABASE IF EXISTS ${big} WITH (FORCE)`);
    await a.end();
  }
}, 300_000);

/** A database of its own, migrated to this version's schema, dropped after `fn`. */
async function withDatabase(fn: (url: string) => Promise<void>): Promise<void> {
  const db = `bo_migrate_wait_${randomUUID().replace(/-/g, '').slice(0, 8)}`;
  const admin = new pg.Client({ connectionString: inject('adminDatabaseUrl') });
  await admin.connect();
  await admin.query(`CREATE DATABASE ${db}`);
  try {
    const url = databaseUrlFor(db);
    await migrate(url);
    await fn(url);
  } finally {
    await admin.query(`DROP DATABASE IF EXISTS ${db} WITH (FORCE)`);
    await admin.end();
  }
}

it("a migration that cannot lock the outbox (a long transaction reads it) lets the application's inserts through while it waits, says who holds it, and applies after", async () => {
  await withDatabase(async (url) => {
    const pool = createPool(withSearchPath(url, schemaFor().name), 4);
    const reader = new pg.Client({ connectionString: withSearchPath(url, schemaFor().name) });
    await reader.connect();
    try {
      await mapTenant(pool, schemaFor(), 'acme', 'cus_acme', 'test');
      await reader.query('BEGIN');
      // Its text holds a literal the application would not want in a log: only the first word is said.
      await reader.query("SELECT count(*) FROM outbox WHERE tenant_id <> 'sk_live_notforthelog'");
      const readerPid = (await reader.query<{ pid: number }>('SELECT pg_backend_pid() AS pid')).rows[0]!.pid;
      const said: string[] = [];
      const migrating = applyMigrations(url, NEXT, { onWait: (m) => said.push(m) });
      // 901 adds a column to the outbox: it needs the table to itself, and the reader holds it.
      const until = Date.now() + 6_000;
      let recorded = 0;
      while (Date.now() < until) {
        await withTransaction(pool, (c) => recordUsage(c, { usageId: `while-${recorded}`, tenantId: 'acme', quantity: 1 }));
        recorded++;
      }
      // Queued behind the migration for good, not one would have been recorded until the reader ended.
      expect(recorded).toBeGreaterThanOrEqual(3);
      expect(said[0]).toMatch(new RegExp(`^901_next_column\\.sql cannot lock its tables yet \\(held by pid ${readerPid} \\(.*, idle in transaction, last statement SELECT\\)`));
      expect(said.join('\n')).not.toContain('notforthelog');
      await reader.query('COMMIT');
      expect(await migrating).toEqual(NEXT_FILES);
    } finally {
      await reader.end();
      await pool.end();
    }
  });
}, 60_000);

it("an index built CONCURRENTLY waiting for an application's open transaction that recorded usage says within seconds whom it waits for", async () => {
  await withDatabase(async (url) => {
    const pool = createPool(withSearchPath(url, schemaFor().name), 2);
    // The application's own session lifts the limits at connection (a SET run under the database's
    // 1 ms limit could itself be cancelled on a busy machine, and its COMMIT waits its turn to notify).
    const appUrl = new URL(url);
    appUrl.searchParams.set('options', `-c search_path=${schemaFor().name} -c statement_timeout=0 -c lock_timeout=0`);
    const app = new pg.Client({ connectionString: appUrl.toString() });
    await app.connect();
    try {
      await mapTenant(pool, schemaFor(), 'acme', 'cus_acme', 'test');
      await app.query('BEGIN');
      await recordUsage(app, { usageId: 'open-1', tenantId: 'acme', quantity: 1 });
      const appPid = (await app.query<{ pid: number }>('SELECT pg_backend_pid() AS pid')).rows[0]!.pid;
      const said: string[] = [];
      const migrating = applyMigrations(url, NEXT, { onWait: (m) => said.push(m) });
      await waitFor('the migration to say whom it waits for', async () => said.length > 0 || undefined, 5_000);
      expect(said[0]).toMatch(new RegExp(`^900_next_index\\.sql is still running "CREATE INDEX CONCURRENTLY.*waiting for pid ${appPid} `));
      // A second migrator meanwhile (workers starting together) waits its turn without a snapshot
      // the index build would wait for in turn (a deadlock), and then finds nothing to do.
      const saidSecond: string[] = [];
      const second = applyMigrations(url, NEXT, { onWait: (m) => saidSecond.push(m) });
      await waitFor('the second migrator to wait for the first', async () => saidSecond.length > 0 || undefined, 20_000);
      expect(saidSecond[0]).toMatch(/^another migrator holds the migration lock/);
      await new Promise((resolve) => setTimeout(resolve, 500));
      await app.query('COMMIT');
      expect(await migrating).toEqual(NEXT_FILES);
      expect(await second).toEqual([]);
    } finally {
      await app.end();
      await pool.end();
    }
  });
}, 60_000);

it('a migrator waiting for another says who holds the migration lock', async () => {
  await withDatabase(async (url) => {
    const other = new pg.Client({ connectionString: url, application_name: 'the-other-migrator' });
    await other.connect();
    try {
      await other.query('SELECT pg_advisory_lock(727274001)');
      const said: string[] = [];
      const migrating = migrate(url, { onWait: (m) => said.push(m) });
      await new Promise((resolve) => setTimeout(resolve, 500));
      expect(said).toHaveLength(1);
      expect(said[0]).toMatch(/^another migrator holds the migration lock \(pid \d+, the-other-migrator, connected since /);
      await other.query('SELECT pg_advisory_unlock(727274001)');
      expect(await migrating).toEqual([]);
    } finally {
      await other.end();
    }
  });
}, 60_000);

it("runs past the application's own time limits (a pool's statement_timeout, the database's statement_timeout and lock_timeout): an index built CONCURRENTLY waits for an open transaction, and is not cancelled", async () => {
  await withDatabase(async (url) => {
    const db = decodeURIComponent(new URL(url).pathname.slice(1));
    const pool = createPool(withSearchPath(url, schemaFor().name), 1);
    await mapTenant(pool, schemaFor(), 'acme', 'cus_acme', 'test');
    await pool.end();
    const admin = new pg.Client({ connectionString: inject('adminDatabaseUrl') });
    await admin.connect();
    // The application's own session lifts the limits at connection (a SET run under the database's
    // 1 ms limit could itself be cancelled on a busy machine, and its COMMIT waits its turn to notify).
    const appUrl = new URL(url);
    appUrl.searchParams.set('options', `-c search_path=${schemaFor().name} -c statement_timeout=0 -c lock_timeout=0`);
    const app = new pg.Client({ connectionString: appUrl.toString() });
    try {
      // Limits meant for requests, on every session of the database from now on.
      await admin.query(`ALTER DATABASE ${db} SET lock_timeout = '1ms'`);
      await admin.query(`ALTER DATABASE ${db} SET statement_timeout = '1ms'`);
      // An application's transaction that recorded usage: the index build waits for it a moment.
      await app.connect();
      await app.query('BEGIN');
      await recordUsage(app, { usageId: 'open-1', tenantId: 'acme', quantity: 1 });
      const ending = new Promise((resolve) => setTimeout(resolve, 300)).then(() => app.query('COMMIT'));
      // As an application's pool is set up for requests, and handed to migrate as pool.options.
      const applied = await applyMigrations({ connectionString: url, statement_timeout: 1, query_timeout: 1 }, NEXT);
      await ending;
      expect(applied).toEqual(NEXT_FILES);
    } finally {
      await app.end();
      await admin.end();
    }
  });
}, 60_000);
