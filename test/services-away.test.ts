/**
 * Worker processes while PostgreSQL or Temporal is away. One started while both are (restarting in
 * a deploy) waits for them, saying so, and then delivers (the API likewise waits for PostgreSQL,
 * then takes usage), and so does one whose Temporal goes away in the middle of its start; one whose
 * services stay away gives up after STARTUP_WAIT_MS with the reason; one pointed at a database that
 * does not exist fails at once, without waiting. Found by the chaos runner: a worker restarted
 * during a Temporal restart exited at once (code 1) and stayed down until something started it
 * again. A running worker rides out a Temporal outage longer than the SDK's own retries.
 *
 * "Away" is a port nobody listens on yet, or a plain TCP proxy to the suite's real PostgreSQL and
 * Temporal that cuts every connection and refuses new ones for a while.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import net from 'node:net';
import { afterAll, beforeAll, expect, inject, it } from 'vitest';
import { freePort } from '../src/embedded/postgres.js';
import { withTransaction } from '../src/db.js';
import { recordUsage } from '../src/outbox/enqueue.js';
import { usePipeline, waitFor } from './hooks.js';

const ENV = { STRIPE_API_KEY: 'sk_test_startup', RELAY_COUNT: '1', LOG_LEVEL: 'info' };
const t = usePipeline({ customers: { a: 'cus_a' }, stripe: { meters: ['api_requests'] }, env: ENV, worker: false });
let env: Record<string, string>;
const children: ChildProcess[] = [];
const proxies: net.Server[] = [];

beforeAll(() => {
  env = { ...ENV, TEMPORAL_TASK_QUEUE: t.config.temporal.taskQueue, STRIPE_API_BASE: t.stripe.url };
});

afterAll(async () => {
  for (const c of children) if (c.exitCode === null) c.kill('SIGKILL');
  await Promise.all(proxies.map((p) => new Promise((r) => p.close(r))));
});

/** The worker as `npm run worker` runs it (or the API, `npm run api`), its output gathered. */
function startWorker(extra: Record<string, string>, script = 'src/bin/worker.ts'): { child: ChildProcess; output: () => string } {
  const child = spawn(process.execPath, ['--import', 'tsx', script], { env: { ...process.env, ...env, ...extra }, stdio: ['ignore', 'pipe', 'pipe'] });
  children.push(child);
  let out = '';
  child.stdout!.on('data', (b: Buffer) => (out += b.toString()));
  child.stderr!.on('data', (b: Buffer) => (out += b.toString()));
  return { child, output: () => out };
}

/** Opens `port` and forwards every connection to `target`, both ways. */
async function proxy(port: number, target: { host: string; port: number }): Promise<void> {
  const server = net.createServer((client) => {
    const upstream = net.connect(target.port, target.host);
    const end = () => {
      client.destroy();
      upstream.destroy();
    };
    client.on('error', end).pipe(upstream).on('error', end).pipe(client);
  });
  proxies.push(server);
  await new Promise<void>((resolve) => server.listen(port, '127.0.0.1', resolve));
}

/** A URL of the suite's PostgreSQL through a port nobody listens on yet, and the proxy that opens it. */
async function postgresAway(): Promise<{ url: string; comeBack: () => Promise<void> }> {
  const port = await freePort();
  const real = new URL(t.db.url);
  const url = new URL(t.db.url);
  url.hostname = '127.0.0.1';
  url.port = String(port);
  return { url: url.toString(), comeBack: () => proxy(port, { host: real.hostname, port: Number(real.port) }) };
}

it('waits for PostgreSQL and then Temporal to come back, saying so, then delivers', async () => {
  const postgres = await postgresAway();
  const temporalPort = await freePort();
  const worker = startWorker({ DATABASE_URL: postgres.url, TEMPORAL_ADDRESS: `127.0.0.1:${temporalPort}`, STARTUP_WAIT_MS: '60000' });

  await waitFor('a try at PostgreSQL', async () => /PostgreSQL cannot be reached yet/.test(worker.output()) || (worker.child.exitCode !== null && Promise.reject(new Error(worker.output()))), 30_000);
  await new Promise((r) => setTimeout(r, 2_000));
  expect(worker.child.exitCode).toBeNull();
  await postgres.comeBack();

  await waitFor('a try at Temporal', async () => /Temporal cannot be reached yet/.test(worker.output()) || (worker.child.exitCode !== null && Promise.reject(new Error(worker.output()))), 30_000);
  expect(worker.child.exitCode).toBeNull();
  const [host, port] = inject('temporalAddress').split(':') as [string, string];
  await proxy(temporalPort, { host, port: Number(port) });

  await waitFor('the worker to run', async () => worker.output().includes('worker running') || (worker.child.exitCode !== null && Promise.reject(new Error(worker.output()))), 60_000);
  const usageId = `startup-${randomUUID()}`;
  const { entry } = await withTransaction(t.pool, (c) => recordUsage(c, { usageId, tenantId: 'a', quantity: 3 }));
  await waitFor('the event billed', async () => t.stripe.events().some((e) => e.identifier === entry.idempotencyKey), 60_000);
  // Each wait was logged with its service and reason, never the password.
  const tries = worker.output().split('\n').filter((l) => l.includes('cannot be reached yet'));
  expect(tries.some((l) => l.includes('"service":"PostgreSQL"') && l.includes('ECONNREFUSED'))).toBe(true);
  expect(tries.some((l) => l.includes('"service":"Temporal"'))).toBe(true);
  const password = new URL(t.db.url).password;
  if (password) expect(worker.output()).not.toContain(password);
  worker.child.kill('SIGTERM');
}, 150_000);

it('gives up after STARTUP_WAIT_MS with the reason, having said what it waited for', async () => {
  const started = Date.now();
  const worker = startWorker({ DATABASE_URL: `postgres://u:p@127.0.0.1:${await freePort()}/db`, TEMPORAL_ADDRESS: inject('temporalAddress'), STARTUP_WAIT_MS: '3000' });
  const code = await new Promise<number | null>((r) => worker.child.once('exit', r));
  expect(code).toBe(1);
  // Tried at 0, 0.5 and 1.5 s (fewer if each try is slow); the next (3.5 s) would be past the 3 s.
  expect(worker.output().match(/PostgreSQL cannot be reached yet/g)?.length).toBeGreaterThanOrEqual(1);
  expect(worker.output().match(/PostgreSQL cannot be reached yet/g)?.length).toBeLessThanOrEqual(2);
  expect(Date.now() - started).toBeLessThan(30_000);
  expect(worker.output()).toMatch(/billing-outbox: connect ECONNREFUSED/);
}, 60_000);

it('a database that does not exist fails at once: not a service that is away', async () => {
  const url = new URL(t.db.url);
  url.pathname = `/missing_${randomUUID().slice(0, 8)}`;
  const started = Date.now();
  const worker = startWorker({ DATABASE_URL: url.toString(), TEMPORAL_ADDRESS: inject('temporalAddress'), STARTUP_WAIT_MS: '60000' });
  const code = await new Promise<number | null>((r) => worker.child.once('exit', r));
  expect(code).toBe(1);
  expect(worker.output()).toMatch(/does not exist/);
  expect(worker.output()).not.toMatch(/cannot be reached yet/);
  expect(Date.now() - started).toBeLessThan(30_000);
}, 60_000);

it('the API started while PostgreSQL is away waits for it, then takes usage', async () => {
  const postgres = await postgresAway();
  const apiPort = await freePort();
  const token = `tok_${randomUUID().replace(/-/g, '')}`;
  const api = startWorker(
    {
      DATABASE_URL: postgres.url,
      TEMPORAL_ADDRESS: inject('temporalAddress'),
      API_PORT: String(apiPort),
      API_TOKENS: JSON.stringify([{ name: 'app', token, tenants: ['*'], scopes: ['usage:write'] }]),
      STARTUP_WAIT_MS: '60000',
    },
    'src/bin/api.ts',
  );
  await waitFor('a try at PostgreSQL', async () => /PostgreSQL cannot be reached yet/.test(api.output()) || (api.child.exitCode !== null && Promise.reject(new Error(api.output()))), 30_000);
  expect(api.child.exitCode).toBeNull();
  await postgres.comeBack();
  await waitFor('the API to listen', async () => api.output().includes('API listening') || (api.child.exitCode !== null && Promise.reject(new Error(api.output()))), 60_000);
  const usageId = `startup-api-${randomUUID()}`;
  const res = await fetch(`http://127.0.0.1:${apiPort}/v1/usage`, {
    method: 'POST',
    headers: { authorization: `Bearer ${token}`, 'content-type': 'application/json' },
    body: JSON.stringify({ tenant_id: 'a', usage_id: usageId, quantity: 1 }),
  });
  expect(res.status, await res.clone().text()).toBeLessThan(300);
  const { rows } = await t.pool.query('SELECT 1 FROM usage_logs WHERE id = $1', [usageId]);
  expect(rows).toHaveLength(1);
  api.child.kill('SIGTERM');
}, 120_000);

/**
 * The suite's Temporal through a proxy that can go away once, for `awayMs`: when the test says
 * (`goAway`), or at a step of the worker's start: `client`, as the server first answers the
 * worker's second connection (its client's, opened after the native one); `worker`, as the native
 * connection makes its next call after that (Worker.create asking about the namespace), which is
 * not let through. Every open connection is cut, and the port refuses until it comes back.
 */
async function temporalThatGoesAway(cut: { at?: 'client' | 'worker'; awayMs: number }): Promise<{ address: string; goAway: () => void; cutAt: () => number | undefined }> {
  const port = await freePort();
  const [host, upstreamPort] = inject('temporalAddress').split(':') as [string, string];
  const open = new Set<net.Socket>();
  let connections = 0;
  let cutAt: number | undefined;
  let server: net.Server;
  const goAway = () => {
    if (cutAt !== undefined) return;
    cutAt = Date.now();
    server.close();
    for (const s of open) s.destroy();
    setTimeout(() => void listen(), cut.awayMs);
  };
  const listen = async (): Promise<void> => {
    server = net.createServer((client) => {
      const nth = ++connections;
      const upstream = net.connect(Number(upstreamPort), host);
      open.add(client).add(upstream);
      const end = () => {
        client.destroy();
        upstream.destroy();
      };
      if (cut.at === 'client' && nth === 2) upstream.once('data', goAway);
      client.on('data', (bytes: Buffer) => {
        if (cut.at === 'worker' && nth === 1 && connections >= 2 && cutAt === undefined) goAway();
        else upstream.write(bytes);
      });
      client.on('error', end).on('end', end);
      upstream.on('error', end).pipe(client);
    });
    proxies.push(server);
    await new Promise<void>((resolve) => server.listen(port, '127.0.0.1', resolve));
  };
  await listen();
  return { address: `127.0.0.1:${port}`, goAway, cutAt: () => cutAt };
}

// Each outage outlasts what the SDK retries by itself (its client's connect, ~10 s; a call of
// Worker.create, ~10 s). Before, the worker exited 1 in both: the client's "Failed to connect"
// was not taken for an unreachable Temporal, and Worker.create was not tried again.
it.each([
  { when: 'as its client connects', cut: { at: 'client' as const, awayMs: 12_000 } },
  { when: 'as Worker.create checks the namespace', cut: { at: 'worker' as const, awayMs: 20_000 } },
])('Temporal going away $when: the worker waits, then delivers', async ({ cut }) => {
  const temporal = await temporalThatGoesAway(cut);
  const worker = startWorker({ DATABASE_URL: t.db.url, TEMPORAL_ADDRESS: temporal.address, STARTUP_WAIT_MS: '60000' });
  await waitFor('the worker to run', async () => worker.output().includes('worker running') || (worker.child.exitCode !== null && Promise.reject(new Error(worker.output()))), 90_000);
  // The outage fell into the start: the worker could only run once Temporal was back.
  expect(Date.now()).toBeGreaterThanOrEqual(temporal.cutAt()! + cut.awayMs);
  const usageId = `startup-${randomUUID()}`;
  const { entry } = await withTransaction(t.pool, (c) => recordUsage(c, { usageId, tenantId: 'a', quantity: 3 }));
  await waitFor('the event billed', async () => t.stripe.events().some((e) => e.identifier === entry.idempotencyKey), 60_000);
  worker.child.kill('SIGTERM');
}, 150_000);

// Past every retry of the SDK's own (a call: ~10 s), with a Stripe call under way as it went: the
// worker keeps running, the event whose call was in flight is billed once, and the one committed
// while Temporal was away is billed once it is back.
it('a running worker through a 15-s Temporal outage: still running, nothing lost or billed twice', async () => {
  const temporal = await temporalThatGoesAway({ awayMs: 15_000 });
  const worker = startWorker({ DATABASE_URL: t.db.url, TEMPORAL_ADDRESS: temporal.address });
  await waitFor('the worker to run', async () => worker.output().includes('worker running') || (worker.child.exitCode !== null && Promise.reject(new Error(worker.output()))), 90_000);
  const record = async (usageId: string) => (await withTransaction(t.pool, (c) => recordUsage(c, { usageId, tenantId: 'a', quantity: 5 }))).entry.idempotencyKey;
  const warm = await record(`outage-warm-${randomUUID()}`);
  await waitFor('the first event billed', async () => t.stripe.events().some((e) => e.identifier === warm), 60_000);

  t.stripe.setLatency(3_000);
  const inFlight = await record(`outage-in-flight-${randomUUID()}`);
  await waitFor('its Stripe call under way', async () => t.stripe.callsInFlight() > 0, 30_000);
  temporal.goAway();
  const during = await record(`outage-during-${randomUUID()}`);
  await new Promise((r) => setTimeout(r, 5_000));
  t.stripe.setLatency(0);

  for (const key of [inFlight, during]) {
    await waitFor(`${key} billed and its row sent`, async () => {
      const { rows } = await t.pool.query<{ status: string }>('SELECT status FROM outbox WHERE idempotency_key = $1', [key]);
      return rows[0]?.status === 'sent' || (worker.child.exitCode !== null && Promise.reject(new Error(worker.output())));
    }, 120_000);
    expect(t.stripe.events().filter((e) => e.identifier === key)).toHaveLength(1);
  }
  expect(Date.now()).toBeGreaterThanOrEqual(temporal.cutAt()! + 15_000);
  expect(worker.child.exitCode).toBeNull();
  worker.child.kill('SIGTERM');
}, 240_000);
