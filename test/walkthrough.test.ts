/**
 * README "Your first five minutes", command for command, as a newcomer types it: `npm start` with
 * nothing configured, then curl (here: fetch, with the generated token), `npm run cli`, `npm run
 * stripe` from a second terminal (here: child processes with no DATABASE_URL or TEMPORAL_ADDRESS:
 * they find the running stack by themselves). If the README's steps stop working, this fails.
 */
import { execFile, spawn, type ChildProcess } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';
import { chmod, mkdtemp, readdir, readFile, rm } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { afterAll, beforeAll, expect, it } from 'vitest';
import { waitFor } from './helpers.js';

let child: ChildProcess | undefined;
let dataDir: string;
let output = '';
let env: NodeJS.ProcessEnv;

beforeAll(async () => {
  dataDir = await mkdtemp(path.join(os.tmpdir(), 'billing-outbox-walkthrough-'));
  await chmod(dataDir, 0o755);
  env = { ...process.env, DATA_DIR: dataDir, LOG_LEVEL: 'warn', API_PORT: '0', RELAY_POLL_INTERVAL_MS: '200' };
  // Nothing configured: what a newcomer's shell has.
  for (const name of ['DATABASE_URL', 'TEMPORAL_ADDRESS', 'TEMPORAL_UI', 'STRIPE_API_KEY', 'STRIPE_API_BASE', 'API_TOKENS', 'NODE_ENV', 'LOCAL_STRIPE_URL']) delete env[name];
});

afterAll(async () => {
  if (child?.pid) {
    try {
      process.kill(-child.pid, 'SIGKILL');
    } catch {
      // already gone
    }
  }
  for (const pid of await serversOn(dataDir)) {
    try {
      process.kill(pid, 'SIGKILL');
    } catch {
      // already gone
    }
  }
  if (dataDir) await rm(dataDir, { recursive: true, force: true });
});

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

/** The outbox status of `key`, as `npm run cli -- inspect <key> --json` reports it. */
async function outboxStatus(key: string): Promise<string | undefined> {
  const r = await npmRun('cli', 'inspect', key, '--json');
  try {
    return (JSON.parse(r.stdout) as { row?: { status?: string } }).row?.status;
  } catch {
    return undefined;
  }
}

/** `npm run -s <script> -- ...args` from a second terminal; resolves with its exit code and output. */
function npmRun(script: string, ...args: string[]): Promise<{ code: number; out: string; stdout: string }> {
  return new Promise((resolve) => {
    execFile('npm', ['run', '-s', script, '--', ...args], { env, timeout: 120_000 }, (err, stdout, stderr) => {
      const code = err ? (typeof (err as { code?: unknown }).code === 'number' ? (err as { code: number }).code : 1) : 0;
      resolve({ code, out: `${stdout}${stderr}`, stdout });
    });
  });
}

it('README "Your first five minutes": first event, a dead letter made on purpose, fixed and retried, a customer Stripe does not have rebilled', async () => {
  child = spawn('npm', ['start'], { env, detached: true, stdio: ['ignore', 'pipe', 'pipe'] });
  child.stdout!.on('data', (b: Buffer) => (output += b.toString()));
  child.stderr!.on('data', (b: Buffer) => (output += b.toString()));
  const endpointsFile = path.join(dataDir, 'endpoints.json');
  await waitFor('npm start to be ready', async () => (existsSync(endpointsFile) && output.includes('billing-outbox is running')) || (child!.exitCode !== null && Promise.reject(new Error(output))), 120_000, 250);
  const { api } = JSON.parse(readFileSync(endpointsFile, 'utf8')) as { api: string };
  // The banner says where the token is, and gives the curl line.
  expect(output).toContain('Authorization: Bearer $(cat ');
  const token = readFileSync(path.join(dataDir, 'api-token'), 'utf8').trim();
  const post = (body: object) =>
    fetch(`${api}/v1/usage`, { method: 'POST', headers: { authorization: `Bearer ${token}`, 'content-type': 'application/json' }, body: JSON.stringify(body) });

  // 1. A first event: 201 and its key.
  const first = await post({ tenant_id: 'acme', usage_id: 'first-1', quantity: 3 });
  expect(first.status).toBe(201);
  expect(JSON.stringify(await first.json())).toContain('u:acme:first-1');
  // Without the token: refused, nothing recorded.
  const anonymous = await fetch(`${api}/v1/usage`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: '{"tenant_id":"acme","usage_id":"x","quantity":1}' });
  expect(anonymous.status).toBe(401);

  // 2. See it: the CLI and the local Stripe, found through .data/endpoints.json.
  await waitFor('the first event to be sent', async () => (await outboxStatus('u:acme:first-1')) === 'sent', 60_000, 500);
  const inspected = await npmRun('cli', 'inspect', 'u:acme:first-1');
  expect(inspected.code, inspected.out).toBe(0);
  expect(inspected.out).toMatch(/workflows\/u%3Aacme%3Afirst-1|u:acme:first-1/);
  const events = await npmRun('stripe', 'events');
  expect(events.code, events.out).toBe(0);
  expect(events.out).toContain('u:acme:first-1');

  // 3. A dead letter on purpose: the local Stripe refuses the next call with a 400.
  const failing = await npmRun('stripe', 'fail', '1', '400');
  expect(failing.code, failing.out).toBe(0);
  const oops = await post({ tenant_id: 'acme', usage_id: 'oops-1', quantity: 5 });
  expect(oops.status).toBe(201);

  // 4. Found at a glance: `cli dead` lists it with Stripe's answer.
  const dead = await waitFor('the dead letter', async () => {
    const r = await npmRun('cli', 'dead');
    return r.out.includes('u:acme:oops-1') ? r : undefined;
  }, 90_000, 1_000);
  expect(dead.out).toContain('Injected 400 error.');
  // The first event is not one of them.
  expect(dead.out).not.toContain('u:acme:first-1');

  // 5. Retried with the same identifier: sent, once.
  expect(await outboxStatus('u:acme:oops-1')).toBe('dead');
  const retried = await npmRun('cli', 'retry', 'u:acme:oops-1', '--wait');
  expect(retried.code, retried.out).toBe(0);
  // It answers with the outcome: the row is sent when it says so.
  expect(retried.out).toMatch(/retried u:acme:oops-1: sent after 2 attempt\(s\)/);
  expect(await outboxStatus('u:acme:oops-1')).toBe('sent');
  expect((await npmRun('stripe', 'events')).out.split('u:acme:oops-1').length - 1).toBe(1);
  expect((await npmRun('cli', 'dead')).out).not.toContain('u:acme:oops-1');

  // 6. A customer Stripe does not have. Asked first, the stack's own Stripe (found with the stack)
  // says it has no such customer; mapped anyway, its usage is taken (200), then rejected by the
  // error report the local Stripe delivers to the stack's webhook route.
  const asked = await npmRun('cli', 'customers', 'set', 'umbrella', 'cus_umbrella');
  expect(asked.code, asked.out).toBe(1);
  expect(asked.out).toContain('Stripe has no customer cus_umbrella');
  const mapped = await npmRun('cli', 'customers', 'set', 'umbrella', 'cus_umbrella', '--no-stripe-check');
  expect(mapped.code, mapped.out).toBe(0);
  expect((await post({ tenant_id: 'umbrella', usage_id: 'oops-2', quantity: 5 })).status).toBe(201);
  await waitFor('the error report to reject it', async () => (await outboxStatus('u:umbrella:oops-2')) === 'rejected_async', 60_000, 500);
  const rejected = await npmRun('cli', 'dead', '--rejected');
  expect(rejected.out).toMatch(/u:umbrella:oops-2.*meter_event_customer_not_found/);
  // Stripe keeps the identifier taken: a retry is refused, a rebill bills it under the next one.
  expect((await npmRun('cli', 'retry', 'u:umbrella:oops-2')).code).toBe(1);
  const added = await npmRun('stripe', 'customers', 'add', 'cus_umbrella');
  expect(added.code, added.out).toBe(0);
  const rebilled = await npmRun('cli', 'rebill', 'u:umbrella:oops-2');
  expect(rebilled.code, rebilled.out).toBe(0);
  expect(rebilled.out).toMatch(/^rebilled u:umbrella:oops-2: .*deliver it as r1:u:umbrella:oops-2/);
  await waitFor('the rebilled event to be sent', async () => (await outboxStatus('u:umbrella:oops-2')) === 'sent', 60_000, 500);
  const recorded = (await npmRun('stripe', 'events', '--customer', 'cus_umbrella')).out;
  expect(recorded).toMatch(/ u:umbrella:oops-2 {2}\(rejected: meter_event_customer_not_found\)/);
  // Counted once: under the new identifier, with no flag.
  expect(recorded).toMatch(/ r1:u:umbrella:oops-2\n/);

  // Ctrl-C: everything npm start started stops, and the endpoints file goes with it.
  const exited = new Promise<void>((resolve) => child!.once('exit', () => resolve()));
  process.kill(-child.pid!, 'SIGINT');
  await Promise.race([exited, new Promise((r) => setTimeout(r, 60_000))]);
  await waitFor('nothing left running', async () => (await serversOn(dataDir)).length === 0, 20_000, 200);
  expect(existsSync(endpointsFile)).toBe(false);
  expect(output).not.toMatch(/"level":50/);
  expect(output).not.toContain(token);
}, 300_000);
