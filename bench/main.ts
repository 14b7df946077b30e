/**
 * `npm run bench -- <name> [options]`: reproducible figures on real PostgreSQL and a real Temporal
 * dev server (both started here, embedded) with the local Stripe-compatible server. Each prints a
 * table and writes its figures to bench/results/. Compare figures from one run on one machine.
 *
 *   request-path   a bare usage-insert transaction vs the same with recordUsage (≥ 10,000 each)
 *   ceiling        bare workflow shapes vs billing-outbox draining the same number of events
 *   drain          billing-outbox alone draining a backlog (--customers, --latency, --events, --api)
 *   backlog        20,000 events with 1, 5 and 100 customers, v1 and v2
 *   steady         a steady arrival rate swept upwards to the knee (--seconds per rate, --api)
 *   workers        the same backlog drained by 1, 2 and 4 worker processes
 *   claim          the claim with 1,000,000 sent rows and a live backlog: plan and latency
 *   fairness       one tenant's backlog (--backlog, 20,000) vs 99 tenants at a steady rate (--rate,
 *                  --seconds): their commit → acknowledged alone, with the flood and alone again,
 *                  v1 and v2 (--api, --lane-max, --relays, --workers)
 *   peers          graphile-worker and a plain SKIP LOCKED loop on the same events, same Stripe
 *   soak           the API and a worker as processes, 30 usages/s over HTTP for 10 minutes: RSS over time
 *   batcher        the v2 batcher alone at 1,000 and 5,000 events/s, Stripe answering in 30 and 100 ms,
 *                  then 50 and 200 events/s (--seconds per run, default 10): requests per event,
 *                  requests in flight, added latency
 *
 * `--cpu-prof DIR` runs it again under node's --cpu-prof (bench/profile.ts reads the result);
 * `--worker-options JSON` (ceiling, drain) sets Temporal worker options over ours.
 */
import path from 'node:path';
import { parseArgs } from 'node:util';
import type { WorkerOptions } from '@temporalio/worker';
import { ceiling, drainOnce } from './ceiling.js';
import { newReport, publish, startServices } from './harness.js';
import { backlog } from './backlog.js';
import { batcher } from './batcher.js';
import { claim } from './claim.js';
import { fairness } from './fairness.js';
import { peers } from './peers.js';
import { requestPath } from './request-path.js';
import { soak } from './soak.js';
import { steady } from './steady.js';
import { workers } from './workers.js';

const [name, ...rest] = process.argv.slice(2);
const { values } = parseArgs({
  args: rest,
  options: {
    events: { type: 'string', default: '2000' },
    starters: { type: 'string', default: '100' },
    customers: { type: 'string', default: '100' },
    latency: { type: 'string', default: '30' },
    // Unset: v1, or both APIs for `fairness` and `backlog`.
    api: { type: 'string' },
    seconds: { type: 'string', default: '20' },
    backlog: { type: 'string', default: '20000' },
    rate: { type: 'string', default: '20' },
    // `off`: the dev server without task queue fairness, to measure what it adds.
    'temporal-fairness': { type: 'string', default: 'on' },
    // A directory: the run again under node's --cpu-prof (every thread, the workflow threads
    // included, writes a .cpuprofile there); `npx tsx bench/profile.ts DIR` summarises them.
    'cpu-prof': { type: 'string' },
    // Temporal worker options over ours, as JSON (ceiling, drain): `--worker-options '{"workflowThreadPoolSize":2}'`.
    'worker-options': { type: 'string' },
    // LANE_MAX_IN_FLIGHT for `fairness` (unset: each API's default).
    'lane-max': { type: 'string' },
    // RELAY_COUNT for `fairness` (unset: the bench's 2).
    relays: { type: 'string' },
    // Worker processes for `fairness` (unset: one worker in the bench process).
    workers: { type: 'string' },
  },
});
const workerOptions = values['worker-options'] ? (JSON.parse(values['worker-options']) as Partial<WorkerOptions>) : undefined;
if (values['cpu-prof'] && !process.env.BENCH_CPU_PROF) {
  // The worker runs in this process, so this process is the one to profile: started again with
  // the flags (tsx's loader flags kept), told through the environment where the drain's window goes.
  const { spawnSync } = await import('node:child_process');
  const { mkdirSync } = await import('node:fs');
  const dir = path.resolve(values['cpu-prof']);
  mkdirSync(dir, { recursive: true });
  const args = process.argv.slice(2).filter((a, i, all) => a !== '--cpu-prof' && all[i - 1] !== '--cpu-prof' && !a.startsWith('--cpu-prof='));
  const run = spawnSync(process.execPath, [...process.execArgv, '--cpu-prof', '--cpu-prof-dir', dir, process.argv[1]!, ...args], {
    stdio: 'inherit',
    env: { ...process.env, BENCH_CPU_PROF: dir },
  });
  process.exit(run.status ?? 1);
}
const num = (v: string | undefined) => Number(v);

const benches: Record<string, (services: Awaited<ReturnType<typeof startServices>>) => Promise<void>> = {
  async ceiling(services) {
    const report = newReport('ceiling');
    await ceiling(services, report, {
      events: num(values.events),
      starters: num(values.starters),
      customers: num(values.customers),
      latencyMs: num(values.latency),
      workerOptions,
    });
    if (workerOptions) report.notes.push(`worker options over ours: ${JSON.stringify(workerOptions)}`);
    await publish(report);
  },
  async 'request-path'(services) {
    const report = newReport('request-path');
    await requestPath(services, report, { events: Math.max(num(values.events), 10_000) });
    await publish(report);
  },
  async backlog(services) {
    const report = newReport('backlog');
    await backlog(services, report, {
      events: values.events === '2000' ? 20_000 : num(values.events),
      latencyMs: num(values.latency),
      customers: [1, 5, 100],
      apis: values.api === 'v1' || values.api === 'v2' ? [values.api] : ['v1', 'v2'],
    });
    await publish(report);
  },
  async steady(services) {
    const report = newReport('steady');
    await steady(services, report, {
      rates: [10, 20, 30, 40, 50, 60, 70, 80, 90, 100],
      seconds: num(values.seconds),
      customers: num(values.customers),
      latencyMs: num(values.latency),
      api: values.api === 'v2' ? 'v2' : 'v1',
    });
    await publish(report);
  },
  async workers(services) {
    const report = newReport('workers');
    await workers(services, report, { counts: [1, 2, 4], events: num(values.events), customers: num(values.customers), latencyMs: num(values.latency) });
    await publish(report);
  },
  async claim(services) {
    const report = newReport('claim');
    await claim(services, report, { sentRows: 1_000_000, pending: 20_000, lanes: 100, claims: 200 });
    await publish(report);
  },
  async fairness(services) {
    const report = newReport('fairness');
    report.notes.push(`Temporal task queue fairness ${values['temporal-fairness'] === 'off' ? 'off' : 'on'} (matching.enableFairness)`);
    await fairness(services, report, {
      backlog: num(values.backlog),
      tenants: num(values.customers),
      rate: num(values.rate),
      seconds: num(values.seconds),
      latencyMs: num(values.latency),
      apis: values.api === 'v1' || values.api === 'v2' ? [values.api] : ['v1', 'v2'],
      laneMax: values['lane-max'],
      relays: values.relays,
      ...(values.workers ? { workers: num(values.workers) } : {}),
    });
    await publish(report);
  },
  async peers(services) {
    const report = newReport('peers');
    await peers(services, report, { events: num(values.events), customers: num(values.customers), latencyMs: num(values.latency) });
    await publish(report);
  },
  async soak(services) {
    const report = newReport('soak');
    await soak(services, report, { seconds: values.seconds === '20' ? 600 : num(values.seconds), rate: 30, customers: num(values.customers), latencyMs: num(values.latency) });
    await publish(report);
  },
  async drain(services) {
    const report = newReport('drain');
    await drainOnce(services, report, { events: num(values.events), customers: num(values.customers), latencyMs: num(values.latency), env: { STRIPE_METER_API: values.api === 'v2' ? 'v2' : 'v1' }, workerOptions });
    if (workerOptions) report.notes.push(`worker options over ours: ${JSON.stringify(workerOptions)}`);
    await publish(report);
  },
};

/** Benchmarks of one part alone: no PostgreSQL, no Temporal to start. */
const alone: Record<string, () => Promise<void>> = {
  async batcher() {
    const report = newReport('batcher');
    const seconds = values.seconds === '20' ? 10 : num(values.seconds);
    await batcher(report, {
      seconds,
      runs: [
        { rate: 1_000, latencyMs: 30 },
        { rate: 1_000, latencyMs: 100 },
        { rate: 5_000, latencyMs: 30 },
        { rate: 5_000, latencyMs: 100 },
        // Stripe's test mode: the default pace with a test key.
        { rate: 1_000, latencyMs: 30, pacePerSecond: 20 },
        // A worker's share of a chaos run or of retries after an outage: where the linger, not the
        // 100-event limit, sets the batch.
        { rate: 50, latencyMs: 30 },
        { rate: 200, latencyMs: 30 },
      ],
    });
    await publish(report);
  },
};

if (name && alone[name]) {
  await alone[name]();
  process.exit(0);
}
if (!name || !benches[name]) {
  console.error(`usage: npm run bench -- <${[...Object.keys(benches), ...Object.keys(alone)].join('|')}> [--events N] [--customers N] [--latency MS]`);
  process.exit(2);
}
const services = await startServices({ taskQueueFairness: values['temporal-fairness'] !== 'off' });
try {
  await benches[name](services);
} finally {
  await services.stop();
}
