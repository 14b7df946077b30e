/**
 * `npm run bench -- steady`: usage arriving at a steady rate (recordUsage in the application's
 * transactions, as the API does), swept upwards until the pipeline no longer keeps up. Per rate:
 * what was delivered per second, and commit → acknowledged by Stripe (the row's sent_at − created_at)
 * at p50/p95/p99. A rate is kept up with when its events were all delivered within the window
 * plus a few seconds and commit → acknowledged stayed under a second at p99 (no queue building);
 * the knee is the last such rate.
 */
import { randomUUID } from 'node:crypto';
import { withTransaction } from '../src/db.js';
import { recordUsage } from '../src/outbox/enqueue.js';
import { benchConfig, freshDatabase, onSchedule, pct, startPipelineWorker, startStripeProcess, type Report, type Services } from './harness.js';

export async function steady(
  services: Services,
  report: Report,
  opts: { rates: number[]; seconds: number; customers: number; latencyMs: number; api: 'v1' | 'v2' },
): Promise<void> {
  const db = await freshDatabase(services, opts.customers);
  const stripe = await startStripeProcess({ customers: opts.customers, latencyMs: opts.latencyMs });
  const config = benchConfig(services, stripe, { STRIPE_METER_API: opts.api });
  const pipeline = await startPipelineWorker(services, db, config);
  let saturated = 0;
  try {
    for (const rate of opts.rates) {
      const run = randomUUID().slice(0, 8);
      const total = Math.round(rate * opts.seconds);
      const started = performance.now();
      await onSchedule(total, rate, (i) => withTransaction(db.pool, (c) => recordUsage(c, { usageId: `${run}-${i}`, tenantId: `t${(i % opts.customers) + 1}`, quantity: 1 })).then(() => undefined), started);
      const arrivalMs = performance.now() - started;
      // Whatever is not delivered a few seconds after the last arrival did not keep up.
      const graceMs = 5_000;
      const until = Date.now() + graceMs;
      let delivered = 0;
      while (Date.now() < until) {
        const { rows } = await db.pool.query<{ n: number }>(`SELECT count(*)::int AS n FROM outbox WHERE usage_id LIKE $1 AND status IN ('sent', 'accepted')`, [`${run}-%`]);
        delivered = rows[0]!.n;
        if (delivered >= total) break;
        await new Promise((r) => setTimeout(r, 200));
      }
      const { rows } = await db.pool.query<{ ms: number }>(
        `SELECT extract(epoch FROM sent_at - created_at) * 1000 AS ms FROM outbox WHERE usage_id LIKE $1 AND sent_at IS NOT NULL ORDER BY 1`,
        [`${run}-%`],
      );
      const lat = rows.map((r) => Number(r.ms));
      const keptUp = delivered >= total && pct(lat, 99) < 1_000;
      report.rows.push({
        offeredPerSecond: rate,
        arrivedPerSecond: Math.round((total / arrivalMs) * 10_000) / 10,
        deliveredInWindow: `${delivered}/${total}`,
        commitToAckP50Ms: Math.round(pct(lat, 50)),
        commitToAckP95Ms: Math.round(pct(lat, 95)),
        commitToAckP99Ms: Math.round(pct(lat, 99)),
        keptUp,
      });
      // Drain what is left before the next rate, so each step starts empty.
      for (let left = 1; left > 0; ) {
        const { rows: l } = await db.pool.query<{ n: number }>(`SELECT count(*)::int AS n FROM outbox WHERE status IN ('pending', 'claimed', 'dispatched')`);
        left = l[0]!.n;
        if (left > 0) await new Promise((r) => setTimeout(r, 500));
      }
      saturated = keptUp ? 0 : saturated + 1;
      if (saturated >= 2) break;
    }
  } finally {
    await pipeline.stop();
    await stripe.stop();
    await db.pool.end();
  }
  report.notes.push(`${opts.api}, ${opts.customers} customers, Stripe latency ${opts.latencyMs} ms, ${opts.seconds} s per rate; commit → acknowledged measured on the rows (sent_at − created_at)`);
}
