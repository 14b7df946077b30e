/**
 * The embedded services `npm start` runs on a developer's machine: PostgreSQL with passwords of its
 * own (random per data folder) and an application role that is not a superuser, and none of it in
 * production.
 */
import { execFile } from 'node:child_process';
import { watch } from 'node:fs';
import { chmod, mkdir, mkdtemp, readdir, readFile, rm, stat, writeFile } from 'node:fs/promises';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import pg from 'pg';
import { afterAll, expect, it } from 'vitest';
import { ConfigError, loadConfig } from '../src/config.js';
import { createLogger } from '../src/log.js';
import { EmbeddedPostgresError, freePort, startEmbeddedPostgres } from '../src/embedded/postgres.js';
import { startOnPort, startStack } from '../src/embedded/stack.js';
import { PROJECT_ROOT, startTemporalDevServer } from '../src/embedded/temporal.js';

const dirs: string[] = [];
afterAll(async () => {
  for (const d of dirs) await rm(d, { recursive: true, force: true });
});

it('gives every data folder its own passwords, kept readable by its owner only, connects the application as a plain role, and is UTF-8 under any locale', async () => {
  const urls: string[] = [];
  for (let i = 0; i < 2; i++) {
    const dir = await mkdtemp(path.join(os.tmpdir(), 'billing-outbox-embedded-'));
    // Run as root, PostgreSQL runs as a `postgres` system user that must be able to enter it.
    await chmod(dir, 0o755);
    dirs.push(dir);
    // The second under a C locale, as in many containers: initdb alone would make it SQL_ASCII.
    const locale = process.env.LC_ALL;
    if (i === 1) process.env.LC_ALL = 'C';
    const server = await startEmbeddedPostgres({ dataDir: path.join(dir, 'pg'), persistent: false }).finally(() => {
      if (locale === undefined) delete process.env.LC_ALL;
      else process.env.LC_ALL = locale;
    });
    try {
      urls.push(server.url);
      expect((await stat(path.join(dir, 'pg.secrets.json'))).mode & 0o777).toBe(0o600);
      const client = new pg.Client({ connectionString: server.url });
      await client.connect();
      try {
        const { rows } = await client.query<{ rolsuper: boolean; rolcreatedb: boolean }>('SELECT rolsuper, rolcreatedb FROM pg_roles WHERE rolname = current_user');
        expect(rows[0]).toEqual({ rolsuper: false, rolcreatedb: false });
        expect((await client.query('SHOW server_encoding')).rows[0].server_encoding).toBe('UTF8');
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

it('says why when PostgreSQL stops while starting (here: its port is taken), not "undefined"', async () => {
  const dir = await mkdtemp(path.join(os.tmpdir(), 'billing-outbox-embedded-'));
  await chmod(dir, 0o755);
  dirs.push(dir);
  const taken = net.createServer();
  await new Promise<void>((resolve) => taken.listen(0, '127.0.0.1', resolve));
  const { port } = taken.address() as net.AddressInfo;
  try {
    const err = await startEmbeddedPostgres({ dataDir: path.join(dir, 'pg'), port, persistent: false }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(EmbeddedPostgresError);
    expect((err as Error).message).toMatch(new RegExp(`port ${port}.*stopped while starting: .*(could not bind|Address already in use)`));
    expect((err as EmbeddedPostgresError).portTaken).toBe(true);
  } finally {
    taken.close();
  }
}, 60_000);

it('takes a free port when its preferred one is taken between the check and the bind (the demo beside npm start)', async () => {
  const dir = await mkdtemp(path.join(os.tmpdir(), 'billing-outbox-embedded-'));
  await chmod(dir, 0o755);
  dirs.push(dir);
  const preferred = await freePort();
  const thief = net.createServer();
  const tried: number[] = [];
  const warnings: string[] = [];
  const log = createLogger('warn', { write: (line: string) => warnings.push(line) });
  try {
    const server = await startOnPort('embedded PostgreSQL', preferred, log, async (port) => {
      tried.push(port);
      // Free when startOnPort looked; another process binds it just before PostgreSQL does.
      if (port === preferred) await new Promise<void>((resolve) => thief.listen(preferred, '127.0.0.1', resolve));
      return startEmbeddedPostgres({ dataDir: path.join(dir, 'pg'), port, persistent: false });
    });
    try {
      expect(tried).toEqual([preferred, server.port]);
      expect(server.port).not.toBe(preferred);
      const client = new pg.Client({ connectionString: server.url });
      await client.connect();
      await client.end();
      expect(warnings.join('')).toContain(`port ${preferred} was taken while it started`);
    } finally {
      await server.stop();
    }
  } finally {
    thief.close();
  }
}, 60_000);

it("writes the superuser's password for initdb only where PostgreSQL's own user can read it", async () => {
  const dir = await mkdtemp(path.join(os.tmpdir(), 'billing-outbox-embedded-'));
  await chmod(dir, 0o755);
  dirs.push(dir);
  // Every file that appears in the system's temporary folder while the data folder is made.
  const seen: string[] = [];
  const watcher = watch(os.tmpdir(), (_event, name) => name && seen.push(String(name)));
  const privateSeen: number[] = [];
  const privateDir = path.join(dir, 'pg.init');
  const probe = setInterval(() => void stat(privateDir).then((st) => privateSeen.push(st.mode & 0o777), () => undefined), 5);
  try {
    const server = await startEmbeddedPostgres({ dataDir: path.join(dir, 'pg'), persistent: false });
    await server.stop();
  } finally {
    clearInterval(probe);
    watcher.close();
  }
  expect(seen.filter((n) => n.startsWith('pg-password-'))).toEqual([]);
  expect((await readdir(os.tmpdir())).filter((n) => n.startsWith('pg-password-'))).toEqual([]);
  // The private folder existed (initdb took long enough to be seen), only its owner could enter it, and it is gone.
  expect(privateSeen.length).toBeGreaterThan(0);
  expect(new Set(privateSeen)).toEqual(new Set([0o700]));
  expect(await readdir(dir)).not.toContain('pg.init');
  expect(process.env.TMPDIR).toBe(undefined);
}, 60_000);

it.runIf(process.getuid?.() === 0)('says, when run by root, which folder PostgreSQL cannot enter and how to fix it', async () => {
  const dir = await mkdtemp(path.join(os.tmpdir(), 'billing-outbox-embedded-'));
  dirs.push(dir);
  // mkdtemp makes it 0700: like a root home folder.
  const home = path.join(dir, 'home');
  await mkdir(home, { mode: 0o700 });
  const err = await startEmbeddedPostgres({ dataDir: path.join(home, 'app', '.data', 'pg'), persistent: false }).catch((e: unknown) => e);
  expect(err).toBeInstanceOf(EmbeddedPostgresError);
  expect((err as Error).message).toBe(
    `embedded PostgreSQL cannot use ${path.join(home, 'app', '.data', 'pg')}: started by root, it runs as the system user "postgres", ` +
      `which cannot enter ${home} (mode 700, owner uid 0). Use a data folder under a path every user can enter ` +
      `(for example /var/tmp/billing-outbox), or let others enter that folder: chmod o+x ${home}`,
  );
});

it("keeps the Temporal dev server's histories (tenants, quantities) readable by their owner only", async () => {
  const dir = await mkdtemp(path.join(os.tmpdir(), 'billing-outbox-embedded-'));
  dirs.push(dir);
  const dbFile = path.join(dir, 'temporal.db');
  const server = await startTemporalDevServer({ dbFile });
  try {
    const files = (await readdir(dir)).filter((f) => f.startsWith('temporal.db'));
    expect(files).toContain('temporal.db');
    for (const f of files) expect({ f, mode: (await stat(path.join(dir, f))).mode & 0o777 }).toEqual({ f, mode: 0o600 });
  } finally {
    await server.stop();
  }
}, 60_000);

it('refuses to run embedded PostgreSQL or Temporal when NODE_ENV=production, before starting anything', async () => {
  const config = loadConfig({ NODE_ENV: 'production', STRIPE_API_KEY: 'sk_test_production_refusal', LOG_LEVEL: 'silent' });
  const err = await startStack(config, { dataDir: await mkdtemp(path.join(os.tmpdir(), 'billing-outbox-prod-')) }).catch((e: unknown) => e);
  expect(err).toBeInstanceOf(ConfigError);
  expect((err as ConfigError).problems).toEqual([expect.stringMatching(/^DATABASE_URL: is required in production \(NODE_ENV production, prod, staging/), expect.stringMatching(/^TEMPORAL_ADDRESS: is required/)]);
});

it("refuses NODE_ENV=production without a Stripe key, before starting anything: the local Stripe would take the real outbox's usage", async () => {
  const dataDir = await mkdtemp(path.join(os.tmpdir(), 'billing-outbox-prod-'));
  dirs.push(dataDir);
  const config = loadConfig({ NODE_ENV: 'production', DATABASE_URL: 'postgres://app@db.internal:5432/app', TEMPORAL_ADDRESS: 'temporal.internal:7233', LOG_LEVEL: 'silent' });
  const err = await startStack(config, { dataDir }).catch((e: unknown) => e);
  expect(err).toBeInstanceOf(ConfigError);
  expect((err as ConfigError).problems).toEqual([expect.stringMatching(/^STRIPE_API_KEY: is required in production \(NODE_ENV production, prod, staging/)]);
  expect(await readdir(dataDir)).toEqual([]);
});

it('refuses a live Stripe key outside NODE_ENV=production, before starting anything; production may use one', async () => {
  const dataDir = await mkdtemp(path.join(os.tmpdir(), 'billing-outbox-live-'));
  dirs.push(dataDir);
  for (const key of ['sk_live_localstackrefusal', 'rk_live_localstackrefusal']) {
    const err = await startStack(loadConfig({ STRIPE_API_KEY: key, LOG_LEVEL: 'silent' }), { dataDir }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(ConfigError);
    expect((err as ConfigError).problems).toEqual([expect.stringMatching(/^STRIPE_API_KEY: is a live key, which the local stack never uses/)]);
    expect(String(err)).not.toContain(key);
  }
  expect(await readdir(dataDir)).toEqual([]);
  // A test-mode key to Stripe itself bills nothing: not refused (it fails later, on NODE_ENV=production's services).
  const live = await startStack(loadConfig({ NODE_ENV: 'production', STRIPE_API_KEY: 'sk_live_productionallowed', LOG_LEVEL: 'silent' }), { dataDir }).catch((e: unknown) => e);
  expect((live as ConfigError).problems.map((p) => p.split(':')[0])).toEqual(['DATABASE_URL', 'TEMPORAL_ADDRESS']);
});

it("npm start in a checkout whose .env holds the deployment's live key refuses, exit 2, and writes nothing", async () => {
  const checkout = await mkdtemp(path.join(os.tmpdir(), 'billing-outbox-checkout-'));
  dirs.push(checkout);
  // What `cp deploy/compose.env.example .env` with the deployment's values used to leave behind.
  const example = await readFile(path.join(PROJECT_ROOT, 'deploy/compose.env.example'), 'utf8');
  const key = 'sk_live_fromthedeploymentsenv';
  await writeFile(path.join(checkout, '.env'), example.replace(/^STRIPE_API_KEY=.*$/m, `STRIPE_API_KEY=${key}`).replace(/^API_TOKENS=.*$/m, ''));
  const dataDir = path.join(checkout, 'data');
  const run = await new Promise<{ code: number | null; output: string }>((resolve) => {
    // `npm start` less its tools step, from the checkout with the .env.
    const child = execFile(path.join(PROJECT_ROOT, 'node_modules/.bin/tsx'), [path.join(PROJECT_ROOT, 'src/bin/main.ts')], {
      cwd: checkout,
      env: { PATH: process.env.PATH ?? '', HOME: process.env.HOME ?? '', DATA_DIR: dataDir },
    }, (_err, stdout, stderr) => resolve({ code: child.exitCode, output: stdout + stderr }));
  });
  expect(run.output).toMatch(/STRIPE_API_KEY: is a live key/);
  expect(run.code).toBe(2);
  expect(run.output).not.toContain(key);
  await expect(stat(dataDir)).rejects.toThrow(/ENOENT/);
}, 60_000);
