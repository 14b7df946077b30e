/**
 * `npm run bench -- ceiling`: how close billing-outbox runs to what this Temporal server can do at
 * all. In one run, on one server: the bare shapes (an empty workflow, one activity, one local
 * activity; started eagerly from 100 concurrent starters, each awaiting its result), one local
 * activity started as billing-outbox starts its workflow (what the start and payloads add),
 * billing-outbox's own workflow started so with its delivery answered at once (what its workflow
 * code adds), then a billing-outbox backlog of the same size drained through the local Stripe, then
 * one local activity again (the server's speed drifts within a run). Per event: workflow tasks, history events, Temporal Cloud billable actions, and the CPU of each
 * process (this one: the worker and the driver; the Temporal server; PostgreSQL; the local Stripe).
 */
import { randomUUID } from 'node:crypto';
import { Client, type WorkflowHandle } from '@temporalio/client';
import { bundleWorkflowCode, NativeConnection, Worker, type WorkerOptions } from '@temporalio/worker';
import path from 'node:path';
import type { Config } from '../src/config.js';
import { usageWorkflowStartOptions } from '../src/temporal/start-usage.js';
import { shapeActivities, stubbedDeliveryActivities } from './shapes/activities.js';
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
  usageBundle,
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

/** A measured shape: its name, bundle, activities and how each run is started. */
interface Shape {
  name: string;
  /** Nothing of billing-outbox in it: a candidate for the fastest bare shape. */
  bare: boolean;
  code: string;
  activities: object;
  /** Starts run `i` of the shape. */
  start(client: Client, taskQueue: string, workflowId: string, i: number): Promise<WorkflowHandle>;
}

/** Runs each shape; returns the fastest bare shape's rate and billing-outbox's own shape's (one local activity). */
async function bareShapes(services: Services, report: Report, opts: CeilingOptions): Promise<{ best: number; own: number }> {
  const code = await shapesBundle();
  const bare = (name: string): Shape => ({
    name,
    bare: true,
    code,
    activities: shapeActivities,
    start: (client, taskQueue, workflowId) => client.workflow.start(name, { taskQueue, workflowId, requestEagerStart: true }),
  });
  // Started as the relay starts billing-outbox's workflow (search attributes, summary, fairness key,
  // input), its delivery answered at once: from the bare local activity to `usageStartShape` (one
  // local activity) is the start's and the payloads' share, from there to `usageWorkflowStubbed`
  // the workflow code's, and the rest of the way to billing-outbox the relay's and the I/O's.
  const { retry } = benchConfig(services, { url: 'http://127.0.0.1:9' });
  const startedAsUsage = (name: string, workflowType: string, code: string): Shape => ({
    name,
    bare: false,
    code,
    activities: stubbedDeliveryActivities,
    start: (client, taskQueue, workflowId, i) => {
      const row = { idempotency_key: workflowId, tenant_id: `tenant-${i % opts.customers}`, event_name: 'api_requests', quantity: 1, occurred_at: new Date() };
      const options = usageWorkflowStartOptions(row, { retry, temporal: { taskQueue } as Config['temporal'] }, { reusePolicy: 'REJECT_DUPLICATE' });
      return client.workflow.start(workflowType, { ...options, requestEagerStart: true });
    },
  });
  const usageStart = startedAsUsage('usageStartShape', 'usageStartShape', code);
  const stubbed = startedAsUsage('usageWorkflowStubbed', 'usageWorkflow', (await usageBundle()).code);
  let best = 0;
  let own = 0;
  for (const shape of [bare('emptyShape'), bare('oneActivityShape'), bare(OWN_SHAPE), usageStart, stubbed]) {
    const rate = await runShape(services, report, opts, shape);
    if (shape.bare) best = Math.max(best, rate);
    if (shape.name === OWN_SHAPE) own = rate;
  }
  return { best, own };
}

/** The bare shape billing-outbox is: one local activity. */
const OWN_SHAPE = 'oneLocalActivityShape';

async function shapesBundle(): Promise<string> {
  return (await bundleWorkflowCode({ workflowsPath: path.join(import.meta.dirname, 'shapes', 'workflows.ts'), logger: quietLogger })).code;
}

/** Billing-outbox's own shape run again after the drain, so the drain is judged against the shape on both sides of it. */
async function ownShapeAgain(services: Services, report: Report, opts: CeilingOptions): Promise<number> {
  const code = await shapesBundle();
  return runShape(services, report, opts, {
    name: `${OWN_SHAPE} (after)`,
    bare: true,
    code,
    activities: shapeActivities,
    start: (client, taskQueue, workflowId) => client.workflow.start(OWN_SHAPE, { taskQueue, workflowId, requestEagerStart: true }),
  });
}

/** One shape's runs, started from `opts.starters` concurrent starters each awaiting its result; returns runs per second. */
async function runShape(services: Services, report: Report, opts: CeilingOptions, shape: Shape): Promise<number> {
  const connection = await NativeConnection.connect({ address: services.temporal.address });
  try {
    const client = new Client({ connection });
    const taskQueue = `shape-${randomUUID()}`;
    const worker = await Worker.create({ connection, taskQueue, workflowBundle: { code: shape.code }, activities: shape.activities });
    const ids: string[] = [];
    const cpu = await cpuMeter();
    const started = performance.now();
    const profiledFrom = process.hrtime.bigint();
    await worker.runUntil(async () => {
      let next = 0;
      await Promise.all(
        Array.from({ length: opts.starters }, async () => {
          while (next < opts.events) {
            const i = next++;
            const workflowId = `${shape.name.replace(/\W+/g, '-')}-${i}-${randomUUID().slice(0, 8)}`;
            ids.push(workflowId);
            await (await shape.start(client, taskQueue, workflowId, i)).result();
          }
        }),
      );
    });
    const ms = performance.now() - started;
    await markProfiledWindow(profiledFrom, shape.name, opts.events);
    const rate = perSecond(opts.events, ms);
    report.rows.push({
      shape: shape.name,
      events: opts.events,
      seconds: Math.round(ms / 100) / 10,
      perSecond: rate,
      ...(await historyShape(client, ids.slice(0, 20))),
      ...(await cpu(opts.events)),
    });
    return rate;
  } finally {
    await connection.close();
  }
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
    await markProfiledWindow(profiledFrom, opts.label ?? 'billing-outbox', opts.events);
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
 * Under `--cpu-prof DIR`: a measured stretch (a bare shape's run, a drain) by its start and end on
 * the monotonic clock V8's profiler stamps its samples with (microseconds), and the events in it, so
 * that bench/profile.ts leaves out start-up, bundling and warm-up and can set the shapes side by side.
 */
async function markProfiledWindow(from: bigint, label: string, events: number): Promise<void> {
  const dir = process.env.BENCH_CPU_PROF;
  if (!dir) return;
  const { appendFile } = await import('node:fs/promises');
  const window = { label, events, fromUs: Number(from / 1000n), toUs: Number(process.hrtime.bigint() / 1000n) };
  await appendFile(path.join(dir, 'windows.jsonl'), `${JSON.stringify(window)}\n`);
}

export async function ceiling(services: Services, report: Report, opts: CeilingOptions): Promise<void> {
  const { best, own } = await bareShapes(services, report, opts);
  const ours = await drainOnce(services, report, opts);
  // The server's speed drifts within a run (the same shape 70–101/s minutes apart here), so the
  // own shape is run on both sides of the drain and the drain judged against each and their mean.
  const after = await ownShapeAgain(services, report, opts);
  const pct = (rate: number) => Math.round((ours / rate) * 1000) / 10;
  report.notes.push(
    `billing-outbox drains at ${pct((own + after) / 2)} % of its own shape, one local activity, run before and after it (${own}/s, ${after}/s: ${pct(own)} % and ${pct(after)} %)`,
  );
  report.notes.push(`billing-outbox drains at ${Math.round((ours / best) * 100)} % of the fastest bare shape measured in this run (${best}/s)`);
  report.notes.push(`${opts.customers} customers, Stripe latency ${opts.latencyMs} ms, ${opts.starters} concurrent starters for the bare shapes`);
}
