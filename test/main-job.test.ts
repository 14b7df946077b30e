/**
 * `npm start` on embedded defaults, as a user runs it: nothing configured. It must start its own
 * PostgreSQL, Temporal dev server and local Stripe, drain events, and stop cleanly on SIGTERM.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';
import { chmod, mkdtemp, rm } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import pg from 'pg';
import { afterAll, expect, it } from 'vitest';
import { withTransaction } from '../src/db.js';
import { recordUsage } from '../src/outbox/enqueue.js';
import { waitFor } from './helpers.js';

let child: ChildProcess | undefined;
let dataDir: string;
let output = '';

afterAll(async () => {
  if (child?.exitCode === null && child.pid) process.kill(-child.pid, 'SIGKILL');
  if (dataDir) await rm(dataDir, { recursive: true, force: true });
});

it('npm start runs the main job on embedded defaults and drains events to the local Stripe', async () => {
  dataDir = await mkdtemp(path.join(os.tmpdir(), 'billing-outbox-main-'));
  await chmod(dataDir, 0o755);
  const env: NodeJS.ProcessEnv = { ...process.env, DATA_DIR: dataDir, LOG_LEVEL: 'info', RELAY_POLL_INTERVAL_MS: '200' };
  for (const name of ['DATABASE_URL', 'TEMPORAL_ADDRESS', 'STRIPE_API_KEY', 'STRIPE_API_BASE', 'NODE_ENV']) delete env[name];
  child = spawn('npm', ['start'], { env, detached: true, stdio: ['ignore', 'pipe', 'pipe'] });
  child.stdout!.on('data', (b: Buffer) => (output += b.toString()));
  child.stderr!.on('data', (b: Buffer) => (output += b.toString()));

  const endpointsFile = path.join(dataDir, 'endpoints.json');
  await waitFor('the main job to be ready', async () => existsSync(endpointsFile) || (child!.exitCode !== null && Promise.reject(new Error(output))), 120_000, 250);
  const endpoints = JSON.parse(readFileSync(endpointsFile, 'utf8')) as { pid: number; databaseUrl: string; stripeApiBase: string; localStripe: boolean };
  expect(endpoints.localStripe).toBe(true);
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
    const { rows } = await pool.query(`SELECT count(*)::int AS n FROM outbox WHERE idempotency_key = ANY($1) AND status = 'sent'`, [keys]);
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
