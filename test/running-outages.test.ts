/**
 * A running worker through an outage of PostgreSQL or of Temporal longer than the retries of the
 * SDKs and pools in between (a Temporal call: ~10 s), with a Stripe call under way as it went:
 * the worker keeps running, the event whose call was in flight is billed once, and one committed
 * while the service was away is billed once it is back. The service goes away for the worker only
 * (a proxy in front of it, away.ts): the test itself commits through the real one.
 */
import { randomUUID } from 'node:crypto';
import { afterAll, expect, inject, it } from 'vitest';
import { freePort } from '../src/embedded/postgres.js';
import { withTransaction } from '../src/db.js';
import { recordUsage } from '../src/outbox/enqueue.js';
import { cleanUpAway, goingAway, startProcess, untilSaid, type GoingAway } from './away.js';
import { usePipeline, waitFor } from './hooks.js';

const ENV = { STRIPE_API_KEY: 'sk_test_outages', RELAY_COUNT: '1', LOG_LEVEL: 'info' };
const t = usePipeline({ customers: { a: 'cus_a' }, stripe: { meters: ['api_requests'] }, env: ENV, worker: false });
afterAll(cleanUpAway);

/** The worker's addresses, with `service` behind a proxy that goes away for `awayMs`. */
async function workerBehind(service: 'PostgreSQL' | 'Temporal', awayMs: number): Promise<{ env: Record<string, string>; away: GoingAway }> {
  const [temporalHost, temporalPort] = inject('temporalAddress').split(':') as [string, string];
  const db = new URL(t.db.url);
  if (service === 'Temporal') {
    const away = await goingAway(await freePort(), { host: temporalHost, port: Number(temporalPort) }, { awayMs });
    return { env: { DATABASE_URL: t.db.url, TEMPORAL_ADDRESS: `127.0.0.1:${away.port}` }, away };
  }
  const away = await goingAway(await freePort(), { host: db.hostname, port: Number(db.port) }, { awayMs });
  const url = new URL(t.db.url);
  url.hostname = '127.0.0.1';
  url.port = String(away.port);
  return { env: { DATABASE_URL: url.toString(), TEMPORAL_ADDRESS: inject('temporalAddress') }, away };
}

it.each([
  { service: 'Temporal' as const, awayMs: 15_000 },
  { service: 'PostgreSQL' as const, awayMs: 20_000 },
])('a running worker through a $awayMs ms $service outage: still running, nothing lost or billed twice', async ({ service, awayMs }) => {
  const { env, away } = await workerBehind(service, awayMs);
  const httpPort = await freePort();
  const worker = startProcess({ ...ENV, ...env, TEMPORAL_TASK_QUEUE: t.config.temporal.taskQueue, STRIPE_API_BASE: t.stripe.url, WORKER_METRICS_PORT: String(httpPort) });
  const health = async () => (await fetch(`http://127.0.0.1:${httpPort}/health`)).json();
  await untilSaid(worker, 'worker running', 90_000);
  const record = async (usageId: string) => (await withTransaction(t.pool, (c) => recordUsage(c, { usageId, tenantId: 'a', quantity: 5 }))).entry.idempotencyKey;
  const warm = await record(`outage-warm-${randomUUID()}`);
  await waitFor('the first event billed', async () => t.stripe.events().some((e) => e.identifier === warm), 60_000);

  t.stripe.setLatency(3_000);
  const inFlight = await record(`outage-in-flight-${randomUUID()}`);
  await waitFor('its Stripe call under way', async () => t.stripe.callsInFlight() > 0, 30_000);
  away.goAway();
  const during = await record(`outage-during-${randomUUID()}`);
  await new Promise((r) => setTimeout(r, 5_000));
  // GET /health says which service is away; Temporal away leaves the worker `ok`: it waits it out.
  expect(await health()).toMatchObject(
    service === 'Temporal'
      ? { status: 'ok', worker: 'running', postgres: 'ok', temporal: expect.stringMatching(/^(error|timeout)$/) }
      : { status: 'unavailable', worker: 'running', postgres: expect.stringMatching(/^(error|timeout)$/), temporal: 'ok' },
  );
  t.stripe.setLatency(0);

  for (const key of [inFlight, during]) {
    await waitFor(`${key} billed and its row sent`, async () => {
      const { rows } = await t.pool.query<{ status: string }>('SELECT status FROM outbox WHERE idempotency_key = $1', [key]);
      return rows[0]?.status === 'sent' || (worker.child.exitCode !== null && Promise.reject(new Error(worker.output())));
    }, 120_000);
    expect(t.stripe.events().filter((e) => e.identifier === key)).toHaveLength(1);
  }
  expect(Date.now()).toBeGreaterThanOrEqual(away.cutAt()! + awayMs);
  // Committed during the outage, it goes out soon after the outage ends: seconds of reconnecting,
  // not a relay claim's 60 s lapse (a generous bound: CI's two cores are shared).
  const { rows } = await t.pool.query<{ sent_at: Date }>('SELECT sent_at FROM outbox WHERE idempotency_key = $1', [during]);
  expect(rows[0]!.sent_at.getTime() - (away.cutAt()! + awayMs)).toBeLessThan(30_000);
  // Both answer again (within the health connection's short reconnect backoff).
  await waitFor('GET /health to see both back', async () => (await health()).temporal === 'ok', 15_000, 500);
  expect(await health()).toMatchObject({ status: 'ok', worker: 'running', postgres: 'ok', temporal: 'ok' });
  expect(worker.child.exitCode).toBeNull();
  worker.child.kill('SIGTERM');
}, 240_000);
