/**
 * `npm run bench -- ceiling`: how close billing-outbox runs to what this Temporal server can do at
 * all. In one run, on one server: the bare shapes (an empty workflow, one activity, one local
 * activity; started eagerly from 100 concurrent starters, each awaiting its result), then a
 * billing-outbox backlog of the same size drained through the local Stripe. Per event: workflow
 * tasks, history events, Temporal Cloud billable actions, and the CPU of this process (the worker,
 * the local Stripe and the driver; the Temporal server's own CPU is not in it).
 */
import { randomUUID } from 'node:crypto';
import { Client } from '@temporalio/client';
import { bundleWorkflowCode, NativeConnection, Worker, type WorkerOptions } from '@temporalio/worker';
import path from 'node:path';
import { shapeActivities } from './shapes/activities.js';
import {
  benchConfig,
  commitBacklog,
  countSent,
  cpuMeter,
  freshDatabase,
  historyShape,
  perSecond,
  quietLogger,
  startPipelineWorker,
  startStripeProcess,
  topStatements,
  waitUntil,
  type Report,
  type Services,
} from './harness.js';

export interface CeilingOptions {
  events: number;
  starters: number;
  customers: number;
  latencyMs: number;
  /** Temporal worker options over ours for billing-outbox's worker (`--worker-options JSON`), to measure one before changing it. */
  workerOptions?: Partial<WorkerOptions>;
}

export async function bareShapes(services: Services, report: Report, opts: CeilingOptions): Promise<number> {
  const connection = await NativeConnection.connect({ address: services.temporal.address });
  const client = new Client({ connection });
  const code = (await bundleWorkflowCode({ workflowsPath: path.join(import.meta.dirname, 'shapes', 'workflows.ts'), logger: quietLogger })).code;
  let best = 0;
  try {
    for (const shape of ['emptyShape', 'oneActivityShape', 'oneLocalActivityShape']) {
      const taskQueue = `shape-${randomUUID()}`;
      const worker = await Worker.create({ connection, taskQueue, workflowBundle: { code }, activities: shapeActivities });
      const ids: string[] = [];
      const cpu = await cpuMeter();
      const started = performance.now();
      await worker.runUntil(async () => {
        let next = 0;
        await Promise.all(
          Array.from({ length: opts.starters }, async () => {
            while (next < opts.events) {
              const workflowId = `${shape}-${next++}`;
              ids.push(workflowId);
              const handle = await client.workflow.start(shape, { taskQueue, workflowId, requestEagerStart: true });
              await handle.result();
            }
          }),
        );
      });
      const ms = performance.now() - started;
      const rate = perSecond(opts.events, ms);
      best = Math.max(best, rate);
      report.rows.push({
        shape,
        events: opts.events,
        seconds: Math.round(ms / 100) / 10,
        perSecond: rate,
        ...(await historyShape(client, ids.slice(0, 20))),
        ...(await cpu(opts.events)),
      });
    }
  } finally {
    await connection.close();
  }
  return best;
}

/** A billing-outbox backlog drained end to end; returns events per second. */
export async function drainOnce(
  services: Services,
  report: Report,
  opts: { events: number; customers: number; latencyMs: number; label?: string; env?: Record<string, string>; workerOptions?: Partial<WorkerOptions> },
): Promise<number> {
  const db = await freshDatabase(services, opts.customers);
  const stripe = await startStripeProcess({ customers: opts.customers, latencyMs: opts.latencyMs });
  const config = benchConfig(services, stripe, opts.env);
  const pipeline = await startPipelineWorker(services, db, config, opts.workerOptions);
  try {
    // Warm up (bundle loaded, connections open), then the backlog as after an outage.
    // Keys unique to this run: workflow ids are the keys, and the Temporal server is shared by every run of the benchmark.
    await commitBacklog(db.pool, 20, opts.customers, `warmup-${randomUUID().slice(0, 8)}`);
    await waitUntil('warm-up', async () => (await countSent(db.pool)) >= 20, 60_000);
    const base = 20;
    const requestsBefore = await stripe.requestCount();
    await db.pool.query('SELECT pg_stat_statements_reset()');
    const cpu = await cpuMeter(stripe.pid);
    const started = performance.now();
    const profiledFrom = process.hrtime.bigint();
    await commitBacklog(db.pool, opts.events, opts.customers);
    let peakOpen = 0;
    await waitUntil(
      'the backlog to drain',
      async () => {
        const { rows } = await db.pool.query<{ n: number }>(`SELECT count(*)::int AS n FROM outbox WHERE status IN ('claimed', 'dispatched')`);
        peakOpen = Math.max(peakOpen, rows[0]!.n);
        return (await countSent(db.pool)) >= base + opts.events;
      },
      30 * 60_000,
      100,
    );
    const ms = performance.now() - started;
    const cpuPerEvent = await cpu(opts.events);
    await markProfiledWindow(profiledFrom, opts.label ?? 'billing-outbox');
    const { rows } = await db.pool.query<{ key: string }>(
      `SELECT idempotency_key AS key FROM outbox WHERE idempotency_key NOT LIKE '%warmup%' ORDER BY random() LIMIT 20`,
    );
    const rate = perSecond(opts.events, ms);
    report.rows.push({
      shape: opts.label ?? 'billing-outbox',
      events: opts.events,
      customers: opts.customers,
      seconds: Math.round(ms / 100) / 10,
      perSecond: rate,
      ...(await historyShape(pipeline.client, rows.map((r) => r.key))),
      ...cpuPerEvent,
      stripeRequestsPerEvent: Math.round((((await stripe.requestCount()) - requestsBefore) / opts.events) * 1000) / 1000,
      peakInFlight: peakOpen,
    });
    if (process.env.BENCH_STATEMENTS) console.table(await topStatements(db.pool));
    return rate;
  } finally {
    await pipeline.stop();
    await stripe.stop();
    await db.pool.end();
  }
}

/**
 * Under `--cpu-prof DIR`: the drain's start and end on the monotonic clock V8's profiler stamps its
 * samples with (microseconds), so that bench/profile.ts leaves out start-up, bundling, warm-up and
 * the bare shapes.
 */
async function markProfiledWindow(from: bigint, label: string): Promise<void> {
  const dir = process.env.BENCH_CPU_PROF;
  if (!dir) return;
  const { appendFile } = await import('node:fs/promises');
  const window = { label, fromUs: Number(from / 1000n), toUs: Number(process.hrtime.bigint() / 1000n) };
  await appendFile(path.join(dir, 'windows.jsonl'), `${JSON.stringify(window)}\n`);
}

export async function ceiling(services: Services, report: Report, opts: CeilingOptions): Promise<void> {
  const best = await bareShapes(services, report, opts);
  const ours = await drainOnce(services, report, opts);
  report.notes.push(`billing-outbox drains at ${Math.round((ours / best) * 100)} % of the fastest bare shape measured in this run (${best}/s)`);
  report.notes.push(`${opts.customers} customers, Stripe latency ${opts.latencyMs} ms, ${opts.starters} concurrent starters for the bare shapes`);
}
