/**
 * The library's worker (billing-outbox/worker, `createWorker`) as an application runs it: on the
 * application's own pool or on a URL, against the shared Temporal dev server and the local
 * Stripe-compatible server; its drain at shutdown, its GET /health, and its refusal of bad options.
 */
import { spawn } from 'node:child_process';
import { randomUUID } from 'node:crypto';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import path from 'node:path';
import net from 'node:net';
import { Client, Connection } from '@temporalio/client';
import { NativeConnection } from '@temporalio/worker';
import pg from 'pg';
import { afterAll, afterEach, describe, expect, inject, it } from 'vitest';
import { ConfigError } from '../src/config.js';
import { migrate, pendingMigrations } from '../src/db.js';
import { KEY_FILE_RECHECK_MS } from '../src/key-file.js';
import { createLogger } from '../src/log.js';
import { createWorker, type CreateWorkerOptions, type WorkerHandle } from '../src/worker.js';
import { freePort } from '../src/embedded/postgres.js';
import { schemaFor } from '../src/outbox/sql/schema.js';
import { cleanUpAway, goingAway } from './away.js';
import { useStripe, waitFor, workflowBundle } from './hooks.js';

const t = useStripe({ customers: { acme: 'cus_acme' }, stripe: { meters: ['api_requests'] } });

const workers: WorkerHandle[] = [];
const pools: pg.Pool[] = [];
const queues: string[] = [];

/** Options as an application would write them, with test timings; a task queue of the test's own. */
function options(database: CreateWorkerOptions['database'], extra: Partial<CreateWorkerOptions> = {}): CreateWorkerOptions {
  const taskQueue = `worker-api-${randomUUID()}`;
  queues.push(taskQueue);
  return {
    database,
    temporal: { address: inject('temporalAddress') },
    taskQueue,
    stripe: { apiKey: 'sk_test_worker_api', apiBase: t.stripe.url, unansweredHoldMs: 300 },
    tuning: { relayCount: 1, relayPollIntervalMs: 200, retryInitialIntervalMs: 50, retryMaximumIntervalMs: 200, retryMaximumAttempts: 4 },
    workflowBundle: workflowBundle(),
    workerOptions: { shutdownGraceTime: '10 seconds' },
    ...extra,
  };
}

async function started(opts: CreateWorkerOptions): Promise<{ worker: WorkerHandle; running: Promise<void> }> {
  const worker = await createWorker(opts);
  workers.push(worker);
  return { worker, running: worker.run() };
}

/** A pool as an application makes it: no type parsers of ours. */
function applicationPool(url = t.db.url): pg.Pool {
  const pool = new pg.Pool({ connectionString: url, max: 5 });
  pools.push(pool);
  return pool;
}

afterAll(cleanUpAway);

afterEach(async () => {
  for (const w of workers.splice(0)) await w.shutdown();
  // The relay workflows outlive their workers (each worker starts them if absent): ended here.
  const connection = await Connection.connect({ address: inject('temporalAddress') });
  const client = new Client({ connection });
  for (const taskQueue of queues.splice(0)) {
    for await (const wf of client.workflow.list({ query: `TaskQueue = "${taskQueue}" AND ExecutionStatus = "Running"` })) {
      await client.workflow.getHandle(wf.workflowId).terminate('test finished').catch(() => undefined);
    }
  }
  await connection.close();
  for (const p of pools.splice(0)) await p.end();
});

describe('createWorker', () => {
  it("on the application's pool: delivers, answers /health, and leaves the pool open and as it was", async () => {
    const pool = applicationPool();
    const warnings: string[] = [];
    const log = createLogger('warn', { write: (line: string) => void warnings.push(line) });
    const { worker, running } = await started(options(pool, { http: { port: 0 }, log }));
    // The pool opens connections without a time limit (as pg's default): its owner is told.
    expect(warnings.filter((w) => w.includes('connectionTimeoutMillis'))).toHaveLength(1);
    // Nor does anybody listen to its 'error' events (an idle connection's error would end the process).
    expect(warnings.filter((w) => w.includes("no 'error' listener"))).toHaveLength(1);
    const key = await t.enqueue('acme', 7);
    await t.waitStatus(key, 'sent');
    expect(t.eventsFor(key)).toHaveLength(1);

    const health = await fetch(`${worker.url}/health`);
    expect(health.status).toBe(200);
    expect(await health.json()).toMatchObject({ status: 'ok', worker: 'running', postgres: 'ok', temporal: 'ok', taskQueue: worker.taskQueue });
    expect((await fetch(`${worker.url}/metrics`)).status).toBe(200);

    await worker.shutdown();
    await running;
    // Still the application's: open, and reading bigint as pg does by default (a string).
    const { rows } = await pool.query<{ big: unknown }>('SELECT 9007199254740993::bigint AS big');
    expect(rows[0]!.big).toBe('9007199254740993');
    await expect(fetch(`${worker.url}/health`)).rejects.toThrow();
  });

  it('with stripe.apiKeyFile (a mounted secret): a key rolled in the file is taken up while it runs, with no restart', async () => {
    const dir = mkdtempSync(path.join(tmpdir(), 'worker-api-key-'));
    const file = path.join(dir, 'stripe-api-key');
    writeFileSync(file, 'sk_test_embedded_before\n');
    t.stripe.rollApiKey('sk_test_embedded_before');
    try {
      const { worker, running } = await started(options(t.db.url, { stripe: { apiKeyFile: file, apiBase: t.stripe.url, unansweredHoldMs: 300 } }));
      const before = await t.enqueue('acme', 1);
      await t.waitStatus(before, 'sent');
      // Rolled in the file, then the old key expired at Stripe: the worker reads the file again
      // (at most every KEY_FILE_RECHECK_MS) and sends the new one.
      writeFileSync(file, 'sk_test_embedded_after\n');
      await new Promise((resolve) => setTimeout(resolve, KEY_FILE_RECHECK_MS + 500));
      t.stripe.rollApiKey('sk_test_embedded_after');
      const after = await t.enqueue('acme', 2);
      const sent = await t.waitStatus(after, 'sent');
      expect(sent.attempt_count).toBe(1);
      expect(t.eventsFor(after)).toHaveLength(1);
      await worker.shutdown();
      await running;
    } finally {
      t.stripe.rollApiKey(undefined);
      rmSync(dir, { recursive: true, force: true });
    }
  });

  it('on a URL: delivers, then ends its own pool at shutdown', async () => {
    const { worker, running } = await started(options(t.db.url));
    const key = await t.enqueue('acme', 2);
    await t.waitStatus(key, 'sent');
    const connections = async () =>
      Number((await t.pool.query<{ n: string }>("SELECT count(*) AS n FROM pg_stat_activity WHERE datname = current_database() AND application_name LIKE 'billing-outbox%' AND pid <> pg_backend_pid()")).rows[0]!.n);
    expect(await connections()).toBeGreaterThan(0);
    await worker.shutdown();
    await running;
    // The test's own pool is also named billing-outbox: only the worker's connections may go.
    const ours = await t.pool.query<{ n: string }>(
      "SELECT count(*) AS n FROM pg_stat_activity WHERE datname = current_database() AND application_name = 'billing-outbox-listen'",
    );
    expect(Number(ours.rows[0]!.n)).toBe(0);
    expect((await worker.health()).worker).toBe('stopped');
  });

  it("on the application's own Temporal connection: delivers, and leaves the connection open", async () => {
    const connection = await NativeConnection.connect({ address: inject('temporalAddress') });
    try {
      const opts = options(t.db.url);
      const { worker, running } = await started({ ...opts, temporal: { connection } });
      const key = await t.enqueue('acme', 9);
      await t.waitStatus(key, 'sent');
      // Its health asks that connection's server, not the default address (nothing, or another server).
      expect(await worker.health()).toMatchObject({ status: 'ok', temporal: 'ok' });
      await worker.shutdown();
      await running;
      // Still the application's: a call on it succeeds after the worker has gone.
      await expect(connection.workflowService.getSystemInfo({})).resolves.toBeDefined();
      await expect(createWorker({ ...opts, temporal: { connection, address: 'elsewhere:7233' } })).rejects.toThrow(/temporal\.address: is set with temporal\.connection/);
    } finally {
      await connection.close();
    }
  });

  it('a shutdown while an event is at Stripe drains it: the event ends sent, once', async () => {
    // On a URL: the pool the delivery finishes on is the worker's own, closed only after the drain.
    const { worker, running } = await started(options(t.db.url));
    t.stripe.setLatency(1_500);
    try {
      const key = await t.enqueue('acme', 5);
      await waitFor(`${key} to reach Stripe`, async () => t.requestsFor(key).length > 0);
      await worker.shutdown();
      await running;
      // No worker is left on this task queue: the row was finished by the one that drained.
      expect((await t.row(key)).status).toBe('sent');
      expect(t.eventsFor(key)).toHaveLength(1);
    } finally {
      t.stripe.setLatency(0);
    }
  });

  it('a shutdown while the start waits for Temporal to come back ends the wait at once: stopped, not after STARTUP_WAIT_MS', async () => {
    const [host, port] = inject('temporalAddress').split(':') as [string, string];
    // Temporal goes away as Worker.create asks about the namespace, for longer than this test lasts.
    const away = await goingAway(await freePort(), { host, port: Number(port) }, { at: 'worker', awayMs: 120_000 });
    const lines: string[] = [];
    const opts = options(t.db.url, { temporal: { address: `127.0.0.1:${away.port}` }, log: createLogger('warn', { write: (line: string) => void lines.push(line) }) });
    const worker = await createWorker({ ...opts, tuning: { ...opts.tuning, startupWaitMs: 60_000 } });
    const running = worker.run();
    await waitFor('the start to wait for Temporal', async () => lines.some((l) => l.includes('Temporal cannot be reached yet')), 60_000);
    const asked = Date.now();
    await worker.shutdown();
    await running;
    expect(Date.now() - asked).toBeLessThan(5_000);
    expect((await worker.health()).worker).toBe('stopped');
  }, 120_000);

  it('says 503 and why: not yet running, or PostgreSQL unreachable', async () => {
    const { worker: idle } = { worker: await createWorker(options(applicationPool(), { http: { port: 0 } })) };
    workers.push(idle);
    const before = await fetch(`${idle.url}/health`);
    expect(before.status).toBe(503);
    expect(await before.json()).toMatchObject({ status: 'unavailable', worker: 'starting', postgres: 'ok' });

    const away = new URL(t.db.url);
    away.port = '1';
    const unreachable = await createWorker(options(applicationPool(away.toString()), { migrate: false }));
    workers.push(unreachable);
    expect(await unreachable.health()).toMatchObject({ status: 'unavailable', postgres: 'error' });
  });

  it('told not to migrate, refuses to start on a schema behind its version, naming what it lacks; migrated, it starts', async () => {
    const schema = `behind_${randomUUID().slice(0, 8)}`;
    try {
      // A schema never migrated, then one whose record of migrations lacks this version's: each is
      // refused, naming the migration missing.
      for (const lacking of [false, true]) {
        if (lacking) {
          await migrate(t.db.url, { schema });
          await t.pool.query(`DELETE FROM ${schemaFor(schema).schemaMigrations} WHERE name = '001_schema.sql'`);
        }
        const refused = createWorker(options(applicationPool(), { schema, migrate: false }));
        await expect(refused).rejects.toThrow(ConfigError);
        await expect(refused).rejects.toThrow('not migrated to this version of billing-outbox (missing 001_schema.sql)');
      }
      await t.pool.query(`DROP SCHEMA ${schemaFor(schema).quoted} CASCADE`);

      await migrate(t.db.url, { schema });
      expect(await pendingMigrations(t.pool, { schema })).toEqual([]);
      workers.push(await createWorker(options(applicationPool(), { schema, migrate: false })));
    } finally {
      await t.pool.query(`DROP SCHEMA IF EXISTS ${schema} CASCADE`);
    }
  });

  it('refuses bad or missing options, each named, before opening anything', async () => {
    const bad = createWorker({
      database: 'mysql://app@db/app',
      stripe: { meterApi: 'v3' as 'v1' },
      taskQueue: 'q',
      tuning: { relayCount: 0, relayCont: 2 } as never,
    });
    await expect(bad).rejects.toBeInstanceOf(ConfigError);
    const message = await bad.catch((err: Error) => err.message);
    expect(message).toContain('database: must be a postgres:// or postgresql:// URL');
    expect(message).toContain('stripe.meterApi: must be v1');
    expect(message).toContain('tuning.relayCount: must be at least 1');
    expect(message).toContain('tuning.relayCont: is not an option');
    expect(message).toContain('stripe.apiKey: is required');

    // Blank is not given (as in the environment): `apiBase: process.env.STRIPE_API_BASE` set but empty is Stripe itself.
    for (const stripe of [{ apiBase: '' }, { apiBase: ' ', apiKey: '' }, { apiKey: '  ' }, { apiBase: 'https://api.stripe.com:443' }, { apiBase: 'https://API.stripe.com/' }]) {
      await expect(createWorker({ database: t.db.url, stripe, taskQueue: 'q' }), JSON.stringify(stripe)).rejects.toThrow(/stripe\.apiKey: is required/);
    }
    await expect(createWorker({ stripe: { apiKey: 'sk_test_x' } } as CreateWorkerOptions)).rejects.toThrow(/database: is required/);
    await expect(
      createWorker({ database: t.db.url, stripe: { apiKey: 'sk_test_x' }, temporal: { tls: { certFile: '/nonexistent/client.pem' } } }),
    ).rejects.toThrow(/temporal\.tls\.certFile: mTLS needs both temporal\.tls\.certFile and temporal\.tls\.keyFile/);
    // A key read from a file: a problem with it names the file's option, not apiKey.
    const keys = mkdtempSync(path.join(tmpdir(), 'worker-api-bad-key-'));
    try {
      const notAKey = path.join(keys, 'stripe-api-key');
      writeFileSync(notAKey, 'not-a-stripe-key\n');
      await expect(createWorker({ database: t.db.url, stripe: { apiKeyFile: notAKey }, taskQueue: 'q' })).rejects.toThrow(/stripe\.apiKeyFile: /);
      // Both given: named as the two options they are.
      await expect(createWorker({ database: t.db.url, stripe: { apiKey: 'sk_test_x', apiKeyFile: notAKey }, taskQueue: 'q' })).rejects.toThrow(
        /stripe\.apiKeyFile: stripe\.apiKey is set too/,
      );
      const cloudKey = path.join(keys, 'temporal-api-key');
      writeFileSync(cloudKey, 'cloud-key\n');
      const plain = createWorker({ database: t.db.url, stripe: { apiKey: 'sk_test_x' }, temporal: { apiKeyFile: cloudKey, tls: false } });
      await expect(plain).rejects.toThrow(/temporal\.apiKeyFile: /);
      await expect(plain).rejects.not.toThrow(/temporal\.apiKey: /);
    } finally {
      rmSync(keys, { recursive: true, force: true });
    }
    // What the worker sets itself: another task queue would have it poll away from its own relays.
    const polled = createWorker({ database: t.db.url, stripe: { apiKey: 'sk_test_x' }, taskQueue: 'a', workerOptions: { taskQueue: 'b', namespace: 'other' } });
    await expect(polled).rejects.toThrow(/workerOptions\.taskQueue: is set by the worker itself; use the option taskQueue/);
    await expect(polled).rejects.toThrow(/workerOptions\.namespace: is set by the worker itself; use the option temporal\.namespace/);
    // null where an object belongs: named, not a TypeError.
    const nulls = createWorker({ database: t.db.url, stripe: { apiKey: 'sk_test_x' }, temporal: null, http: null } as unknown as CreateWorkerOptions);
    await expect(nulls).rejects.toBeInstanceOf(ConfigError);
    await expect(nulls).rejects.toThrow(/temporal: must be an object/);
    await expect(nulls).rejects.toThrow(/http: must be an object/);
  });
});

/**
 * A process of its own beside this test's world (its database, Temporal and Stripe, a task queue of
 * its own), running `script`; its output is collected as it comes.
 */
function spawnBeside(script: string, env: Record<string, string>): { child: ReturnType<typeof spawn>; output: () => string; taskQueue: string } {
  const taskQueue = `worker-process-${randomUUID()}`;
  queues.push(taskQueue);
  const child = spawn(process.execPath, ['--import', 'tsx', script], {
    env: {
      PATH: process.env.PATH ?? '',
      DATABASE_URL: t.db.url,
      TEMPORAL_ADDRESS: inject('temporalAddress'),
      TEMPORAL_TASK_QUEUE: taskQueue,
      STRIPE_API_BASE: t.stripe.url,
      ...env,
    },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  let output = '';
  child.stdout!.on('data', (b: Buffer) => (output += b.toString()));
  child.stderr!.on('data', (b: Buffer) => (output += b.toString()));
  return { child, output: () => output, taskQueue };
}

it("leaves the application's signals and standard error alone: no listener for SIGINT, SIGTERM, SIGQUIT or SIGUSR2 without handleSignals (the SDK's default runtime takes all four), no line without log", async () => {
  const { child, output } = spawnBeside('test/fixtures/library-worker.ts', { WORKFLOW_BUNDLE: inject('workflowBundlePath') });
  const code = await new Promise<number | null>((resolve) => child.on('exit', resolve));
  expect(code, output()).toBe(0);
  const none = { SIGINT: 0, SIGTERM: 0, SIGQUIT: 0, SIGUSR2: 0 };
  const counts = output().split('\n').findLast((line) => line.startsWith('{"before"'));
  expect(JSON.parse(counts ?? 'null')).toEqual({ before: none, whileRunning: none, after: none });
  // Nor its standard error: without `log`, the SDK's runtime says nothing there either (its default
  // logger wrote every start-up step and every event's line).
  expect(output().trim().split('\n')).toEqual([counts]);
}, 60_000);

describe('billing-outbox worker (the standalone process, on the same launch)', () => {
  it('serves GET /health on WORKER_METRICS_PORT while it runs, and drains and exits 0 on SIGTERM', async () => {
    const port = await new Promise<number>((resolve) => {
      const probe = net.createServer().listen(0, '127.0.0.1', () => {
        const { port: p } = probe.address() as net.AddressInfo;
        probe.close(() => resolve(p));
      });
    });
    const { child, output: said, taskQueue } = spawnBeside('src/bin/worker.ts', {
      STRIPE_API_KEY: 'sk_test_worker_bin',
      RELAY_COUNT: '1',
      WORKER_METRICS_PORT: String(port),
      LOG_LEVEL: 'info',
    });
    const exited = new Promise<number | null>((resolve) => child.on('exit', (code) => resolve(code)));
    try {
      await waitFor('the worker to run', async () => said().includes('billing-outbox worker running') || (child.exitCode !== null && Promise.reject(new Error(said()))), 60_000);
      const health = await fetch(`http://127.0.0.1:${port}/health`);
      expect(health.status).toBe(200);
      expect(await health.json()).toMatchObject({ status: 'ok', worker: 'running', taskQueue });
      const key = await t.enqueue('acme', 4);
      await t.waitStatus(key, 'sent');
      child.kill('SIGTERM');
      expect(await exited, said()).toBe(0);
      expect(said()).toContain('worker stopped');
    } finally {
      if (child.exitCode === null) child.kill('SIGKILL');
    }
  });
});
