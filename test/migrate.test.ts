import { spawn } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import pg from 'pg';
import { afterAll, expect, inject, it } from 'vitest';
import { databaseUrlFor } from './helpers.js';

const name = `bo_migrate_${randomUUID().replace(/-/g, '').slice(0, 10)}`;

afterAll(async () => {
  const admin = new pg.Client({ connectionString: inject('adminDatabaseUrl') });
  await admin.connect();
  await admin.query(`DROP DATABASE IF EXISTS ${name} WITH (FORCE)`);
  await admin.end();
});

function runMigrate(url: string): Promise<{ code: number | null; out: string }> {
  return new Promise((resolve) => {
    const child = spawn('npm', ['run', '--silent', 'migrate'], { env: { ...process.env, DATABASE_URL: url } });
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

  const results = await Promise.all([runMigrate(url), runMigrate(url), runMigrate(url)]);
  for (const r of results) expect(r.code, r.out).toBe(0);
  // Exactly one process applied the migrations; the others found nothing left to do.
  expect(results.filter((r) => r.out.includes('applied 001_outbox.sql'))).toHaveLength(1);
  // The password never reaches the output.
  for (const r of results) expect(r.out).not.toContain(new URL(url).password);

  const c = new pg.Client({ connectionString: url });
  await c.connect();
  const { rows } = await c.query('SELECT name FROM schema_migrations ORDER BY name');
  await c.end();
  expect(rows.map((r: { name: string }) => r.name)[0]).toBe('001_outbox.sql');
}, 60_000);

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
  expect(r.out).toMatch(/DATABASE_URL is not set/);
});
