/**
 * Stripe's limits, enforced by the local Stripe server exactly as Stripe does (429 with Stripe's
 * body): one concurrent call per customer per meter, and an account-wide rate.
 */
import { spawn, type ChildProcess } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import type { Config } from '../src/config.js';
import { LocalStripe } from '../src/embedded/stripe/server.js';
import { createTestDb, startTestPipeline, testConfig, waitFor, type TestDb, type TestPipeline } from './helpers.js';
import { seedCustomers } from './hooks.js';

let db: TestDb;
let stripe: LocalStripe | undefined;
let pipeline: TestPipeline | undefined;
const children: ChildProcess[] = [];

beforeAll(async () => {
  db = await createTestDb();
});

afterEach(async () => {
  for (const c of children.splice(0)) if (c.exitCode === null) c.kill('SIGKILL');
  await pipeline?.stop();
  pipeline = undefined;
  await stripe?.close();
  stripe = undefined;
});

afterAll(async () => {
  await db?.drop();
});

/** A tenant's Stripe customer id (Stripe's have no '-'). */
const customerOf = (tenant: string) => `cus_${tenant.replaceAll('-', '_')}`;

/** Customers c0…c(n-1) in our table and at the local Stripe. */
async function customers(n: number, prefix: string): Promise<string[]> {
  const tenants = Array.from({ length: n }, (_, i) => `${prefix}-${i}`);
  await seedCustomers(db.pool, Object.fromEntries(tenants.map((t) => [t, customerOf(t)])));
  for (const t of tenants) stripe!.addCustomer(customerOf(t));
  return tenants;
}

/**
 * A backlog committed at once, as after an outage: one statement, round-robin over tenants. Each
 * row gets the key recordUsage would give it (src/outbox/keys.ts; these tenants need no escaping).
 */
async function backlog(n: number, tenants: string[], prefix: string): Promise<void> {
  await db.pool.query(
    `WITH u AS (
       INSERT INTO usage_logs (id, tenant_id, event_name, quantity, occurred_at)
       SELECT $3 || g, ($2::text[])[1 + g % array_length($2::text[], 1)], 'api_requests', 1 + g % 7, now()
       FROM generate_series(1, $1::int) g
       RETURNING id, tenant_id, event_name, quantity, occurred_at)
     INSERT INTO outbox (tenant_id, usage_id, event_name, quantity, occurred_at, idempotency_key)
     SELECT tenant_id, id, event_name, quantity, occurred_at, 'u:' || tenant_id || ':' || id FROM u`,
    [n, tenants, prefix],
  );
}

function workerEnv(config: Config): Record<string, string> {
  return {
    TEMPORAL_ADDRESS: config.temporal.address!,
    TEMPORAL_TASK_QUEUE: config.temporal.taskQueue,
    DATABASE_URL: db.url,
    STRIPE_API_BASE: config.stripe.apiBase,
    STRIPE_API_KEY: 'sk_test_limits',
    STRIPE_RATE_LIMIT_PER_SECOND: String(config.stripe.rateLimitPerSecond),
    RELAY_COUNT: '2',
    RELAY_POLL_INTERVAL_MS: '200',
    LOG_LEVEL: 'info',
  };
}

async function workerProcess(config: Config): Promise<void> {
  const child = spawn(process.execPath, ['--import', 'tsx', 'src/bin/worker.ts'], {
    env: { ...process.env, ...workerEnv(config) },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  children.push(child);
  let output = '';
  child.stdout!.on('data', (b: Buffer) => (output += b.toString()));
  child.stderr!.on('data', (b: Buffer) => (output += b.toString()));
  await waitFor('a worker process', async () => output.includes('worker running') || (child.exitCode !== null && Promise.reject(new Error(output))), 90_000);
}

async function sentCount(prefix: string): Promise<number> {
  const { rows } = await db.pool.query(`SELECT count(*)::int AS n FROM outbox WHERE usage_id LIKE $1 AND status = 'sent'`, [`${prefix}%`]);
  return rows[0].n;
}

function expectEachBilledOnce(prefix: string, n: number): void {
  const ours = stripe!.events().filter((e) => e.identifier.includes(`:${prefix}`));
  expect(ours).toHaveLength(n);
  expect(new Set(ours.map((e) => e.identifier)).size).toBe(n);
}

describe("Stripe's limits", () => {
  it('never has two calls in flight for one customer and meter, with three worker processes', async () => {
    // Slow answers make overlapping calls likely if anything let them happen.
    stripe = await LocalStripe.start({ meters: ['api_requests'], enforcePerCustomerConcurrency: true });
    stripe.setLatency(60);
    const config = testConfig({ STRIPE_API_BASE: stripe.url, STRIPE_API_KEY: 'sk_test_limits', STRIPE_RATE_LIMIT_PER_SECOND: '500', RELAY_COUNT: '2' });
    const tenants = await customers(3, `sf-${randomUUID().slice(0, 6)}`);
    pipeline = await startTestPipeline({ db, config, worker: false });
    await Promise.all([workerProcess(config), workerProcess(config), pipeline.addWorker()]);

    const prefix = `sf-${randomUUID()}-`;
    await backlog(90, tenants, prefix);
    await waitFor('the backlog to drain', async () => (await sentCount(prefix)) === 90, 120_000, 250);

    expectEachBilledOnce(prefix, 90);
    for (const t of tenants) expect(stripe.maxConcurrencySeen(customerOf(t), 'api_requests'), t).toBe(1);
    // Stripe never had to refuse a concurrent call.
    expect(stripe.requests().filter((r) => r.status === 429)).toEqual([]);
  }, 240_000);

  it('holds the account rate limit under a 5,000-event backlog: no storm of 429s', async () => {
    // Stripe (here) allows 10 calls per second; we are configured for 8. The backlog is far more
    // than the window below can drain, so the limiter is what sets the pace.
    stripe = await LocalStripe.start({ meters: ['api_requests'], rateLimitPerSecond: 10 });
    const config = testConfig({ STRIPE_API_BASE: stripe.url, STRIPE_API_KEY: 'sk_test_limits', STRIPE_RATE_LIMIT_PER_SECOND: '8', RELAY_COUNT: '2', RELAY_BATCH_SIZE: '500' });
    const tenants = await customers(200, `rl-${randomUUID().slice(0, 6)}`);
    const prefix = `rl-${randomUUID()}-`;
    await backlog(5_000, tenants, prefix);
    // Three workers share the one limit: two worker processes and one in this process.
    pipeline = await startTestPipeline({ db, config, worker: false });
    await Promise.all([workerProcess(config), workerProcess(config), pipeline.addWorker()]);

    // The window's length is the measurement (calls over time), not a wait for something to happen.
    const windowMs = 25_000;
    await waitFor('the first call', async () => stripe!.requests().length > 0, 60_000);
    await new Promise((r) => setTimeout(r, windowMs));
    // The relays dispatch at the same pace: the backlog stays pending in the outbox instead of
    // becoming thousands of workflows waiting for a call slot. What left `pending` is at most what
    // the pace allows since the first dispatch, plus a few seconds' worth (claimed, not yet paced).
    const { rows: left } = await db.pool.query<{ n: number; seconds: number }>(
      `SELECT count(*)::int AS n, extract(epoch FROM now() - min(dispatched_at))::float8 AS seconds
         FROM outbox WHERE usage_id LIKE $1 AND status <> 'pending'`,
      [`${prefix}%`],
    );
    expect(left[0]!.n).toBeGreaterThan(50);
    expect(left[0]!.n, `${left[0]!.n} dispatched in ${left[0]!.seconds} s`).toBeLessThanOrEqual(Math.ceil(8 * (left[0]!.seconds + 3)));
    const requests = stripe.requests();
    const limited = requests.filter((r) => r.status === 429);
    const spanMs = requests.at(-1)!.at - requests[0]!.at;
    const callsPerSecond = ((requests.length - 1) / spanMs) * 1000;

    // Not a storm: at most 1% of calls refused (bursts at the start of a window), each one retried.
    expect(limited.length).toBeLessThanOrEqual(Math.ceil(requests.length / 100));
    // The pace is the configured limit, never above it (measured over the whole window).
    expect(callsPerSecond).toBeLessThanOrEqual(8 * 1.1);
    expect(requests.length).toBeGreaterThan(50);
    // Whatever was sent so far was sent once.
    const accepted = stripe.events().filter((e) => e.identifier.includes(`:${prefix}`));
    expect(new Set(accepted.map((e) => e.identifier)).size).toBe(accepted.length);
  }, 180_000);
});
