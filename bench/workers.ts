/**
 * `npm run bench -- workers`: the same backlog drained by 1, 2 and 4 worker processes
 * (`src/bin/worker.ts`, as deployed), on one Temporal server and one PostgreSQL. On this 2-core
 * machine more processes share the same two cores with the server: the figure shows what the
 * pieces cost together, not how a cluster scales (see docs/performance.md for that reasoning).
 */
import { randomUUID } from 'node:crypto';
import { commitBacklog, countSent, cpuMeter, freshDatabase, perSecond, spawnWorkerProcesses, startStripeProcess, waitUntil, type Report, type Services } from './harness.js';

export async function workers(services: Services, report: Report, opts: { counts: number[]; events: number; customers: number; latencyMs: number }): Promise<void> {
  for (const n of opts.counts) {
    const db = await freshDatabase(services, opts.customers);
    const stripe = await startStripeProcess({ customers: opts.customers, latencyMs: opts.latencyMs });
    const processes = await spawnWorkerProcesses(services, n, { DATABASE_URL: db.url, STRIPE_API_BASE: stripe.url });
    try {
      // Keys unique to this run: workflow ids are the keys, and the Temporal server is shared by every run of the benchmark.
      await commitBacklog(db.pool, 20, opts.customers, `warmup-${randomUUID().slice(0, 8)}`);
      await waitUntil('the workers to start', async () => (await countSent(db.pool)) >= 20, 120_000, 200);
      const cpu = await cpuMeter(stripe.pid, { workerProcessesMs: /src\/bin\/worker\.ts/ });
      const started = performance.now();
      await commitBacklog(db.pool, opts.events, opts.customers);
      await waitUntil('the backlog to drain', async () => (await countSent(db.pool)) >= 20 + opts.events, 30 * 60_000, 200);
      const ms = performance.now() - started;
      report.rows.push({ workers: n, events: opts.events, customers: opts.customers, seconds: Math.round(ms / 100) / 10, perSecond: perSecond(opts.events, ms), ...(await cpu(opts.events)) });
    } finally {
      await processes.stop();
      await stripe.stop();
      await db.pool.end();
    }
  }
  report.notes.push('workerMs is the driver process; workerProcessesMs the worker processes together');
}
