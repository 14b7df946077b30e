/**
 * A starting process and the services it needs: PostgreSQL and Temporal may be restarting when a
 * worker or the API starts (a deploy of either, a node moved). Exiting at once hands the wait to a
 * supervisor, whose backoff grows with every exit (Kubernetes: up to 5 minutes); so the process
 * waits itself, for a bounded time (STARTUP_WAIT_MS), logging every failed try with its reason,
 * then gives up with the last error. Only a service that cannot be reached is waited for; any
 * other failure (a refused password, a missing database) is not one that waiting mends.
 */
import { causes } from './causes.js';
import type { Logger } from './log.js';
import { waitUnlessAborted } from './wait.js';

/** PostgreSQL's answers (SQLSTATE) and the socket's errors that mean "not there yet", not "wrong". */
const POSTGRES_AWAY = new Set([
  'ECONNREFUSED', 'ECONNRESET', 'ETIMEDOUT', 'EHOSTUNREACH', 'ENETUNREACH', 'EAI_AGAIN', 'ENOTFOUND', 'EPIPE',
  '57P01', // admin_shutdown: stopping
  '57P02', // crash_shutdown
  '57P03', // cannot_connect_now: starting up, or in recovery
  '08001', '08006', // could not connect, connection failure
  '53300', // too_many_connections: others may leave
]);

export function postgresUnreachable(err: unknown): boolean {
  const code = (err as { code?: unknown } | null)?.code;
  if (typeof code === 'string' && POSTGRES_AWAY.has(code)) return true;
  // pg's own words for a connection the server closed or that never answered.
  return err instanceof Error && /Connection terminated|timeout expired/i.test(err.message);
}

/**
 * The Temporal SDK reports a connection it could not open as text (the Rust core's transport
 * error, the client's "Failed to connect before the deadline", a gRPC status "14 UNAVAILABLE" or
 * "4 DEADLINE_EXCEEDED"), wrapped once or twice ("Failed to connect to Temporal server", then ours):
 * a refused or reset TCP connection, a name that does not resolve yet, a timeout, anywhere in the
 * chain of causes. A TLS or authentication failure is not among them (the worker's connection,
 * made first, fails on those at once).
 */
export function temporalUnreachable(err: unknown): boolean {
  if (typeof err === 'string') return TEMPORAL_AWAY.test(err);
  for (const e of causes(err)) if (e instanceof Error && TEMPORAL_AWAY.test(e.message)) return true;
  return false;
}

// 'The service is currently unavailable': the Rust core's words for UNAVAILABLE, which a server
// just started gives while its frontend is not healthy yet.
const TEMPORAL_AWAY = /tcp connect error|connection refused|connectionrefused|connection reset|dns error|deadline exceeded|timed out|14 UNAVAILABLE|service is currently unavailable|failed to connect before the deadline/i;

/**
 * `attempt()` until it succeeds; while it fails in a way `unreachable` says may pass, again after
 * 0.5, 1, 2, 4, 5, 5 … s, until `waitMs` has gone by since the first try, or `signal` aborts (a
 * stop asked for meanwhile). Then, or at once for any other failure, its error.
 */
export async function untilReachable<T>(
  service: string,
  attempt: () => Promise<T>,
  opts: { waitMs: number; unreachable: (err: unknown) => boolean; log?: Pick<Logger, 'warn'>; signal?: AbortSignal },
): Promise<T> {
  const giveUpAt = Date.now() + opts.waitMs;
  for (let delayMs = 500, tries = 1; ; delayMs = Math.min(delayMs * 2, 5_000), tries++) {
    try {
      return await attempt();
    } catch (err) {
      if (!opts.unreachable(err) || Date.now() + delayMs > giveUpAt || opts.signal?.aborted) throw err;
      opts.log?.warn({ service, tries, retryInMs: delayMs, error: err instanceof Error ? err.message : String(err) }, `${service} cannot be reached yet; trying again`);
      await (opts.signal ? waitUnlessAborted(delayMs, opts.signal) : new Promise((resolve) => setTimeout(resolve, delayMs)));
      if (opts.signal?.aborted) throw err;
    }
  }
}
