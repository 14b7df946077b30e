/**
 * `npm run bench -- batcher`: the v2 batcher (src/stripe/stream.ts) alone, driven at a steady
 * arrival rate against the local Stripe in a process of its own answering in a set time. No
 * PostgreSQL, no Temporal: `send` is called on a fixed schedule (an open loop, as a worker's
 * deliveries call it whatever Stripe is doing), 100 customers in turn.
 *
 * Per run: Stripe requests per event, mean events per request, requests in flight at once (peak,
 * and the mean over the run: the sum of request times over the run's length), and per event the
 * time it waited in the batcher before its request left (what batching adds) and from `send` to
 * settled (that plus Stripe's answer), p50/p99. Runs with a pace model Stripe's test mode (20
 * requests/s, the default pace with a test key) with an in-process pace instead of the
 * account-wide one in PostgreSQL.
 */
import { performance } from 'node:perf_hooks';
import Stripe from 'stripe';
import type { MeterEvent } from '../src/stripe/meters.js';
import { MeterEventStream, stripeStream, type StreamStripe } from '../src/stripe/stream.js';
import { pct, startStripeProcess, type Report } from './harness.js';

export interface BatcherRun {
  rate: number;
  latencyMs: number;
  /** Requests per second allowed by an in-process pace; none when absent. */
  pacePerSecond?: number;
}

const CUSTOMERS = 100;

export async function batcher(report: Report, opts: { runs: BatcherRun[]; seconds: number }): Promise<void> {
  for (const run of opts.runs) {
    report.rows.push(await oneRun(run, opts.seconds));
  }
  report.notes.push(
    'open loop: send() on a 1 ms schedule at the rate, 100 customers in turn; the local Stripe in its own process (src/bin/stripe-local.ts), its answer time set by its control API',
    '"waited" is send() → its request leaving (what batching adds); "settled" is send() → the promise settled (waited + Stripe\'s answer + the client)',
    'defaults of the batcher: linger 5 ms quiet / 500 ms busy, 100 events per request, 8 requests pacing or in flight',
  );
}

async function oneRun(run: BatcherRun, seconds: number): Promise<Record<string, unknown>> {
  const stripe = await startStripeProcess({ customers: CUSTOMERS, latencyMs: run.latencyMs });
  const { port } = new URL(stripe.url);
  const client = (key: string) => new Stripe(key, { host: '127.0.0.1', port: Number(port), protocol: 'http', maxNetworkRetries: 0 });
  const real = stripeStream(client('sk_test_bench_batcher'), (token) => client(token));

  // When each event's request left, and how long requests were in flight in all.
  const leftAt = new Map<string, number>();
  let inFlight = 0;
  let peakInFlight = 0;
  let requestMsTotal = 0;
  let requests = 0;
  const counted: StreamStripe = {
    createSession: () => real.createSession(),
    async sendEvents(token, events) {
      const t0 = performance.now();
      for (const e of events) if (!leftAt.has(e.identifier!)) leftAt.set(e.identifier!, t0);
      requests++;
      peakInFlight = Math.max(peakInFlight, ++inFlight);
      try {
        await real.sendEvents(token, events);
      } finally {
        inFlight--;
        requestMsTotal += performance.now() - t0;
      }
    },
  };
  const stream = new MeterEventStream(counted, run.pacePerSecond ? { pace: pacer(run.pacePerSecond) } : {});

  const sentAt: number[] = [];
  const settledMs: number[] = [];
  const outcomes: Promise<void>[] = [];
  let failed = 0;
  const total = Math.round(run.rate * seconds);
  const started = performance.now();
  try {
    await new Promise<void>((resolve) => {
      const tick = setInterval(() => {
        const due = Math.min(total, Math.floor(((performance.now() - started) / 1000) * run.rate));
        while (sentAt.length < due) {
          const i = sentAt.length;
          const t0 = performance.now();
          sentAt.push(t0);
          outcomes.push(
            stream.send(eventNumber(i)).then(
              () => void settledMs.push(performance.now() - t0),
              () => void failed++,
            ),
          );
        }
        if (sentAt.length >= total) {
          clearInterval(tick);
          resolve();
        }
      }, 1);
    });
    await Promise.all(outcomes);
  } finally {
    await stripe.stop();
  }
  const wallMs = performance.now() - started;
  const waited = sentAt
    .flatMap((t, i) => {
      const left = leftAt.get(identifierOf(i));
      return left === undefined ? [] : [left - t];
    })
    .sort((a, b) => a - b);
  const settled = settledMs.sort((a, b) => a - b);
  return {
    rate: run.rate,
    stripeMs: run.latencyMs,
    pace: run.pacePerSecond ? `${run.pacePerSecond}/s` : 'none',
    events: total,
    failed,
    requests,
    requestsPerEvent: round(requests / total, 4),
    eventsPerRequest: round(total / requests, 1),
    peakInFlight,
    meanInFlight: round(requestMsTotal / wallMs, 2),
    waitedP50Ms: round(pct(waited, 50), 1),
    waitedP99Ms: round(pct(waited, 99), 1),
    settledP50Ms: round(pct(settled, 50), 1),
    settledP99Ms: round(pct(settled, 99), 1),
  };
}

/** One slot every 1/perSecond s, handed out in order: the account-wide pace's shape, in this process. */
function pacer(perSecond: number): () => Promise<void> {
  let next = 0;
  return () => {
    const now = performance.now();
    const slot = Math.max(now, next);
    next = slot + 1000 / perSecond;
    return new Promise((resolve) => setTimeout(resolve, slot - now));
  };
}

const identifierOf = (i: number) => `bench-batcher-${i}`;

function eventNumber(i: number): MeterEvent {
  return {
    eventName: 'api_requests',
    keys: { customerKey: 'stripe_customer_id', valueKey: 'value' },
    stripeCustomerId: `cus_${(i % CUSTOMERS) + 1}`,
    quantity: 1,
    identifier: identifierOf(i),
    occurredAt: new Date(),
  };
}

const round = (x: number, digits: number) => Math.round(x * 10 ** digits) / 10 ** digits;
