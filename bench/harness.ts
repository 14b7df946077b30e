/**
 * What every benchmark shares: real services started here (embedded PostgreSQL, a Temporal dev
 * server configured as `npm start` configures it, the local Stripe-compatible server), a fresh
 * database per measurement, a worker of billing-outbox in this process, and the report (a table on
 * screen, every figure as JSON under bench/results/).
 */
import { randomUUID } from 'node:crypto';
import { chmod, mkdir, mkdtemp, rm, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { Client } from '@temporalio/client';
import { bundleWorkflowCode, NativeConnection, type WorkerOptions } from '@temporalio/worker';
import type pg from 'pg';
import { loadConfig, type Config } from '../src/config.js';
import { createPool, migrate } from '../src/db.js';
import { startEmbeddedPostgres, type EmbeddedPg } from '../src/embedded/postgres.js';
import { startTemporalDevServer, type DevServer } from '../src/embedded/temporal.js';
import { createStripeClient } from '../src/stripe/client.js';
import { LocalStripe } from '../src/embedded/stripe/server.js';
import { installTemporalRuntime } from '../src/temporal/runtime.js';
import { startWorker, WORKFLOWS_PATH, type RunningWorker } from '../src/temporal/worker.js';
import { schemaFor } from '../src/outbox/sql/schema.js';

installTemporalRuntime(undefined, 'ERROR');

export const quietLogger = { trace() {}, debug() {}, info() {}, warn() {}, error() {}, log() {} };

export interface Services {
  pg: EmbeddedPg;
  temporal: DevServer;
  stop(): Promise<void>;
}

export async function startServices(opts: { taskQueueFairness?: boolean } = {}): Promise<Services> {
  const tmp = await mkdtemp(path.join(os.tmpdir(), 'billing-outbox-bench-'));
  await chmod(tmp, 0o755);
  const pgServer = await startEmbeddedPostgres({
    dataDir: path.join(tmp, 'pg'),
    database: 'postgres',
    persistent: false,
    // Where PostgreSQL's time per event goes, statement by statement (`--statements`).
    settings: ['shared_preload_libraries=pg_stat_statements'],
  });
  const temporal = await startTemporalDevServer({ dbFile: path.join(tmp, 'temporal.db'), taskQueueFairness: opts.taskQueueFairness });
  return {
    pg: pgServer,
    temporal,
    async stop() {
      await temporal.stop();
      await pgServer.stop();
      await rm(tmp, { recursive: true, force: true });
    },
  };
}

/** The statements that took PostgreSQL's time in `pool`'s database since the last reset, most first. */
export async function topStatements(pool: pg.Pool, limit = 8): Promise<{ ms: number; calls: number; msPerCall: number; statement: string }[]> {
  const { rows } = await pool.query<{ ms: number; calls: number; query: string }>(
    `SELECT total_exec_time::float8 AS ms, calls::int, query FROM pg_stat_statements
      WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
      ORDER BY total_exec_time DESC LIMIT $1`,
    [limit],
  );
  return rows.map((r) => ({ ms: Math.round(r.ms), calls: r.calls, msPerCall: Math.round((r.ms / r.calls) * 1000) / 1000, statement: r.query.replace(/\s+/g, ' ').slice(0, 90) }));
}

/** A new, migrated database with tenants t1…tN billed as cus_1…cus_N. */
export async function freshDatabase(services: Services, tenants: number): Promise<{ url: string; pool: pg.Pool }> {
  const name = `bench_${randomUUID().replace(/-/g, '').slice(0, 10)}`;
  await services.pg.createDatabase(name);
  // As the superuser: the benchmarks read pg_stat_statements, which only it may reset.
  const admin = new URL(services.pg.adminUrl);
  admin.pathname = `/${name}`;
  const url = admin.toString();
  await migrate(url);
  // The benchmarks' own statements name our tables unqualified: their pool (only) reads our schema first.
  const withPath = new URL(url);
  withPath.searchParams.set('options', `-c search_path=${schemaFor().name}`);
  const pool = createPool(withPath.toString(), 20);
  await pool.query('CREATE EXTENSION IF NOT EXISTS pg_stat_statements');
  await pool.query(`INSERT INTO billing_customers SELECT 't' || g, 'cus_' || g FROM generate_series(1, $1::int) g`, [tenants]);
  return { url, pool };
}

let bundle: { code: string } | undefined;
export async function usageBundle(): Promise<{ code: string }> {
  bundle ??= { code: (await bundleWorkflowCode({ workflowsPath: WORKFLOWS_PATH, logger: quietLogger })).code };
  return bundle;
}

export function benchConfig(services: Services, stripe: { url: string }, env: Record<string, string> = {}): Config {
  return loadConfig({
    TEMPORAL_ADDRESS: services.temporal.address,
    TEMPORAL_TASK_QUEUE: `bench-${randomUUID()}`,
    STRIPE_API_BASE: stripe.url,
    STRIPE_API_KEY: 'sk_test_bench',
    STRIPE_RATE_LIMIT_PER_SECOND: '5000',
    RELAY_COUNT: '2',
    LOG_LEVEL: 'silent',
    ...env,
  });
}

/**
 * The local Stripe-compatible server in a process of its own (`src/bin/stripe-local.ts`), so that
 * what it costs shows as its own CPU and not as billing-outbox's. Driven through its control API.
 */
export interface StripeProcess {
  url: string;
  pid: number;
  requestCount(): Promise<number>;
  stop(): Promise<void>;
}

export async function startStripeProcess(opts: { customers: number; latencyMs: number; meters?: string[] }): Promise<StripeProcess> {
  const { spawn } = await import('node:child_process');
  const args = ['--import', 'tsx', path.join(import.meta.dirname, '..', 'src', 'bin', 'stripe-local.ts'), '--port', '0'];
  for (const m of opts.meters ?? ['api_requests']) args.push('--meter', m);
  for (let i = 1; i <= opts.customers; i++) args.push('--customer', `cus_${i}`);
  const child = spawn(process.execPath, args, { stdio: ['ignore', 'pipe', 'inherit'] });
  const url = await new Promise<string>((resolve, reject) => {
    let out = '';
    child.stdout!.on('data', (b: Buffer) => {
      out += b.toString();
      const line = out.split('\n').find((l) => l.includes('localStripe'));
      if (line) resolve((JSON.parse(line) as { localStripe: string }).localStripe);
    });
    child.once('exit', (code) => reject(new Error(`local Stripe exited with ${code}`)));
  });
  const control = (route: string, body?: unknown) =>
    fetch(`${url}${route}`, body === undefined ? {} : { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body) }).then(
      (r) => r.json() as Promise<unknown>,
    );
  await control('/_local/faults', { latencyMs: opts.latencyMs });
  return {
    url,
    pid: child.pid!,
    /** Requests that reached Stripe: v1 meter-event calls and v2 stream requests. */
    async requestCount() {
      return ((await control('/_local/requests')) as unknown[]).length + ((await control('/_local/stream-requests')) as unknown[]).length;
    },
    async stop() {
      if (child.exitCode !== null) return;
      const exited = new Promise((r) => child.once('exit', r));
      child.kill('SIGTERM');
      await exited;
    },
  };
}

/** A billing-outbox worker in this process, as `npm run worker` runs one. */
export async function startPipelineWorker(
  services: Services,
  db: { url: string; pool: pg.Pool },
  config: Config,
  workerOptions: Partial<WorkerOptions> = {},
): Promise<{ worker: RunningWorker; client: Client; stop(): Promise<void> }> {
  const connection = await NativeConnection.connect({ address: services.temporal.address });
  const client = new Client({ connection, namespace: config.temporal.namespace });
  const worker = await startWorker({
    config,
    databaseUrl: db.url,
    pool: db.pool,
    stripe: createStripeClient(config.stripe),
    connection,
    client,
    workflowBundle: await usageBundle(),
    workerOptions,
  });
  return {
    worker,
    client,
    async stop() {
      await worker.shutdown();
      await connection.close();
    },
  };
}

/**
 * `n` worker processes (`src/bin/worker.ts`, as deployed) on one task queue, configured by `env`
 * on top of the bench's defaults. `stop()` sends each SIGTERM and waits for it to exit.
 */
export async function spawnWorkerProcesses(
  services: Services,
  n: number,
  env: { DATABASE_URL: string; STRIPE_API_BASE: string } & Record<string, string>,
): Promise<{ taskQueue: string; stop(): Promise<void> }> {
  const { spawn } = await import('node:child_process');
  const taskQueue = `bench-${randomUUID()}`;
  const children = Array.from({ length: n }, () =>
    spawn(process.execPath, ['--import', 'tsx', path.join(import.meta.dirname, '..', 'src', 'bin', 'worker.ts')], {
      env: {
        ...process.env,
        TEMPORAL_ADDRESS: services.temporal.address,
        TEMPORAL_TASK_QUEUE: taskQueue,
        STRIPE_API_KEY: 'sk_test_bench',
        STRIPE_RATE_LIMIT_PER_SECOND: '5000',
        LOG_LEVEL: 'error',
        ...env,
      },
      // Output ignored: an unread pipe fills up and blocks the process on its next log line.
      stdio: ['ignore', 'ignore', 'inherit'],
    }),
  );
  return {
    taskQueue,
    async stop() {
      await Promise.all(
        children.map(
          (c) =>
            new Promise<void>((resolve) => {
              if (c.exitCode !== null || c.signalCode !== null) return resolve();
              c.once('exit', () => resolve());
              c.kill('SIGTERM');
            }),
        ),
      );
    },
  };
}

/** Commits `n` usages over `tenants` tenants in one statement (as a backlog after an outage). */
export async function commitBacklog(pool: pg.Pool, n: number, tenants: number, prefix = randomUUID().slice(0, 8)): Promise<void> {
  await pool.query(
    `WITH u AS (
       INSERT INTO usage_logs (id, tenant_id, event_name, quantity, occurred_at)
       SELECT $3 || '-' || g, 't' || (1 + g % $2::int), 'api_requests', 1, now() FROM generate_series(1, $1::int) g
       RETURNING id, tenant_id, event_name, quantity, occurred_at)
     INSERT INTO outbox (tenant_id, usage_id, event_name, quantity, occurred_at, idempotency_key)
     SELECT tenant_id, id, event_name, quantity, occurred_at, 'u:' || tenant_id || ':' || id FROM u`,
    [n, tenants, prefix],
  );
}

export async function countSent(pool: pg.Pool): Promise<number> {
  const { rows } = await pool.query<{ n: number }>(`SELECT count(*)::int AS n FROM outbox WHERE status IN ('sent', 'accepted')`);
  return rows[0]!.n;
}

export async function waitUntil(what: string, fn: () => Promise<boolean>, timeoutMs: number, everyMs = 50): Promise<void> {
  const until = Date.now() + timeoutMs;
  while (Date.now() < until) {
    if (await fn()) return;
    await new Promise((r) => setTimeout(r, everyMs));
  }
  throw new Error(`timed out after ${timeoutMs} ms: ${what}`);
}

/**
 * CPU seconds used so far by the processes whose command line matches, among this process's
 * descendants only: the Temporal dev server and PostgreSQL run beside this one, and each event
 * costs CPU in all three (read from /proc, Linux). Only descendants, because other benchmarks or
 * test runs on the same machine start servers with the same command lines, and their CPU is not
 * this run's. A process's reaped children count too (PostgreSQL's backends that ended).
 */
export async function processCpuSeconds(match: RegExp): Promise<number> {
  const { readdir, readFile } = await import('node:fs/promises');
  const stats = new Map<number, { ppid: number; ticks: number; cmd: string }>();
  for (const pid of await readdir('/proc')) {
    if (!/^\d+$/.test(pid)) continue;
    try {
      const cmd = (await readFile(`/proc/${pid}/cmdline`, 'utf8')).replace(/\0/g, ' ');
      // Fields after the command name: state is [0], ppid [1], utime [11], stime [12], cutime [13], cstime [14].
      const stat = (await readFile(`/proc/${pid}/stat`, 'utf8')).split(') ')[1]!.split(' ');
      stats.set(Number(pid), { ppid: Number(stat[1]), ticks: Number(stat[11]) + Number(stat[12]) + Number(stat[13]) + Number(stat[14]), cmd });
    } catch {
      // The process ended meanwhile.
    }
  }
  const ours = (pid: number): boolean => {
    for (let p = stats.get(pid)?.ppid; p !== undefined && p > 1; p = stats.get(p)?.ppid) if (p === process.pid) return true;
    return false;
  };
  let ticks = 0;
  for (const [pid, { ticks: t, cmd }] of stats) {
    if (match.test(cmd) && ours(pid)) ticks += t;
  }
  return ticks / 100;
}

/**
 * CPU used per event by the Temporal server, PostgreSQL, this process (the worker, or the bare
 * shapes' worker and starters) and the local Stripe process (when there is one), since it was
 * created.
 */
export async function cpuMeter(
  stripePid?: number,
  others: Record<string, RegExp> = {},
): Promise<(events: number) => Promise<Record<string, number>>> {
  const temporal = /server start-dev/;
  const postgres = /(^|\/)postgres( |:)/;
  const stripe = stripePid === undefined ? undefined : new RegExp(`--port 0 --meter`);
  const read = async () => ({
    t: await processCpuSeconds(temporal),
    p: await processCpuSeconds(postgres),
    s: stripe ? await processCpuSeconds(stripe) : 0,
    o: Object.fromEntries(await Promise.all(Object.entries(others).map(async ([k, re]) => [k, await processCpuSeconds(re)] as const))),
  });
  const before = await read();
  const w0 = process.cpuUsage();
  return async (events) => {
    const w = process.cpuUsage(w0);
    const after = await read();
    const per = (seconds: number) => Math.round(((seconds * 1000) / events) * 100) / 100;
    return {
      temporalMs: per(after.t - before.t),
      postgresMs: per(after.p - before.p),
      workerMs: per((w.user + w.system) / 1e6),
      ...(stripe ? { stripeMs: per(after.s - before.s) } : {}),
      ...Object.fromEntries(Object.keys(others).map((k) => [k, per((after.o[k] ?? 0) - (before.o[k] ?? 0))])),
    };
  };
}

export const perSecond = (n: number, ms: number) => Math.round((n / ms) * 10_000) / 10;
export const pct = (sorted: number[], p: number) => sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))] ?? NaN;

/** History of `n` sampled workflows: per event, workflow tasks, history events and billable actions. */
export async function historyShape(
  client: Client,
  workflowIds: string[],
): Promise<{ workflowTasks: number; historyEvents: number; actions: number; actionMix: string }> {
  const { temporal } = (await import('@temporalio/proto')).default;
  const T = temporal.api.enums.v1.EventType;
  // Temporal Cloud actions, as its pricing page lists them: a workflow started, an activity started
  // (each attempt), a local activity (its marker), a timer started, a signal, a search-attribute
  // upsert. Workflow tasks themselves are not actions.
  const billable = new Set([
    T.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED,
    T.EVENT_TYPE_ACTIVITY_TASK_STARTED,
    T.EVENT_TYPE_MARKER_RECORDED,
    T.EVENT_TYPE_TIMER_STARTED,
    T.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED,
    T.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES,
  ]);
  // Which actions, per event: what Temporal Cloud bills a million events at, kind by kind.
  const kindOf = new Map([
    [T.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED, 'start'],
    [T.EVENT_TYPE_ACTIVITY_TASK_STARTED, 'activity'],
    [T.EVENT_TYPE_MARKER_RECORDED, 'local activity'],
    [T.EVENT_TYPE_TIMER_STARTED, 'timer'],
    [T.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED, 'signal'],
    [T.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES, 'upsert'],
  ]);
  const kinds = new Map<string, number>();
  let tasks = 0;
  let events = 0;
  let actions = 0;
  for (const id of workflowIds) {
    const history = await client.workflow.getHandle(id).fetchHistory();
    for (const e of history.events ?? []) {
      events++;
      if (e.eventType === T.EVENT_TYPE_WORKFLOW_TASK_COMPLETED) tasks++;
      if (e.eventType === T.EVENT_TYPE_MARKER_RECORDED && e.markerRecordedEventAttributes?.markerName !== 'core_local_activity') continue;
      if (e.eventType !== undefined && e.eventType !== null && billable.has(e.eventType)) {
        actions++;
        const kind = kindOf.get(e.eventType)!;
        kinds.set(kind, (kinds.get(kind) ?? 0) + 1);
      }
    }
  }
  const n = workflowIds.length;
  const actionMix = [...kinds].map(([k, v]) => `${k} ${Math.round((v / n) * 100) / 100}`).join(', ');
  return { workflowTasks: tasks / n, historyEvents: events / n, actions: actions / n, actionMix };
}

export interface Report {
  bench: string;
  command: string;
  machine: { cpus: number; model: string; node: string; platform: string };
  at: string;
  rows: Record<string, unknown>[];
  notes: string[];
}

export function newReport(bench: string): Report {
  return {
    bench,
    command: `npm run bench -- ${process.argv.slice(2).join(' ')}`,
    machine: { cpus: os.cpus().length, model: os.cpus()[0]?.model ?? 'unknown', node: process.version, platform: `${os.platform()} ${os.release()}` },
    at: new Date().toISOString(),
    rows: [],
    notes: [],
  };
}

/** Prints the rows as a table and writes the whole report to bench/results/<bench>-<time>.json. */
export async function publish(report: Report): Promise<string> {
  const columns = [...new Set(report.rows.flatMap((r) => Object.keys(r)))];
  const cells = report.rows.map((r) => columns.map((c) => (r[c] === undefined ? '' : String(r[c]))));
  const widths = columns.map((c, i) => Math.max(c.length, ...cells.map((row) => row[i]!.length)));
  const line = (values: string[]) => values.map((v, i) => v.padEnd(widths[i]!)).join('  ').trimEnd();
  console.log(`\n${report.bench} (${report.at}, ${report.machine.cpus} cpus, node ${report.machine.node})`);
  console.log(line(columns));
  for (const row of cells) console.log(line(row));
  for (const note of report.notes) console.log(`  - ${note}`);
  const dir = path.join(import.meta.dirname, 'results');
  await mkdir(dir, { recursive: true });
  const file = path.join(dir, `${report.bench}-${report.at.replace(/[:.]/g, '-')}.json`);
  await writeFile(file, `${JSON.stringify(report, null, 2)}\n`);
  console.log(`  → ${path.relative(process.cwd(), file)}`);
  return file;
}

export { LocalStripe };

/**
 * Arrivals on schedule: `arrive(i)` for i = 0 … total − 1, each at `started` + i / rate, with up to
 * eight in flight so that one slow commit or request does not delay the next.
 */
export async function onSchedule(total: number, rate: number, arrive: (i: number) => Promise<void>, started = performance.now()): Promise<void> {
  let next = 0;
  await Promise.all(
    Array.from({ length: 8 }, async () => {
      for (;;) {
        const i = next++;
        if (i >= total) return;
        const wait = started + (i * 1000) / rate - performance.now();
        if (wait > 0) await new Promise((r) => setTimeout(r, wait));
        await arrive(i);
      }
    }),
  );
}
