/**
 * `npm run bench -- peers`: the same events to the same local Stripe, in the same run, three ways:
 *
 * - billing-outbox (Temporal, one workflow per event);
 * - graphile-worker, one job per event, each customer's jobs in a named queue (graphile-worker runs
 *   a queue's jobs one at a time: Stripe's one call per customer and meter);
 * - a plain loop without Temporal: per customer, claim the oldest pending row with `FOR UPDATE SKIP
 *   LOCKED`, call Stripe, mark it sent (what one would write by hand; no retry policy, no dead
 *   letters, no UI).
 *
 * Each as events per second and as a ratio to the fastest. The peers call Stripe with the same
 * client, payload keys and identifiers as billing-outbox.
 */
import { Logger, makeWorkerUtils, run, type Task } from 'graphile-worker';
import { createStripeClient } from '../src/stripe/client.js';
import { DEFAULT_METER_KEYS } from '../src/stripe/meters.js';
import { sendMeterEvent } from '../src/stripe/client.js';
import { drainOnce } from './ceiling.js';
import { benchConfig, commitBacklog, countSent, cpuMeter, freshDatabase, perSecond, startStripeProcess, waitUntil, type Report, type Services } from './harness.js';

interface Row {
  id: number;
  idempotency_key: string;
  quantity: number;
  occurred_at: Date;
  tenant_id: string;
}

export async function peers(services: Services, report: Report, opts: { events: number; customers: number; latencyMs: number }): Promise<void> {
  const ours = await drainOnce(services, report, { ...opts, label: 'billing-outbox (Temporal)' });
  const graphile = await viaGraphileWorker(services, report, opts);
  const plain = await viaPlainLoop(services, report, opts);
  const best = Math.max(ours, graphile, plain);
  for (const row of report.rows) row.ratioToFastest = Math.round(((row.perSecond as number) / best) * 100) / 100;
  report.notes.push(`${opts.customers} customers, Stripe latency ${opts.latencyMs} ms, v1 meter events, one call at a time per customer in every variant`);
}

async function viaGraphileWorker(services: Services, report: Report, opts: { events: number; customers: number; latencyMs: number }): Promise<number> {
  const db = await freshDatabase(services, opts.customers);
  const stripeServer = await startStripeProcess({ customers: opts.customers, latencyMs: opts.latencyMs });
  const stripe = createStripeClient(benchConfig(services, stripeServer).stripe);
  const utils = await makeWorkerUtils({ connectionString: db.url });
  try {
    await utils.migrate();
    const report_usage: Task = async (payload) => {
      const r = payload as { key: string; customer: string; quantity: number; occurredAt: string };
      await sendMeterEvent(stripe, {
        eventName: 'api_requests',
        keys: DEFAULT_METER_KEYS,
        stripeCustomerId: r.customer,
        quantity: r.quantity,
        identifier: r.key,
        occurredAt: new Date(r.occurredAt),
      });
      await db.pool.query(`UPDATE outbox SET status = 'sent', sent_at = now() WHERE idempotency_key = $1`, [r.key]);
    };
    const runner = await run({ connectionString: db.url, concurrency: Math.min(opts.customers, 50), noHandleSignals: true, pollInterval: 200, taskList: { report_usage }, logger: quietGraphileLogger() });
    try {
      const cpu = await cpuMeter(stripeServer.pid);
      const started = performance.now();
      // The backlog and its jobs, as an application would queue them: one job per event, a queue per customer.
      await commitBacklog(db.pool, opts.events, opts.customers);
      await db.pool.query(
        `SELECT graphile_worker.add_jobs(array_agg(ROW('report_usage',
                  json_build_object('key', o.idempotency_key, 'customer', c.stripe_customer_id, 'quantity', o.quantity, 'occurredAt', o.occurred_at),
                  'cus:' || c.stripe_customer_id, NULL, NULL, NULL, NULL, NULL)::graphile_worker.job_spec))
           FROM outbox o JOIN billing_customers c USING (tenant_id)`,
      );
      await waitUntil('graphile-worker to drain', async () => (await countSent(db.pool)) >= opts.events, 30 * 60_000, 200);
      const ms = performance.now() - started;
      const rate = perSecond(opts.events, ms);
      report.rows.push({ shape: 'graphile-worker (job per event)', events: opts.events, customers: opts.customers, seconds: Math.round(ms / 100) / 10, perSecond: rate, ...(await cpu(opts.events)) });
      return rate;
    } finally {
      await runner.stop();
    }
  } finally {
    await utils.release();
    await stripeServer.stop();
    await db.pool.end();
  }
}

async function viaPlainLoop(services: Services, report: Report, opts: { events: number; customers: number; latencyMs: number }): Promise<number> {
  const db = await freshDatabase(services, opts.customers);
  const stripeServer = await startStripeProcess({ customers: opts.customers, latencyMs: opts.latencyMs });
  const stripe = createStripeClient(benchConfig(services, stripeServer).stripe);
  try {
    await commitBacklog(db.pool, opts.events, opts.customers);
    const cpu = await cpuMeter(stripeServer.pid);
    const started = performance.now();
    await Promise.all(
      Array.from({ length: opts.customers }, async (_, i) => {
        const tenant = `t${i + 1}`;
        for (;;) {
          const { rows } = await db.pool.query<Row>(
            `UPDATE outbox SET status = 'claimed', claim_id = gen_random_uuid(), processing_deadline = now() + interval '1 minute'
              WHERE id = (SELECT id FROM outbox WHERE tenant_id = $1 AND status = 'pending' ORDER BY tenant_id, event_name, id LIMIT 1 FOR UPDATE SKIP LOCKED)
              RETURNING id, idempotency_key, quantity, occurred_at, tenant_id`,
            [tenant],
          );
          const row = rows[0];
          if (!row) return;
          await sendMeterEvent(stripe, {
            eventName: 'api_requests',
            keys: DEFAULT_METER_KEYS,
            stripeCustomerId: `cus_${i + 1}`,
            quantity: row.quantity,
            identifier: row.idempotency_key,
            occurredAt: row.occurred_at,
          });
          await db.pool.query(`UPDATE outbox SET status = 'sent', sent_at = now(), claim_id = NULL, processing_deadline = NULL WHERE id = $1`, [row.id]);
        }
      }),
    );
    const ms = performance.now() - started;
    const rate = perSecond(opts.events, ms);
    report.rows.push({ shape: 'plain SKIP LOCKED loop (no Temporal)', events: opts.events, customers: opts.customers, seconds: Math.round(ms / 100) / 10, perSecond: rate, ...(await cpu(opts.events)) });
    return rate;
  } finally {
    await stripeServer.stop();
    await db.pool.end();
  }
}

function quietGraphileLogger(): Logger {
  return new Logger(() => () => undefined);
}
