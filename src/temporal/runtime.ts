/**
 * Routes the Temporal SDK's own logs into our structured logger. Must run before anything touches
 * the SDK runtime (connections, workers, test environments), once per process.
 */
import { DefaultLogger, Runtime, type LogLevel } from '@temporalio/worker';
import type { Logger } from '../log.js';

let installed = false;

/** The SDK's level for our LOG_LEVEL: activities log through the SDK (with workflow ids attached). */
export function sdkLogLevel(level: string): LogLevel {
  switch (level) {
    case 'trace':
      return 'TRACE';
    case 'debug':
      return 'DEBUG';
    case 'info':
      return 'INFO';
    case 'warn':
      return 'WARN';
    default:
      return 'ERROR';
  }
}

/**
 * The Temporal SDK's logger (the activities' and workflows' lines go through it) writing to `log`
 * from `level` up, scrubbed and shaped like ours; without `log`, silent (the SDK's own default
 * writes to standard error).
 */
export function sdkLogger(log: Logger | undefined, level: LogLevel): DefaultLogger {
  return new DefaultLogger(level, ({ level: l, message, meta }) => {
    if (!log) return;
    const fields = { ...meta, sdk: 'temporal' };
    // Task tokens are opaque but long; they make log lines unreadable and say nothing to a human.
    delete (fields as Record<string, unknown>).taskToken;
    if (l === 'ERROR') log.error(fields, message);
    else if (l === 'WARN') log.warn(fields, message);
    else if (l === 'INFO') log.info(fields, message);
    else log.debug(fields, message);
  });
}

/**
 * `prometheusBindAddress` (host:port) turns on the SDK's own Prometheus exporter (worker and
 * connection metrics: task slots, poll latencies, schedule-to-start, …) at http://host:port/metrics.
 * `forwardCoreLogs: false` leaves the SDK core's warnings on the console whatever `level` says: a
 * program that logs errors only (the demo) still shows them, since each one is a bug to fix.
 */
export function installTemporalRuntime(log: Logger | undefined, level: LogLevel = 'WARN', prometheusBindAddress?: string, forwardCoreLogs = true): void {
  if (installed) return;
  installed = true;
  Runtime.install({
    logger: sdkLogger(log, level),
    telemetryOptions: {
      // The SDK core's own lines (Rust) go through the same logger, so that they read like ours
      // (JSON, or lines for a person on a terminal) and are scrubbed like ours. Its INFO lines
      // are its start-up chatter: from WARN up unless debugging. Without a logger they go to the
      // console as before.
      ...(log && forwardCoreLogs ? { logging: { filter: { core: level === 'INFO' ? 'WARN' : level, other: 'ERROR' }, forward: {} } } : {}),
      ...(prometheusBindAddress ? { metrics: { prometheus: { bindAddress: prometheusBindAddress } } } : {}),
    },
  });
}
