/**
 * `npm run bench -- fairness`: does one tenant's flood delay everyone else? In one run, per Stripe
 * API: 99 tenants' usage arriving at a steady rate alone, then the same steady rate right after one
 * other tenant committed a backlog (20,000 events by default, in one statement, as after an
 * outage). For the steady tenants' events: commit → acknowledged by Stripe (the row's sent_at −
 * created_at) at p50/p99, in both phases. Fair means the flood barely moves them (issue 17's
 * target: p99 within 1.5× of the run without the flood). Each API runs on a database, a local
 * Stripe and a task queue of its own. What is left of the flood when the steady events are in is
 * removed, and the steady rate runs alone once more ('alone after') to bracket the flood phase.
 */
import { randomUUID } from 'node:crypto';
import type pg from 'pg';
import { withTransaction } from '../src/db.js';
import { recordUsage } from '../src/outbox/enqueue.js';
import { benchConfig, commitBacklog, freshDatabase, onSchedule, pct, spawnWorkerProcesses, startPipelineWorker, startStripeProcess, waitUntil, type Report, type Services } from './harness.js';

export interface FairnessOptions {
  /** The flooding tenant's backlog. */
  backlog: number;
  /** Tenants in all: the first floods, the others arrive steadily. */
  tenants: number;
  /** Steady arrivals per second, spread over the other tenants. */
  rate: number;
  seconds: number;
  latencyMs: number;
  apis: ('v1' | 'v2')[];
  /** LANE_MAX_IN_FLIGHT; unset: each API's default. */
  laneMax?: string;
  /** RELAY_COUNT; unset: the bench's 2. */
  relays?: string;
  /** Worker processes (`src/bin/worker.ts`, each with its own lane window); unset: one worker in this process. */
  workers?: number;
}

/** The flooding tenant: `t1` in freshDatabase's and commitBacklog's naming. */
const FLOODER = 't1';

export async function fairness(services: Services, report: Report, opts: FairnessOptions): Promise<void> {
  for (const api of opts.apis) {
    const db = await freshDatabase(services, opts.tenants);
    const stripe = await startStripeProcess({ customers: opts.tenants, latencyMs: opts.latencyMs });
    const env = { STRIPE_METER_API: api, RELAY_COUNT: opts.relays ?? '2', ...(opts.laneMax ? { LANE_MAX_IN_FLIGHT: opts.laneMax } : {}) };
    const pipeline = opts.workers
      ? await spawnWorkerProcesses(services, opts.workers, { DATABASE_URL: db.url, STRIPE_API_BASE: stripe.url, ...env })
      : await startPipelineWorker(services, db, benchConfig(services, stripe, env));
    try {
      // Warm up (bundle loaded, connections open) on the steady tenants.
      await steadyArrivals(db.pool, `warmup-${randomUUID().slice(0, 8)}`, 20, 1, opts.tenants);
      await waitUntil('warm-up', async () => (await open(db.pool)) === 0, 120_000, 200);
      const alone = await phase(db.pool, opts, false);
      const flood = await phase(db.pool, opts, true);
      // What is left of the flood once the steady events are in is not measured: it is removed
      // (the rows its lanes hold finish), so that a backlog of any size costs the run no drain and
      // the same rate runs alone once more, on the same warm pipeline, to bracket the flood phase.
      const floodLeft = await dropPendingFlood(db.pool);
      await waitUntil('the flood in flight to finish', async () => (await open(db.pool)) === 0, 10 * 60_000, 200);
      const after = await phase(db.pool, opts, false);
      for (const [name, p] of [['alone', alone], ['flood', flood], ['alone after', after]] as const) {
        report.rows.push({
          api,
          phase: name,
          backlog: name === 'flood' ? opts.backlog : 0,
          steadyEvents: p.events,
          deliveredInWindow: `${p.deliveredInWindow}/${p.events}`,
          othersP50Ms: Math.round(pct(p.latencies, 50)),
          othersP99Ms: Math.round(pct(p.latencies, 99)),
          othersMaxMs: Math.round(p.latencies.at(-1) ?? NaN),
          // Where the wait is: in the outbox (commit → dispatched: the claim) or in Temporal and the worker (dispatched → acknowledged).
          othersToDispatchP99Ms: Math.round(pct(p.toDispatch, 99)),
          othersInTemporalP99Ms: Math.round(pct(p.inTemporal, 99)),
          floodSentByThen: name === 'flood' ? p.floodSent : '',
          floodLeftUnsent: name === 'flood' ? floodLeft : '',
          // The flood's drain rate meanwhile: what the lane limit leaves the flooding tenant.
          floodPerSecond: name === 'flood' ? Math.round(p.floodSent / p.seconds) : '',
          p99VsAlone: name === 'flood' ? ratio(p, alone) : '',
          p99VsAloneAfter: name === 'flood' ? ratio(p, after) : '',
        });
      }
    } finally {
      await pipeline.stop();
      await stripe.stop();
      await db.pool.end();
    }
  }
  report.notes.push(
    `LANE_MAX_IN_FLIGHT ${opts.laneMax ?? 'default'}; RELAY_COUNT ${opts.relays ?? 2}; ${opts.workers ? `${opts.workers} worker processes` : 'one worker in the bench process'}; ${opts.tenants - 1} steady tenants at ${opts.rate}/s in all for ${opts.seconds} s; one tenant's backlog of ${opts.backlog} committed at once just before the flood phase; Stripe latency ${opts.latencyMs} ms`,
  );
  report.notes.push('target (issue 17): the steady tenants’ p99 with the flood within 1.5× of the same rate alone (p99VsAlone ≤ 1.5)');
}

interface Phase {
  events: number;
  deliveredInWindow: number;
  latencies: number[];
  toDispatch: number[];
  inTemporal: number[];
  floodSent: number;
  /** From the flood's commit (or the first arrival) to the last steady event delivered. */
  seconds: number;
}

/** One phase: (the flood, then) the steady arrivals; waits until every steady event is delivered. */
async function phase(pool: pg.Pool, opts: FairnessOptions, withFlood: boolean): Promise<Phase> {
  const run = randomUUID().slice(0, 8);
  const began = performance.now();
  if (withFlood) await commitBacklog(pool, opts.backlog, 1, `flood-${run}`);
  const events = await steadyArrivals(pool, run, opts.rate, opts.seconds, opts.tenants);
  const delivered = () => count(pool, `SELECT count(*)::int AS n FROM outbox WHERE usage_id LIKE $1 AND sent_at IS NOT NULL`, [`${run}-%`]);
  // What was delivered a few seconds after the last arrival, as `steady` counts it.
  await new Promise((r) => setTimeout(r, 5_000));
  const deliveredInWindow = await delivered();
  // Then every steady event, however long the flood holds them back (that is the figure).
  await waitUntil('the steady events to be delivered', async () => (await delivered()) >= events, 30 * 60_000, 200);
  const seconds = (performance.now() - began) / 1000;
  const floodSent = await count(pool, `SELECT count(*)::int AS n FROM outbox WHERE tenant_id = $1 AND usage_id LIKE $2 AND sent_at IS NOT NULL`, [FLOODER, `flood-${run}-%`]);
  const { rows } = await pool.query<{ total: number; dispatch: number; temporal: number }>(
    `SELECT extract(epoch FROM sent_at - created_at) * 1000 AS total, extract(epoch FROM dispatched_at - created_at) * 1000 AS dispatch,
            extract(epoch FROM sent_at - dispatched_at) * 1000 AS temporal
       FROM outbox WHERE usage_id LIKE $1`,
    [`${run}-%`],
  );
  const sorted = (pick: (r: (typeof rows)[number]) => number) => rows.map((r) => Number(pick(r))).sort((a, b) => a - b);
  return { events, deliveredInWindow, latencies: sorted((r) => r.total), toDispatch: sorted((r) => r.dispatch), inTemporal: sorted((r) => r.temporal), floodSent, seconds };
}

/**
 * `rate` usages a second for `seconds`, round-robin over tenants t2…t<tenants> (never the flooder),
 * each committed by recordUsage in a transaction of its own at its due time, as the API does.
 */
async function steadyArrivals(pool: pg.Pool, run: string, rate: number, seconds: number, tenants: number): Promise<number> {
  const total = Math.round(rate * seconds);
  await onSchedule(total, rate, (i) => withTransaction(pool, (c) => recordUsage(c, { usageId: `${run}-${i}`, tenantId: `t${(i % (tenants - 1)) + 2}`, quantity: 1 })).then(() => undefined));
  return total;
}

const ratio = (flood: Phase, alone: Phase) => Math.round((pct(flood.latencies, 99) / pct(alone.latencies, 99)) * 100) / 100;

/** Removes the flood's rows no relay has claimed yet; returns how many. */
async function dropPendingFlood(pool: pg.Pool): Promise<number> {
  const { rowCount } = await pool.query(`DELETE FROM outbox WHERE tenant_id = $1 AND status = 'pending'`, [FLOODER]);
  return rowCount ?? 0;
}

const open = (pool: pg.Pool) => count(pool, `SELECT count(*)::int AS n FROM outbox WHERE status IN ('pending', 'claimed', 'dispatched')`, []);

async function count(pool: pg.Pool, sql: string, params: unknown[]): Promise<number> {
  const { rows } = await pool.query<{ n: number }>(sql, params);
  return rows[0]!.n;
}
