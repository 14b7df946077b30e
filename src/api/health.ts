/**
 * GET /health: can this process take usage? That needs PostgreSQL alone: 503 without it. Whether
 * Temporal answers is shown, not counted: while it is away usage is still recorded and waits in the
 * outbox, and a load balancer or readiness probe that read its absence as this process's would take
 * ingestion away during the very outage the outbox exists for (the worker's /health does the same).
 * Unauthenticated, so it says which dependency failed and nothing more; the cause goes to the log.
 */
import type { Connection } from '@temporalio/client';
import type { TemporalConfig } from '../config.js';
import { lazyHealthConnection, onTlsFilesChanged } from '../temporal/connection.js';
import { answeredWithin, type Queryable } from '../db.js';
import type { Logger } from '../log.js';

export type ProbeResult = 'ok' | 'timeout' | 'error';
/**
 * What the Temporal probe asks: whether the namespace answers. A call bound to the namespace (its
 * header added by the connection), not gRPC's health service: Temporal Cloud refuses a call tied to
 * no namespace from an API key, and /health would say Temporal is away for good while events move.
 */
export type TemporalHealth = Pick<Connection, 'workflowService' | 'withDeadline'> & { readonly namespace: string };

export interface HealthBody {
  status: 'ok' | 'unavailable';
  postgres: ProbeResult;
  temporal: ProbeResult | 'not_configured';
}

/** Runs `fn` with a deadline; the probe is abandoned (not cancelled) when the deadline passes. */
async function probe(what: string, fn: () => Promise<void>, timeoutMs: number, log: Pick<Logger, 'warn'>): Promise<ProbeResult> {
  let timer: NodeJS.Timeout | undefined;
  const timedOut = new Promise<'timeout'>((resolve) => (timer = setTimeout(() => resolve('timeout'), timeoutMs)));
  const ran = fn().then(
    () => 'ok' as const,
    (err: unknown) => {
      log.warn({ error: String(err), dependency: what }, 'health check failed');
      return 'error' as const;
    },
  );
  try {
    const result = await Promise.race([ran, timedOut]);
    if (result === 'timeout') log.warn({ dependency: what, timeoutMs }, 'health check timed out');
    return result;
  } finally {
    clearTimeout(timer);
  }
}

/**
 * A connection for health checks only: lazy (the API starts while Temporal is away) and without
 * the client's default retry interceptor. A probe wants one answer within its deadline, not
 * retries that outlive it (and that would fire on a channel closed at shutdown). Renewed TLS files
 * (onTlsFilesChanged) replace it with one made with them: a probe on the old certificate would say
 * Temporal is away for good once that certificate is revoked.
 */
export function temporalHealthConnection(temporal: TemporalConfig): TemporalHealth & { close(): Promise<void> } {
  let connection = lazyHealthConnection(temporal);
  const stopWatching = onTlsFilesChanged(temporal, async () => {
    const old = connection;
    connection = lazyHealthConnection(temporal);
    await old.close();
  });
  return {
    namespace: temporal.namespace,
    get workflowService() {
      return connection.workflowService;
    },
    withDeadline: (deadline, fn) => connection.withDeadline(deadline, fn),
    async close() {
      stopWatching();
      await connection.close();
    },
  };
}

/**
 * Whether PostgreSQL takes writes: a standby reached during a failover, or a managed server that
 * turned itself read-only, answers `SELECT 1` but refuses every usage and every delivery's update.
 */
async function writable(db: Queryable): Promise<void> {
  const { rows } = await db.query<{ read_only: boolean }>(`SELECT pg_is_in_recovery() OR current_setting('transaction_read_only') = 'on' AS read_only`);
  if (rows[0]?.read_only) throw new Error('PostgreSQL is read-only (a standby, or default_transaction_read_only is on): usage cannot be recorded');
}

/** How long one probe's answer serves the requests that follow it. */
export const HEALTH_FRESH_MS = 1_000;

/**
 * /health is unauthenticated: however many requests ask at once, one probe runs at a time, and its
 * answer serves every request within `freshMs` of it. Otherwise each request would queue a
 * statement in the pool usage is written through (and a call to Temporal), and a flood of them would
 * starve ingestion, then report itself unhealthy, and a probe abandoned at its deadline would leave
 * its statement queued behind it.
 */
export function oneProbeAtATime<T>(probeNow: () => Promise<T>, freshMs = HEALTH_FRESH_MS): () => Promise<T> {
  let running: Promise<T> | undefined;
  let last: { at: number; answer: T } | undefined;
  return () => {
    // By the monotonic clock: the wall clock stepped back (NTP, a VM resumed) would freeze the answer.
    if (last && performance.now() - last.at < freshMs) return Promise.resolve(last.answer);
    running ??= probeNow()
      .then((answer) => {
        last = { at: performance.now(), answer };
        return answer;
      })
      .finally(() => {
        running = undefined;
      });
    return running;
  };
}

export async function checkHealth(
  deps: { db: Queryable; temporal?: TemporalHealth | undefined; log: Pick<Logger, 'warn'> },
  timeoutMs: number,
): Promise<HealthBody> {
  const { db, temporal, log } = deps;
  const [postgres, temporalResult] = await Promise.all([
    // The statement's own timeout ends it (a silent connection is dropped, not kept by the pool).
    probe('postgres', async () => await writable(answeredWithin(db, timeoutMs)), timeoutMs, log),
    temporal
      ? probe(
          'temporal',
          async () => {
            // The gRPC deadline ends the call itself; the probe's timer only bounds our wait.
            await temporal.withDeadline(Date.now() + timeoutMs, () => temporal.workflowService.describeNamespace({ namespace: temporal.namespace }));
          },
          timeoutMs,
          log,
        )
      : Promise.resolve('not_configured' as const),
  ]);
  return { status: postgres === 'ok' ? 'ok' : 'unavailable', postgres, temporal: temporalResult };
}
