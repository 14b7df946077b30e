/**
 * The embedded services `npm start` runs on a developer's machine: PostgreSQL with passwords of its
 * own (random per data folder) and an application role that is not a superuser, and none of it in
 * production.
 */
import { chmod, mkdtemp, rm, stat } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import pg from 'pg';
import { afterAll, expect, it } from 'vitest';
import { ConfigError, loadConfig } from '../src/config.js';
import { startEmbeddedPostgres } from '../src/embedded/postgres.js';
import { startStack } from '../src/embedded/stack.js';

const dirs: string[] = [];
afterAll(async () => {
  for (const d of dirs) await rm(d, { recursive: true, force: true });
});

it('gives every data folder its own passwords, kept readable by its owner only, and connects the application as a plain role', async () => {
  const urls: string[] = [];
  for (let i = 0; i < 2; i++) {
    const dir = await mkdtemp(path.join(os.tmpdir(), 'billing-outbox-embedded-'));
    // Run as root, PostgreSQL runs as a `postgres` system user that must be able to enter it.
    await chmod(dir, 0o755);
    dirs.push(dir);
    const server = await startEmbeddedPostgres({ dataDir: path.join(dir, 'pg'), persistent: false });
    try {
      urls.push(server.url);
      expect((await stat(path.join(dir, 'pg.secrets.json'))).mode & 0o777).toBe(0o600);
      const client = new pg.Client({ connectionString: server.url });
      await client.connect();
      try {
        const { rows } = await client.query<{ rolsuper: boolean; rolcreatedb: boolean }>('SELECT rolsuper, rolcreatedb FROM pg_roles WHERE rolname = current_user');
        expect(rows[0]).toEqual({ rolsuper: false, rolcreatedb: false });
      } finally {
        await client.end();
      }
    } finally {
      await server.stop();
    }
  }
  const password = (url: string) => new URL(url).password;
  expect(password(urls[0]!)).not.toBe(password(urls[1]!));
  expect(password(urls[0]!)).not.toBe('billing-outbox-local');
}, 60_000);

it('refuses to run embedded PostgreSQL or Temporal when NODE_ENV=production, before starting anything', async () => {
  const config = loadConfig({ NODE_ENV: 'production', STRIPE_API_KEY: 'sk_test_production_refusal', LOG_LEVEL: 'silent' });
  const err = await startStack(config, { dataDir: await mkdtemp(path.join(os.tmpdir(), 'billing-outbox-prod-')) }).catch((e: unknown) => e);
  expect(err).toBeInstanceOf(ConfigError);
  expect((err as ConfigError).problems).toEqual([expect.stringMatching(/^DATABASE_URL: is required when NODE_ENV=production/), expect.stringMatching(/^TEMPORAL_ADDRESS: is required/)]);
});
