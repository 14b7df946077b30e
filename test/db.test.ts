/**
 * The pool our processes use survives PostgreSQL cutting its connections, including a connection
 * checked out in the middle of a transaction (whose 'error' event would otherwise end the process).
 */
import pg from 'pg';
import { afterAll, beforeAll, expect, inject, it } from 'vitest';
import { createPool, isDatabaseUnavailable } from '../src/db.js';
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

it('a connection cut between two queries of a transaction fails that transaction, not the process', async () => {
  const pool = createPool(t.db.url, 2);
  try {
    const client = await pool.connect();
    await client.query('BEGIN');
    const { rows } = await client.query<{ pid: number }>('SELECT pg_backend_pid() AS pid');
    await admin.query('SELECT pg_terminate_backend($1)', [rows[0]!.pid]);
    // The server's goodbye arrives while no query is running: an 'error' event on the client, with
    // no listener of ours (an unhandled one would fail this run).
    await waitFor('the backend gone', async () => (await admin.query('SELECT 1 FROM pg_stat_activity WHERE pid = $1', [rows[0]!.pid])).rowCount === 0);
    // The backend is gone; its socket's close reaches this process a moment later, with nothing to
    // await for it (pg has no public event for it): the next query must find the client broken.
    await new Promise((r) => setTimeout(r, 200));
    const next = await client.query('SELECT 1').then(() => undefined, (e: unknown) => e);
    expect(isDatabaseUnavailable(next)).toBe(true);
    client.release();
    // The pool dropped the broken client and opens a new one.
    expect((await pool.query<{ ok: number }>('SELECT 1 AS ok')).rows).toEqual([{ ok: 1 }]);
  } finally {
    await pool.end();
  }
});
