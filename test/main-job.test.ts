/**
 * `npm start` on embedded defaults, as a user runs it: nothing configured. It must start its own
 * PostgreSQL, Temporal dev server and local Stripe, drain events, and stop cleanly on SIGTERM.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';
import { chmod, mkdtemp, readdir, readFile, rm } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import pg from 'pg';
import { afterAll, beforeAll, expect, it } from 'vitest';
import { withTransaction } from '../src/db.js';
import { recordUsage } from '../src/outbox/enqueue.js';
import { waitFor } from './helpers.js';
import { schemaFor } from '../src/outbox/sql/schema.js';

let child: ChildProcess | undefined;
let dataDir: string;
let output = '';

beforeAll(async () => {
  dataDir = await mkdtemp(path.join(os.tmpdir(), 'billing-outbox-main-'));
  await chmod(dataDir, 0o755);
});

afterAll(async () => {
  const kill = (pid: number) => {
    try {
      process.kill(pid, 'SIGKILL');
    } catch {
      // already gone
    }
  };
  if (child?.pid) kill(-child.pid);
  for (const pid of await serversOn(dataDir)) kill(pid);
  if (dataDir) await rm(dataDir, { recursive: true, force: true });
});

/** PostgreSQL and Temporal processes working on files under `dir`. */
async function serversOn(dir: string | undefined): Promise<number[]> {
  if (!dir) return [];
  const found: number[] = [];
  for (const entry of await readdir('/proc')) {
    if (!/^\d+$/.test(entry)) continue;
    const cmdline = await readFile(`/proc/${entry}/cmdline`, 'utf8').catch(() => '');
    if (cmdline.includes(dir) && /postgres|temporal/.test(cmdline.split('\0')[0] ?? '')) found.push(Number(entry));
  }
  return found;
}

function startMain(env: NodeJS.ProcessEnv): ChildProcess {
  const c = spawn('npm', ['start'], { env, detached: true, stdio: ['ignore', 'pipe', 'pipe'] });
  c.stdout!.on('data', (b: Buffer) => (output += b.toString()));
  c.stderr!.on('data', (b: Buffer) => (output += b.toString()));
  return c;
}

it('npm start runs the main job on embedded defaults and drains events to the local Stripe', async () => {
  const env: NodeJS.ProcessEnv = { ...process.env, DATA_DIR: dataDir, LOG_LEVEL: 'info', RELAY_POLL_INTERVAL_MS: '200' };
  for (const name of ['DATABASE_URL', 'TEMPORAL_ADDRESS', 'STRIPE_API_KEY', 'STRIPE_API_BASE', 'NODE_ENV']) delete env[name];
  child = startMain(env);

  const endpointsFile = path.join(dataDir, 'endpoints.json');
  await waitFor('the main job to be ready', async () => existsSync(endpointsFile) || (child!.exitCode !== null && Promise.reject(new Error(output))), 120_000, 250);
  const endpoints = JSON.parse(readFileSync(endpointsFile, 'utf8')) as { pid: number; databaseUrl: string; stripeApiBase: string; localStripe: string };
  expect(endpoints.localStripe).toBe(endpoints.stripeApiBase);
  expect(output).toContain('NOTHING IS BILLED');

  const pool = new pg.Pool({ connectionString: endpoints.databaseUrl });
  try {
    const keys: string[] = [];
    for (const [tenantId, quantity] of [['acme', 3], ['globex', 4], ['acme', 5]] as const) {
      const r = await withTransaction(pool, (c) => recordUsage(c, { usageId: `main-job-${tenantId}-${quantity}`, tenantId, quantity }));
      keys.push(r.entry.idempotencyKey);
    }
    const events = await waitFor('the local Stripe to record the events', async () => {
      const res = await fetch(`${endpoints.stripeApiBase}/_local/events`);
      const body = (await res.json()) as { data?: { identifier: string; value: number }[] } | { identifier: string; value: number }[];
      const list = Array.isArray(body) ? body : (body.data ?? []);
      return keys.every((k) => list.some((e) => e.identifier === k)) ? list : undefined;
    }, 60_000, 250);
    expect(events.filter((e) => keys.includes(e.identifier)).map((e) => e.value).sort()).toEqual([3, 4, 5]);
    const { rows } = await pool.query(`SELECT count(*)::int AS n FROM ${schemaFor().outbox} WHERE idempotency_key = ANY($1) AND status = 'sent'`, [keys]);
    expect(rows[0].n).toBe(3);
  } finally {
    await pool.end();
  }

  // Graceful stop, as a process manager does it: SIGTERM to the job's process. It drains, stops
  // what it started, and exits 0 (so `npm start` does too).
  const exited = new Promise<number | null>((resolve) => child!.once('exit', (code) => resolve(code)));
  process.kill(endpoints.pid, 'SIGTERM');
  const code = await Promise.race([exited, new Promise<'timeout'>((r) => setTimeout(() => r('timeout'), 60_000))]);
  expect(code, output.slice(-3000)).toBe(0);
  expect(output).toContain('billing-outbox stopped');
  expect(output).not.toMatch(/"level":50/);
  // Nothing secret in what it printed: the embedded database password never appears.
  expect(output).not.toContain(new URL(endpoints.databaseUrl).password);
}, 180_000);

it('leaves nothing running behind it: SIGKILLed, its Temporal server goes at once and the next start stops its PostgreSQL; Ctrl-C stops everything', async () => {
  const env: NodeJS.ProcessEnv = { ...process.env, DATA_DIR: dataDir, LOG_LEVEL: 'info' };
  for (const name of ['DATABASE_URL', 'TEMPORAL_ADDRESS', 'STRIPE_API_KEY', 'STRIPE_API_BASE', 'NODE_ENV']) delete env[name];
  const endpointsFile = path.join(dataDir, 'endpoints.json');
  output = '';
  child = startMain(env);
  await waitFor('the main job to be ready', async () => existsSync(endpointsFile) || (child!.exitCode !== null && Promise.reject(new Error(output))), 120_000, 250);
  const { pid } = JSON.parse(readFileSync(endpointsFile, 'utf8')) as { pid: number };
  expect((await serversOn(dataDir)).length).toBeGreaterThanOrEqual(2);

  // The worst way to end: SIGKILL, no hook runs. Its Temporal server's guard stops the server.
  process.kill(pid, 'SIGKILL');
  await waitFor('the Temporal server to go with it', async () => {
    const left = await serversOn(dataDir);
    const commands = await Promise.all(left.map((p) => readFile(`/proc/${p}/cmdline`, 'utf8').catch(() => '')));
    return !commands.some((c) => c.includes('start-dev'));
  }, 15_000, 200);
  // npm and tsx above it end by themselves; its PostgreSQL is left running, an orphan.
  const first = child;
  await waitFor('npm start to end', async () => first.exitCode !== null || first.signalCode !== null, 15_000, 100);
  const left = await Promise.all((await serversOn(dataDir)).map((p) => readFile(`/proc/${p}/cmdline`, 'utf8')));
  expect(left.some((c) => /(^|\/)postgres\0/.test(c))).toBe(true);

  // The next start finds the PostgreSQL it left and stops it, loudly, instead of moving ports.
  output = '';
  child = startMain(env);
  await waitFor('the main job to be ready again', async () => (existsSync(endpointsFile) && output.includes('billing-outbox is running')) || (child!.exitCode !== null && Promise.reject(new Error(output))), 120_000, 250);
  expect(output).toMatch(/stopping a PostgreSQL left running on .* by an earlier run/);

  // Ctrl-C in a terminal: SIGINT to the whole foreground process group.
  const exited = new Promise<number | null>((resolve) => child!.once('exit', (code) => resolve(code)));
  process.kill(-child.pid!, 'SIGINT');
  await Promise.race([exited, new Promise((r) => setTimeout(r, 60_000))]);
  await waitFor('nothing left on the data folder', async () => (await serversOn(dataDir)).length === 0, 20_000, 200);
  expect(existsSync(endpointsFile)).toBe(false);
}, 300_000);
