/**
 * The pool our processes use survives PostgreSQL cutting its connections, including a connection
 * checked out in the middle of a transaction (whose 'error' event would otherwise end the process).
 */
import net, { type Socket } from 'node:net';
import pg from 'pg';
import { afterAll, beforeAll, expect, inject, it } from 'vitest';
import { answeredWithin, CLOSE_WAIT_MS, CONNECT_WAIT_MS, connectionLost, createPool, isDatabaseUnavailable, withPgTypes, withTransaction } from '../src/db.js';
import { freePort } from '../src/embedded/postgres.js';
import { cleanUpAway, failingOver } from './away.js';
import { useDatabase, waitFor } from './hooks.js';

const t = useDatabase();
let admin: pg.Client;

beforeAll(async () => {
  admin = new pg.Client({ connectionString: inject('adminDatabaseUrl') });
  await admin.connect();
});

afterAll(async () => {
  await admin?.end();
});

/**
 * Ends `client`'s backend at the server while no query of it runs, and returns what its next query
 * fails with. The server's goodbye arrives as an 'error' event on the client: an unhandled one
 * would fail this run.
 */
async function cutUnderneath(client: Pick<pg.PoolClient, 'query'>): Promise<unknown> {
  const { rows } = await client.query<{ pid: number }>('SELECT pg_backend_pid() AS pid');
  await admin.query('SELECT pg_terminate_backend($1)', [rows[0]!.pid]);
  await waitFor('the backend gone', async () => (await admin.query('SELECT 1 FROM pg_stat_activity WHERE pid = $1', [rows[0]!.pid])).rowCount === 0);
  // The backend is gone; its socket's close reaches this process a moment later, with nothing to
  // await for it (pg has no public event for it): the next query must find the client broken.
  await new Promise((r) => setTimeout(r, 200));
  return client.query('SELECT 1').then(() => undefined, (e: unknown) => e);
}

it('a connection cut between two queries of a transaction fails that transaction, not the process', async () => {
  const pool = createPool(t.db.url, 2);
  try {
    const client = await pool.connect();
    await client.query('BEGIN');
    const next = await cutUnderneath(client);
    expect(isDatabaseUnavailable(next)).toBe(true);
    client.release();
    // The pool dropped the broken client and opens a new one.
    expect((await pool.query<{ ok: number }>('SELECT 1 AS ok')).rows).toEqual([{ ok: 1 }]);
  } finally {
    await pool.end();
  }
});

it("the same through an application's own pool (withPgTypes), whose clients pg-pool lends without an 'error' listener: the transaction fails, not the process", async () => {
  const pool = withPgTypes(new pg.Pool({ connectionString: t.db.url, max: 2 }));
  try {
    const client = await pool.connect();
    const next = await cutUnderneath(client);
    expect(isDatabaseUnavailable(next)).toBe(true);
    client.release(next as Error);
    // Our listener went with it: the application's pool's clients are as pg-pool keeps them.
    const again = await pool.connect();
    expect((again as unknown as pg.Client).listenerCount('error')).toBe(1);
    again.release();
    expect((await pool.query<{ ok: number }>('SELECT 1 AS ok')).rows).toEqual([{ ok: 1 }]);
  } finally {
    await pool.end();
  }
});

it("reads timestamps as pg ships them, whatever the application set in pg.types (timestamps kept as text, say)", async () => {
  const TIMESTAMPTZ = pg.types.builtins.TIMESTAMPTZ;
  const before = pg.types.getTypeParser(TIMESTAMPTZ);
  pg.types.setTypeParser(TIMESTAMPTZ, (v: string) => v);
  const ours = createPool(t.db.url, 1);
  const theirs = new pg.Pool({ connectionString: t.db.url, max: 1 });
  try {
    const read = async (db: Pick<pg.Pool, 'query'>) => (await db.query<{ at: unknown }>('SELECT now() AS at')).rows[0]!.at;
    expect(await read(ours)).toBeInstanceOf(Date);
    expect(await read(withPgTypes(theirs))).toBeInstanceOf(Date);
    // The application's own queries read what it asked for.
    expect(typeof (await read(theirs))).toBe('string');
  } finally {
    pg.types.setTypeParser(TIMESTAMPTZ, before);
    await ours.end();
    await theirs.end();
  }
});

it('takes overload for "not now": a statement timeout, a lock timeout, a deadlock, a serialization failure, too many connections', async () => {
  const pool = createPool(t.db.url, 4);
  const errorOf = (p: Promise<unknown>) => p.then(() => undefined, (e: unknown) => e as { code: string });
  try {
    const timeout = await errorOf(pool.query(`SET statement_timeout = 10; SELECT pg_sleep(1)`));
    await pool.query('CREATE TABLE IF NOT EXISTS overload_probe (id int PRIMARY KEY, v int)');
    await pool.query('INSERT INTO overload_probe VALUES (1, 0), (2, 0) ON CONFLICT DO NOTHING');

    const a = await pool.connect();
    const b = await pool.connect();
    let lock: unknown;
    let deadlock: unknown;
    let serialization: unknown;
    try {
      await a.query('BEGIN');
      await a.query('UPDATE overload_probe SET v = v + 1 WHERE id = 1');
      lock = await errorOf(b.query(`SET lock_timeout = 10; UPDATE overload_probe SET v = v + 1 WHERE id = 1`));
      await b.query('ROLLBACK').catch(() => undefined);
      await b.query('SET lock_timeout = 0');
      // Each holds one row and asks for the other's.
      await b.query('BEGIN');
      await b.query('UPDATE overload_probe SET v = v + 1 WHERE id = 2');
      const first = errorOf(a.query('UPDATE overload_probe SET v = v + 1 WHERE id = 2'));
      const second = errorOf(b.query('UPDATE overload_probe SET v = v + 1 WHERE id = 1'));
      deadlock = (await first) ?? (await second);
      await a.query('ROLLBACK');
      await b.query('ROLLBACK');
      // Two serializable transactions that each read what the other writes.
      await a.query('BEGIN ISOLATION LEVEL SERIALIZABLE');
      await b.query('BEGIN ISOLATION LEVEL SERIALIZABLE');
      await a.query('SELECT sum(v) FROM overload_probe');
      await b.query('SELECT sum(v) FROM overload_probe');
      await a.query('UPDATE overload_probe SET v = v + 1 WHERE id = 1');
      await b.query('UPDATE overload_probe SET v = v + 1 WHERE id = 2');
      await a.query('COMMIT');
      serialization = await errorOf(b.query('COMMIT'));
    } finally {
      await a.query('ROLLBACK').catch(() => undefined);
      await b.query('ROLLBACK').catch(() => undefined);
      a.release();
      b.release();
    }

    // A role allowed one connection, asked for a second.
    const role = `overload_${Math.random().toString(36).slice(2, 8)}`;
    await admin.query(`CREATE ROLE ${role} LOGIN PASSWORD 'p' CONNECTION LIMIT 1`);
    const url = new URL(t.db.url);
    url.username = role;
    url.password = 'p';
    const one = new pg.Client({ connectionString: url.toString() });
    await one.connect();
    const two = new pg.Client({ connectionString: url.toString() });
    const tooMany = await errorOf(two.connect());
    await one.end();

    const codes = [timeout, lock, deadlock, serialization, tooMany].map((e) => (e as { code?: string } | undefined)?.code);
    expect(codes).toEqual(['57014', '55P03', '40P01', '40001', '53300']);
    for (const e of [timeout, lock, deadlock, serialization, tooMany]) expect(isDatabaseUnavailable(e)).toBe(true);
    // Overloaded, not gone: the connection is rolled back and lent out again, not dropped.
    for (const e of [timeout, lock, deadlock, serialization]) expect(connectionLost(e)).toBe(false);

    // A read-only server (a standby reached during a failover, a managed server that turned itself
    // read-only): not now, rather than never.
    const readOnly = new URL(t.db.url);
    readOnly.searchParams.set('options', '-c default_transaction_read_only=on');
    const standby = new pg.Client({ connectionString: readOnly.toString() });
    await standby.connect();
    const refused = await errorOf(standby.query('INSERT INTO overload_probe VALUES (3, 0)'));
    await standby.end();
    expect((refused as { code?: string }).code).toBe('25006');
    expect(isDatabaseUnavailable(refused)).toBe(true);

    // A statement that is wrong stays wrong: a duplicate key, a syntax error.
    expect(isDatabaseUnavailable(await errorOf(pool.query('INSERT INTO overload_probe VALUES (1, 0)')))).toBe(false);
    expect(isDatabaseUnavailable(await errorOf(pool.query('SELEC 1')))).toBe(false);
  } finally {
    await pool.end();
  }
});

it('answeredWithin: a statement unanswered in time fails as PostgreSQL away, and the pool drops its connection', async () => {
  const pool = createPool(t.db.url, 1);
  try {
    const db = answeredWithin(pool, 300);
    const pid = async () => (await db.query<{ pid: number }>('SELECT pg_backend_pid() AS pid')).rows[0]!.pid;
    const first = await pid();
    // A connection that stops answering, as far as this process can tell.
    const unanswered = await db.query('SELECT pg_sleep(3)').then(() => undefined, (e: unknown) => e);
    expect(unanswered).toMatchObject({ message: 'Query read timeout' });
    expect(isDatabaseUnavailable(unanswered)).toBe(true);
    expect(connectionLost(unanswered)).toBe(true);
    // The pool's only connection went with it: the next statement runs on a new one at once,
    // not behind the unanswered one.
    expect(await pid()).not.toBe(first);
  } finally {
    await pool.end();
  }
});

it('waitMs: a caller with no free connection in time fails as PostgreSQL unavailable (a delivery then waits without spending an attempt), and the pool goes on', async () => {
  const pool = createPool(t.db.url, 1, { waitMs: 300 });
  try {
    const held = await pool.connect();
    const started = Date.now();
    const waited = await pool.query('SELECT 1').then(() => undefined, (e: unknown) => e);
    expect(Date.now() - started).toBeGreaterThanOrEqual(250);
    expect(isDatabaseUnavailable(waited)).toBe(true);
    // No connection was lost: none is dropped for it.
    expect(connectionLost(waited)).toBe(false);
    held.release();
    expect((await pool.query<{ one: number }>('SELECT 1 AS one')).rows).toEqual([{ one: 1 }]);
  } finally {
    await pool.end();
  }
  // A pool its owner ended first (an application stopping before its worker): unavailable, not the statement's fault.
  expect(isDatabaseUnavailable(await pool.query('SELECT 1').then(() => undefined, (e: unknown) => e))).toBe(true);

  // The same on an application's pool, which has no connectionTimeoutMillis of its own.
  const theirs = new pg.Pool({ connectionString: t.db.url, max: 1 });
  const bounded = withPgTypes(theirs, { waitMs: 300 });
  try {
    const held = await bounded.connect();
    const waited = await Promise.all([bounded.query('SELECT 1'), bounded.connect()].map((p) => p.then(() => undefined, (e: unknown) => e)));
    for (const e of waited) expect(isDatabaseUnavailable(e)).toBe(true);
    held.release();
    // The waits given up on took nothing with them: the one connection serves the next caller.
    expect((await bounded.query<{ one: number }>('SELECT 1 AS one')).rows).toEqual([{ one: 1 }]);
    expect(theirs.idleCount + theirs.waitingCount).toBe(1);
  } finally {
    await theirs.end();
  }
});

it('a statement given up on while it waits for a lock (behind a migration) is cancelled at the server, not left to queue and commit later', async () => {
  const pool = createPool(t.db.url, 2);
  const holder = new pg.Client({ connectionString: t.db.url });
  await holder.connect();
  try {
    await holder.query('CREATE TABLE IF NOT EXISTS lock_probe (n int)');
    await holder.query('BEGIN');
    await holder.query('LOCK TABLE lock_probe IN ACCESS EXCLUSIVE MODE');
    const db = answeredWithin(pool, 300);
    const given = await db.query(`UPDATE lock_probe SET n = n WHERE n = 0 /* given-up */`).then(() => undefined, (e: unknown) => e);
    expect(given).toMatchObject({ message: 'Query read timeout' });
    // Without the cancel, its session would wait here for the lock as long as the holder keeps it.
    const waiting = () =>
      admin.query(`SELECT count(*)::int AS n FROM pg_stat_activity WHERE query LIKE '%given-up%' AND pid <> pg_backend_pid() AND wait_event_type = 'Lock'`);
    await waitFor('the given-up statement to leave the lock queue', async () => (await waiting()).rows[0]!.n === 0, 5_000);
  } finally {
    await holder.query('ROLLBACK').catch(() => undefined);
    await holder.end();
    await pool.end();
  }
});

it('a pool ending connections gone silent destroys their sockets instead of leaving them half-closed for good', async () => {
  const proxy = await failingOver(t.db.url);
  const pool = createPool(proxy.url, 3);
  const sockets: Socket[] = [];
  pool.on('remove', (client) => sockets.push((client as unknown as { connection: { stream: Socket } }).connection.stream));
  try {
    // Three connections opened, then idle in the pool, then silent: the server's goodbye never comes.
    await Promise.all([1, 2, 3].map(() => pool.query('SELECT pg_sleep(0.05)')));
    proxy.failOver();
    expect(proxy.silenced()).toBe(3);
    await pool.end();
    // Ended politely first (pg asks the server to close, and waits), destroyed CLOSE_WAIT_MS later.
    await waitFor('every connection gone', async () => sockets.length === 3 && sockets.every((s) => s.destroyed), CLOSE_WAIT_MS + 3_000);
  } finally {
    await cleanUpAway();
  }
});

it("a connection whose server never answers its start-up fails as PostgreSQL away within CONNECT_WAIT_MS, and frees the pool's slot", async () => {
  // Accepts the connection and never says a word: opened just as the server failed over.
  const sockets = new Set<Socket>();
  const silent = net.createServer((s) => void sockets.add(s));
  const port = await freePort();
  await new Promise<void>((resolve) => silent.listen(port, '127.0.0.1', resolve));
  const pool = createPool(`postgres://nobody:secret@127.0.0.1:${port}/outbox`, 1);
  try {
    const started = Date.now();
    const err: unknown = await pool.query('SELECT 1').catch((e: unknown) => e);
    expect(Date.now() - started).toBeLessThan(CONNECT_WAIT_MS + 5_000);
    expect(connectionLost(err), String(err)).toBe(true);
    expect(isDatabaseUnavailable(err)).toBe(true);
    // The pool's one slot is free again, not held by a connection that will never open.
    expect(pool.totalCount).toBe(0);
  } finally {
    await pool.end();
    for (const s of sockets) s.destroy();
    silent.close();
  }
}, 30_000);

it('a short transaction of ours (the claim, a usage over HTTP) runs at READ COMMITTED whatever the database default', async () => {
  const database = decodeURIComponent(new URL(t.db.url).pathname.slice(1));
  await admin.query(`ALTER DATABASE "${database}" SET default_transaction_isolation = 'serializable'`);
  const pool = createPool(t.db.url, 1);
  try {
    const level = async (c: pg.PoolClient) => (await c.query<{ transaction_isolation: string }>('SHOW transaction_isolation')).rows[0]!.transaction_isolation;
    expect(await withTransaction(pool, level)).toBe('serializable');
    expect(await withTransaction(pool, level, { short: true })).toBe('read committed');
  } finally {
    await pool.end();
    await admin.query(`ALTER DATABASE "${database}" RESET default_transaction_isolation`);
  }
});
