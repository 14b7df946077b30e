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
import { randomUUID } from 'node:crypto';
import { afterAll, beforeAll, expect, inject, it } from 'vitest';
import { freePort } from '../src/embedded/postgres.js';
import { withTransaction } from '../src/db.js';
import { recordUsage } from '../src/outbox/enqueue.js';
import { cleanUpAway, goingAway, proxy, startProcess, untilSaid } from './away.js';
import { usePipeline, waitFor } from './hooks.js';

const ENV = { STRIPE_API_KEY: 'sk_test_startup', RELAY_COUNT: '1', LOG_LEVEL: 'info' };
const t = usePipeline({ customers: { a: 'cus_a' }, stripe: { meters: ['api_requests'] }, env: ENV, worker: false });
let env: Record<string, string>;

beforeAll(() => {
  env = { ...ENV, TEMPORAL_TASK_QUEUE: t.config.temporal.taskQueue, STRIPE_API_BASE: t.stripe.url };
});
afterAll(cleanUpAway);

const startWorker = (extra: Record<string, string>, script?: string) => startProcess({ ...env, ...extra }, script);

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

  await untilSaid(worker, 'PostgreSQL cannot be reached yet', 30_000);
  await new Promise((r) => setTimeout(r, 2_000));
  expect(worker.child.exitCode).toBeNull();
  await postgres.comeBack();

  await untilSaid(worker, 'Temporal cannot be reached yet', 30_000);
  expect(worker.child.exitCode).toBeNull();
  const [host, port] = inject('temporalAddress').split(':') as [string, string];
  await proxy(temporalPort, { host, port: Number(port) });

  await untilSaid(worker, 'worker running', 60_000);
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
  await untilSaid(api, 'PostgreSQL cannot be reached yet', 30_000);
  expect(api.child.exitCode).toBeNull();
  await postgres.comeBack();
  await untilSaid(api, 'API listening', 60_000);
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

/** The suite's Temporal behind a proxy that goes away once (away.ts). */
async function temporalGoingAway(cut: { at?: 'client' | 'worker'; awayMs: number }) {
  const [host, port] = inject('temporalAddress').split(':') as [string, string];
  const away = await goingAway(await freePort(), { host, port: Number(port) }, cut);
  return { ...away, address: `127.0.0.1:${away.port}` };
}

// Each outage outlasts what the SDK retries by itself (its client's connect, ~10 s; a call of
// Worker.create, ~10 s). Before, the worker exited 1 in both: the client's "Failed to connect"
// was not taken for an unreachable Temporal, and Worker.create was not tried again.
it.each([
  { when: 'as its client connects', cut: { at: 'client' as const, awayMs: 12_000 } },
  { when: 'as Worker.create checks the namespace', cut: { at: 'worker' as const, awayMs: 20_000 } },
])('Temporal going away $when: the worker waits, then delivers', async ({ cut }) => {
  const temporal = await temporalGoingAway(cut);
  const worker = startWorker({ DATABASE_URL: t.db.url, TEMPORAL_ADDRESS: temporal.address, STARTUP_WAIT_MS: '60000' });
  await untilSaid(worker, 'worker running', 90_000);
  // The outage fell into the start: the worker could only run once Temporal was back.
  expect(Date.now()).toBeGreaterThanOrEqual(temporal.cutAt()! + cut.awayMs);
  const usageId = `startup-${randomUUID()}`;
  const { entry } = await withTransaction(t.pool, (c) => recordUsage(c, { usageId, tenantId: 'a', quantity: 3 }));
  await waitFor('the event billed', async () => t.stripe.events().some((e) => e.identifier === entry.idempotencyKey), 60_000);
  worker.child.kill('SIGTERM');
}, 150_000);
