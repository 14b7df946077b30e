/**
 * `npm run demo -- --short` as a user runs it, with nothing configured: it must start its own
 * PostgreSQL, Temporal dev server (with Web UI) and local Stripe on free ports (next to this run's
 * shared servers), send usage through an outage, pass its own check, clean up and print no secret.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { existsSync } from 'node:fs';
import { afterAll, expect, it } from 'vitest';

let child: ChildProcess | undefined;

afterAll(() => {
  if (child?.exitCode === null && child.signalCode === null && child.pid) process.kill(-child.pid, 'SIGKILL');
});

it('npm run demo -- --short passes its self-check on embedded defaults and leaves nothing behind', async () => {
  const env: NodeJS.ProcessEnv = { ...process.env };
  for (const name of ['DATABASE_URL', 'TEMPORAL_ADDRESS', 'STRIPE_API_KEY', 'STRIPE_API_BASE', 'NODE_ENV', 'API_TOKENS']) delete env[name];
  let output = '';
  // Its own process group, so a timeout can stop npm, tsx and the demo together.
  child = spawn('npm', ['run', 'demo', '--', '--short'], { env, detached: true, stdio: ['ignore', 'pipe', 'pipe'] });
  child.stdout!.on('data', (b: Buffer) => (output += b.toString()));
  child.stderr!.on('data', (b: Buffer) => (output += b.toString()));
  const exited = new Promise<number | null>((resolve) => child!.once('exit', (code) => resolve(code)));
  const code = await Promise.race([exited, new Promise<'timeout'>((r) => setTimeout(() => r('timeout'), 90_000))]);

  expect(code, output.slice(-4000)).toBe(0);
  expect(output).toMatch(/^RESULT: PASS \(\d+ of \d+ checks\)/m);
  expect(output).not.toMatch(/^\s+FAIL\s/m);
  expect(output).toMatch(/Temporal Web UI: +http:\/\/127\.0\.0\.1:\d+/);
  expect(output).toContain('OutboxStatus="dead"');
  // No warning from the Temporal SDK's core (they reach the console even in the demo's errors-only
  // mode): each was a bug, e.g. a local activity heartbeating or a workflow task held past 5 s.
  expect(output).not.toMatch(/temporalio_sdk_core|TMPRL\d+/);
  // The outage really happened and was retried through.
  expect(output).toContain('Stripe is DOWN');
  expect(output).toMatch(/PASS {2}Outage: [1-9]/);

  // No secret in what it printed. The API token is random and lives only in the demo's memory:
  // no bearer credential may appear at all.
  expect(output).not.toMatch(/Bearer\s+[A-Za-z0-9._~+/=-]{8,}/i);
  expect(output).not.toMatch(/authorization/i);
  // The embedded database password (src/embedded/postgres.ts) never appears, and every database URL
  // printed has its password masked.
  expect(output).not.toContain('billing-outbox-local');
  for (const [, password] of output.matchAll(/postgres(?:ql)?:\/\/[^:@\s/]+:([^@\s]*)@/g)) expect(password).toBe('***');

  // Without --keep the temporary data folder is gone.
  const dataDir = /in (\S*billing-outbox-demo-\S+) …/.exec(output)?.[1];
  expect(dataDir, output.slice(0, 2000)).toBeDefined();
  expect(existsSync(dataDir!)).toBe(false);
}, 120_000);
