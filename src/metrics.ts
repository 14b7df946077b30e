/**
 * Prometheus metrics: what the worker's activities count, what the outbox table holds (read from
 * PostgreSQL at scrape time), and the Node process. One registry per process: in `npm start` the
 * API serves it at GET /metrics; a standalone worker serves it on WORKER_METRICS_PORT, with its
 * GET /health next to it.
 */
import http from 'node:http';
import type { AddressInfo } from 'node:net';
import { collectDefaultMetrics, Counter, Gauge, Histogram, Registry } from 'prom-client';
import type { Queryable } from './db.js';
import { statusSummary, type StatusSummary } from './outbox/sql/status.js';
import { OUTBOX_STATUSES } from './outbox/statuses.js';
import { schemaFor, type Schema } from './outbox/sql/schema.js';

/** How the delivery activity ended a call to Stripe, when it did not simply succeed. */
export const STRIPE_ERROR_CLASSES = ['retryable', 'rate_limited', 'rejected', 'delivered_duplicate', 'unsafe', 'credentials'] as const;
export type StripeErrorClass = (typeof STRIPE_ERROR_CLASSES)[number];


export interface MetricsOptions {
  /** Read at scrape time for the outbox gauges; without it they are not registered. */
  db?: Queryable;
  /** The schema of the outbox `db` holds (default billing_outbox). */
  schema?: Schema;
  /** Table size from which sent rows are estimated instead of counted (see statusSummary). */
  exactCountBelow?: number;
  /**
   * The Temporal SDK's own Prometheus exporter (see installTemporalRuntime), appended to every
   * render() so one scrape target carries both.
   */
  temporalSdkUrl?: string;
  /**
   * false: a process that runs no worker (the standalone API) registers only what it counts itself
   * (Stripe's error reports, a key Stripe refuses it) beside the outbox gauges: a worker's counters
   * served there would read 0 for good while the workers count elsewhere, and no alert would fire.
   */
  worker?: boolean;
}

export type Metrics = ReturnType<typeof createMetrics>;

/**
 * Creates every metric in `registry` (a new one by default), with prom-client's default process
 * metrics. Call once per registry: registering a name twice throws.
 */
export function createMetrics(registry: Registry = new Registry(), options: MetricsOptions = {}) {
  const registers = [registry];
  // The worker's own: created either way (callers need not ask), registered only in a worker.
  const workerRegisters = options.worker === false ? [] : registers;
  collectDefaultMetrics({ register: registry });

  const eventsSent = new Counter({
    name: 'billing_outbox_events_sent_total',
    help: 'Usage events this process saw Stripe acknowledge (accepted now, or already held as a duplicate identifier).',
    registers: workerRegisters,
  });
  const stripeErrors = new Counter({
    name: 'billing_outbox_stripe_errors_total',
    help: 'Delivery attempts that did not end in a plain acceptance, by class.',
    labelNames: ['class'] as const,
    registers,
  });
  const prunedRows = new Counter({
    name: 'billing_outbox_pruned_rows_total',
    help: 'Delivered and cancelled outbox rows deleted by this process after OUTBOX_RETENTION_DAYS.',
    registers: workerRegisters,
  });
  const claimBatchSize = new Histogram({
    name: 'billing_outbox_relay_claim_batch_size',
    help: 'Rows taken by each non-empty relay claim (empty polls only show in the claim duration count).',
    buckets: [1, 2, 5, 10, 25, 50, 100, 200, 500, 1000, 2000, 5000],
    registers: workerRegisters,
  });
  const claimDuration = new Histogram({
    name: 'billing_outbox_relay_claim_duration_seconds',
    help: 'Time of each relay claim query, empty or not.',
    buckets: [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5],
    registers: workerRegisters,
  });
  const laneWindow = new Gauge({
    name: 'billing_outbox_relay_lane_window',
    help: "Events each lane may have in flight in this process's next claim: LANE_MAX_IN_FLIGHT, less while quiet tenants' events are claimed beside a busy lane and Temporal starts workflows slowly.",
    registers: workerRegisters,
  });
  const lanePause = new Gauge({
    name: 'billing_outbox_relay_lane_pause_seconds',
    help: "How long a busy lane waits after this process's claim took its rows before the next may: 0, or up to 1 s while the lane window is at its floor and Temporal still starts workflows slowly.",
    registers: workerRegisters,
  });
  const commitToAck = new Histogram({
    name: 'billing_outbox_commit_to_ack_seconds',
    help: 'From the outbox row being committed to Stripe acknowledging the event.',
    buckets: [0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600, 21600, 86400],
    registers: workerRegisters,
  });
  // An API counts only the key Stripe refuses it (reading an error report): its other classes absent.
  for (const c of options.worker === false ? (['credentials'] as const) : STRIPE_ERROR_CLASSES) stripeErrors.inc({ class: c }, 0);
  const startFailures = new Counter({
    name: 'billing_outbox_start_failures_total',
    help:
      'Usage workflow starts that failed: refused (Temporal refused the start for good; the row is dead with temporal_start_refused) or transient (it may pass; the row is tried again, counted by status as temporal_start_failed).',
    labelNames: ['reason'] as const,
    registers: workerRegisters,
  });
  for (const reason of ['refused', 'transient']) startFailures.inc({ reason }, 0);
  const closedRuns = new Counter({
    name: 'billing_outbox_closed_runs_total',
    help:
      "Outbox rows found in flight whose workflow run had closed without delivering them (terminated, cancelled, timed out, failed, gone, completed), by the run's status; each is made dead with workflow_closed.",
    labelNames: ['status'] as const,
    registers: workerRegisters,
  });
  const asyncRejections = new Counter({
    name: 'billing_outbox_async_rejections_total',
    help:
      'Meter events Stripe accepted and then rejected, as counted in the error reports this process received (v1.billing.meter.error_report_triggered), by error code. Includes events Stripe did not name individually.',
    labelNames: ['code'] as const,
    registers,
  });

  const stripeClockSkew = new Gauge({
    name: 'billing_outbox_stripe_clock_skew_seconds',
    help:
      "v2: Stripe's clock minus this worker's, from the created time of the last meter event session (0 until the first). Far from 0: fix the worker's time sync.",
    registers: workerRegisters,
  });

  // Set by the reconcile activity of the process that ran the last scheduled run: with several
  // workers, read the series whose last-success time is the latest (max by instance).
  const reconcileDrift = new Gauge({
    name: 'billing_outbox_reconcile_drift',
    help:
      "The last scheduled reconciliation's drift, in meter units summed over its windows: stripe_more (Stripe counts usage no sent row accounts for), stripe_less (our sent rows Stripe did not count).",
    labelNames: ['direction'] as const,
    registers: workerRegisters,
  });
  const reconcileLastSuccess = new Gauge({
    name: 'billing_outbox_reconcile_last_success_timestamp_seconds',
    help: 'When a scheduled reconciliation last completed in this process (0: none yet), whatever it found.',
    registers: workerRegisters,
  });
  const reconcileDriftingCustomers = new Gauge({
    name: 'billing_outbox_reconcile_drifting_customers',
    help: "Stripe customers whose usage differed in the last scheduled reconciliation (names: the run's result, billing-outbox status).",
    registers: workerRegisters,
  });

  // The worker's judgement that Stripe is down for everyone (src/stripe/outage.ts), read when scraped.
  let stripeDownSince: () => number | null = () => null;
  new Gauge({
    name: 'billing_outbox_stripe_down_seconds',
    help: "How long this worker has taken Stripe for down for everyone (its calls failing with 5xx or no answer for several customers, no other answer between), its deliveries waiting without spending attempts; 0 when it does not.",
    registers: workerRegisters,
    collect() {
      const since = stripeDownSince();
      this.set(since === null ? 0 : Math.max(0, Date.now() - since) / 1000);
    },
  });

  const outboxRegisters = options.db ? registers : [];
  const outboxRows = new Gauge({
    name: 'billing_outbox_rows',
    help: 'Outbox rows by status (sent is estimated from table statistics on large tables).',
    labelNames: ['status'] as const,
    registers: outboxRegisters,
    collect: () => refresh(),
  });
  const oldestPendingAge = new Gauge({
    name: 'billing_outbox_oldest_pending_age_seconds',
    help: 'Age of the oldest outbox row not yet taken by a relay (pending or claimed); 0 when none.',
    registers: outboxRegisters,
    collect: () => refresh(),
  });
  const longestIdleInFlight = new Gauge({
    name: 'billing_outbox_in_flight_idle_seconds',
    help: 'How long the dispatched row untouched longest has gone without an attempt or a mark (a run at work touches it at every attempt); 0 when none.',
    registers: outboxRegisters,
    collect: () => refresh(),
  });
  const statusQueryFailures = new Counter({
    name: 'billing_outbox_status_query_failures_total',
    help: 'Scrapes on which the outbox status query failed (the outbox gauges are then absent).',
    registers: outboxRegisters,
    // Waits for the scrape's query too, so the failure shows in the same scrape.
    collect: () => refresh(),
  });

  // Both gauges are filled by the same query; a scrape collects them concurrently, so they share
  // one in-flight query instead of running it twice.
  let inFlight: Promise<void> | undefined;
  function refresh(): Promise<void> {
    inFlight ??= query().finally(() => (inFlight = undefined));
    return inFlight;
  }
  async function query(): Promise<void> {
    if (!options.db) return;
    let summary: StatusSummary;
    try {
      summary = await statusSummary(options.db, options.schema ?? schemaFor(), { exactCountBelow: options.exactCountBelow });
    } catch {
      // No stale numbers: absent series are what an alert on a dead database should see.
      outboxRows.reset();
      oldestPendingAge.reset();
      longestIdleInFlight.reset();
      statusQueryFailures.inc();
      return;
    }
    for (const status of OUTBOX_STATUSES) outboxRows.set({ status }, summary.counts[status]);
    oldestPendingAge.set(summary.oldestPendingAgeSeconds);
    longestIdleInFlight.set(summary.longestIdleInFlight?.idleSeconds ?? 0);
  }

  return {
    registry,
    eventsSent,
    stripeErrors,
    startFailures,
    closedRuns,
    asyncRejections,
    stripeClockSkew,
    prunedRows,
    claimBatchSize,
    laneWindow,
    lanePause,
    claimDuration,
    commitToAck,
    outboxRows,
    oldestPendingAge,
    statusQueryFailures,
    reconcileDrift,
    reconcileLastSuccess,
    reconcileDriftingCustomers,
    /** Where billing_outbox_stripe_down_seconds reads the worker's judgement from. */
    watchStripeDown(downSince: () => number | null): void {
      stripeDownSince = downSince;
    },
    contentType: registry.contentType,
    /** The registry in Prometheus text format, followed by the Temporal SDK's metrics if configured. */
    async render(): Promise<string> {
      const own = await registry.metrics();
      if (!options.temporalSdkUrl) return own;
      try {
        const res = await fetch(options.temporalSdkUrl, { signal: AbortSignal.timeout(2_000) });
        if (!res.ok) throw new Error(`HTTP ${res.status}`);
        return `${own}\n${await res.text()}`;
      } catch (err) {
        return `${own}\n# Temporal SDK metrics unavailable: ${String(err).replace(/\s+/g, ' ')}\n`;
      }
    },
  };
}

/** What the delivery activity records. */
export type DeliveryMetrics = Pick<Metrics, 'eventsSent' | 'stripeErrors' | 'commitToAck' | 'watchStripeDown'>;
/** What the reconcile activity records. */
export type ReconcileMetrics = Pick<Metrics, 'reconcileDrift' | 'reconcileLastSuccess' | 'reconcileDriftingCustomers'>;
/** What the relay activity records. */
export type RelayMetrics = Pick<Metrics, 'claimBatchSize' | 'claimDuration' | 'laneWindow' | 'lanePause' | 'startFailures' | 'closedRuns'>;

export interface MetricsServer {
  url: string;
  close(): Promise<void>;
}

/** What GET /health answers: 200 with the body when `ok`, else 503 with it (it says why). */
export interface HealthAnswer {
  ok: boolean;
  body: Record<string, unknown>;
}

/**
 * A bare HTTP server for a worker process that has no API: GET /metrics and, given `health`,
 * GET /health (a container's HEALTHCHECK, a load balancer). Unauthenticated: bind it to an address
 * only the scraper and the orchestrator reach.
 */
export async function startMetricsServer(
  metrics: Pick<Metrics, 'render' | 'contentType'>,
  opts: { host: string; port: number; health?: () => Promise<HealthAnswer> },
): Promise<MetricsServer> {
  const server = http.createServer((req, res) => {
    const route = req.method === 'GET' ? (req.url ?? '').split('?')[0] : undefined;
    if (route === '/metrics') {
      metrics.render().then(
        (text) => res.writeHead(200, { 'content-type': metrics.contentType }).end(text),
        () => res.writeHead(500, { 'content-type': 'text/plain' }).end('metrics unavailable\n'),
      );
    } else if (route === '/health' && opts.health) {
      opts.health().then(
        ({ ok, body }) => res.writeHead(ok ? 200 : 503, { 'content-type': 'application/json' }).end(JSON.stringify(body)),
        (err: unknown) => res.writeHead(503, { 'content-type': 'application/json' }).end(JSON.stringify({ status: 'unavailable', reason: `health check failed: ${String(err)}` })),
      );
    } else {
      res.writeHead(404, { 'content-type': 'text/plain' }).end('not found\n');
    }
  });
  await new Promise<void>((resolve, reject) => {
    server.once('error', reject);
    server.listen(opts.port, opts.host, () => resolve());
  });
  const { address, port } = server.address() as AddressInfo;
  const host = address.includes(':') ? `[${address}]` : address;
  return {
    url: `http://${host}:${port}/metrics`,
    close: () =>
      new Promise<void>((resolve, reject) => {
        server.close((err) => (err ? reject(err) : resolve()));
        server.closeIdleConnections();
      }),
  };
}

/**
 * Label values from outside (Stripe's error codes in its reports), kept to a bounded set: a value
 * shaped like a code is its own label until `max` of them are in use, anything after that or
 * shaped otherwise counts as `other`. Stripe adds codes now and then; a metric must not grow without
 * bound whatever a payload says.
 */
export class BoundedLabels {
  private readonly seen = new Set<string>();
  private readonly max: number;
  constructor(max = 50) {
    this.max = max;
  }

  of(value: string): string {
    if (this.seen.has(value)) return value;
    if (!/^[a-z][a-z0-9_]{0,63}$/.test(value) || this.seen.size >= this.max) return 'other';
    this.seen.add(value);
    return value;
  }
}
