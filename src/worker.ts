/**
 * billing-outbox/worker: a worker (the relays, the usage workflows and their activities) inside an
 * application's own process or its own entry file.
 *
 *   import { createWorker } from 'billing-outbox/worker';
 *   const worker = await createWorker({ database: pool, temporal: { address }, stripe: { apiKey }, taskQueue: 'billing' });
 *   const running = worker.run();   // until shutdown; rejects if the worker crashes
 *   …
 *   await worker.shutdown();        // stops claiming, drains in-flight activities
 *   await running;
 *
 * Options are checked as the commands check the environment (src/config.ts, the same ranges and
 * defaults); a bad or missing one is refused with a ConfigError naming the option. Nothing here
 * reads `process.env` or changes anything global: signal handlers only with `handleSignals`, and
 * removed when the worker stops; the Temporal SDK's runtime (its logger) is left to the application,
 * and installed without signal handlers when the application has not installed one.
 */
import { Runtime, type NativeConnection, type WorkerOptions as TemporalWorkerOptions } from '@temporalio/worker';
import type pg from 'pg';
import { ConfigError, isStripeItself, loadConfig, type Config } from './config.js';
import type { Logger } from './log.js';
import { launchWorker, type WorkerHandle, type WorkerHealth } from './temporal/worker.js';
import { sdkLogger } from './temporal/runtime.js';
import type { Tracing } from './tracing.js';

export { ConfigError };
export type { Tracing, WorkerHandle, WorkerHealth };

/** How to reach Temporal: its address and credentials, or a connection of the application's own. */
export interface WorkerTemporalOptions {
  /** host:port (default localhost:7233; Temporal Cloud: <namespace>.<account>.tmprl.cloud:7233). */
  address?: string;
  /** Default "default". */
  namespace?: string;
  /**
   * TLS: `true` with the system's CAs; files (PEM paths) for a private CA (`caFile`), a client
   * certificate for mTLS (`certFile` and `keyFile`), the name on the server's certificate
   * (`serverName`); `false` refuses TLS. On by default with `apiKey` or any file.
   */
  tls?: boolean | { caFile?: string; certFile?: string; keyFile?: string; serverName?: string };
  /** A Temporal Cloud API key. */
  apiKey?: string;
  /**
   * A file holding the Temporal Cloud API key instead (a mounted secret): read again while the
   * worker runs, so a key rotated in it is taken up with no restart (as TEMPORAL_API_KEY_FILE).
   */
  apiKeyFile?: string;
  /**
   * A connection the application made (certificates from memory, its own settings): used as is,
   * never closed by the worker; `address`, `tls`, `apiKey` and `apiKeyFile` must then be left out.
   */
  connection?: NativeConnection;
}

/** Where usage goes: Stripe, or a Stripe-compatible server (`apiBase`, test keys only). */
export interface WorkerStripeOptions {
  /** sk_… or rk_…; required for Stripe itself (or `apiKeyFile`). */
  apiKey?: string;
  /**
   * A file holding the key instead (a mounted secret): read again while the worker runs, so a key
   * rolled in it is taken up with no restart (as STRIPE_API_KEY_FILE).
   */
  apiKeyFile?: string;
  /** Default https://api.stripe.com. */
  apiBase?: string;
  /** v1: one call per event (default); v2: the meter event stream, in batches. */
  meterApi?: 'v1' | 'v2';
  /** The meter of usage recorded without an event name (default api_requests). */
  meterEventName?: string;
  timeoutMs?: number;
  unansweredHoldMs?: number;
  /** Calls per second across every worker (default 900 with a live key, 20 otherwise). */
  rateLimitPerSecond?: number;
  /** Put in front of every identifier Stripe gets, for deployments sharing one account. */
  identifierNamespace?: string;
}

/** The knobs of src/config.ts, with its defaults and ranges (the variable each one stands for in brackets). */
export interface WorkerTuning {
  relayCount?: number; // RELAY_COUNT
  relayBatchSize?: number; // RELAY_BATCH_SIZE
  relayClaimTimeoutMs?: number; // RELAY_CLAIM_TIMEOUT_MS
  relayPollIntervalMs?: number; // RELAY_POLL_INTERVAL_MS
  laneMaxInFlight?: number; // LANE_MAX_IN_FLIGHT
  maxConcurrentDeliveries?: number; // WORKER_MAX_CONCURRENT_DELIVERIES
  startupWaitMs?: number; // STARTUP_WAIT_MS
  retryInitialIntervalMs?: number; // RETRY_INITIAL_INTERVAL_MS
  retryBackoffCoefficient?: number; // RETRY_BACKOFF_COEFFICIENT
  retryMaximumIntervalMs?: number; // RETRY_MAXIMUM_INTERVAL_MS
  retryMaximumAttempts?: number; // RETRY_MAXIMUM_ATTEMPTS
  retryMaxRateLimitedMs?: number; // RETRY_MAX_RATE_LIMITED_MS
  retryMaxOutageMs?: number; // RETRY_MAX_OUTAGE_MS
  deadLetterOpenDays?: number; // DEAD_LETTER_OPEN_DAYS
  retentionDays?: number; // OUTBOX_RETENTION_DAYS
  pruneIntervalMs?: number; // OUTBOX_PRUNE_INTERVAL_MS
  reconcileSchedule?: 'on' | 'off'; // RECONCILE_SCHEDULE
  reconcileIntervalMs?: number; // RECONCILE_INTERVAL_MS
  reconcileLagMs?: number; // RECONCILE_LAG_MS
}

export interface CreateWorkerOptions {
  /**
   * The application's pool (used, never ended, nothing on it changed) or a PostgreSQL URL (then
   * the worker opens its own pool and ends it at shutdown). Either way the worker also opens one
   * connection of its own for LISTEN.
   */
  database: pg.Pool | string;
  temporal?: WorkerTemporalOptions;
  stripe: WorkerStripeOptions;
  /** The Temporal task queue (default billing-outbox); one per deployment of billing-outbox. */
  taskQueue?: string;
  /** The PostgreSQL schema of billing-outbox's tables (default billing_outbox; created by the migration if missing). */
  schema?: string;
  /**
   * Apply pending migrations before running (default true; safe with many workers at once). With
   * false, the worker refuses to start on a schema behind its version, naming what is missing.
   */
  migrate?: boolean;
  /** Drain on the first SIGTERM or SIGINT, as the standalone worker does (default false). */
  handleSignals?: boolean;
  /** Serve GET /health and GET /metrics on this port (0: any free one; host default 127.0.0.1). */
  http?: { port: number; host?: string };
  /**
   * A pino logger (default: none; the worker logs nothing). The Temporal SDK's lines (the
   * activities', from warnings up) go to it too, unless the application installed the SDK's Runtime
   * itself.
   */
  log?: Logger;
  tuning?: WorkerTuning;
  /** A prebuilt workflow bundle (`bundleWorkflowCode`, or `{ codePath }`); default: the one the package ships (from a checkout: bundled at start). */
  workflowBundle?: TemporalWorkerOptions['workflowBundle'];
  /** Temporal Worker options over ours (shutdownGraceTime, …). */
  workerOptions?: Partial<TemporalWorkerOptions>;
  /**
   * One OpenTelemetry trace per event (README: Tracing), on your application's SDK, which must be
   * registered (Temporal's interceptors use the global API): where the workflows' spans go. Without
   * it, no tracing (the worker reads no OTEL_* variable: your environment is yours).
   */
  tracing?: Tracing;
}

// Each option stands for one variable of src/config.ts: the same check, default and range.
const TEMPORAL_VARIABLES = { address: 'TEMPORAL_ADDRESS', namespace: 'TEMPORAL_NAMESPACE', apiKey: 'TEMPORAL_API_KEY', apiKeyFile: 'TEMPORAL_API_KEY_FILE' } as const;
const TLS_VARIABLES = { caFile: 'TEMPORAL_TLS_CA_FILE', certFile: 'TEMPORAL_TLS_CERT_FILE', keyFile: 'TEMPORAL_TLS_KEY_FILE', serverName: 'TEMPORAL_TLS_SERVER_NAME' } as const;
const STRIPE_VARIABLES = {
  apiKey: 'STRIPE_API_KEY',
  apiKeyFile: 'STRIPE_API_KEY_FILE',
  apiBase: 'STRIPE_API_BASE',
  meterApi: 'STRIPE_METER_API',
  meterEventName: 'STRIPE_METER_EVENT_NAME',
  timeoutMs: 'STRIPE_TIMEOUT_MS',
  unansweredHoldMs: 'STRIPE_UNANSWERED_HOLD_MS',
  rateLimitPerSecond: 'STRIPE_RATE_LIMIT_PER_SECOND',
  identifierNamespace: 'STRIPE_IDENTIFIER_NAMESPACE',
} as const satisfies Record<keyof WorkerStripeOptions, string>;
const TUNING_VARIABLES = {
  relayCount: 'RELAY_COUNT',
  relayBatchSize: 'RELAY_BATCH_SIZE',
  relayClaimTimeoutMs: 'RELAY_CLAIM_TIMEOUT_MS',
  relayPollIntervalMs: 'RELAY_POLL_INTERVAL_MS',
  laneMaxInFlight: 'LANE_MAX_IN_FLIGHT',
  maxConcurrentDeliveries: 'WORKER_MAX_CONCURRENT_DELIVERIES',
  startupWaitMs: 'STARTUP_WAIT_MS',
  retryInitialIntervalMs: 'RETRY_INITIAL_INTERVAL_MS',
  retryBackoffCoefficient: 'RETRY_BACKOFF_COEFFICIENT',
  retryMaximumIntervalMs: 'RETRY_MAXIMUM_INTERVAL_MS',
  retryMaximumAttempts: 'RETRY_MAXIMUM_ATTEMPTS',
  retryMaxRateLimitedMs: 'RETRY_MAX_RATE_LIMITED_MS',
  retryMaxOutageMs: 'RETRY_MAX_OUTAGE_MS',
  deadLetterOpenDays: 'DEAD_LETTER_OPEN_DAYS',
  retentionDays: 'OUTBOX_RETENTION_DAYS',
  pruneIntervalMs: 'OUTBOX_PRUNE_INTERVAL_MS',
  reconcileSchedule: 'RECONCILE_SCHEDULE',
  reconcileIntervalMs: 'RECONCILE_INTERVAL_MS',
  reconcileLagMs: 'RECONCILE_LAG_MS',
} as const satisfies Record<keyof WorkerTuning, string>;
/** The Temporal worker options createWorker sets itself, with the option to use instead (if any). */
const WORKER_SETS: Record<string, string> = {
  taskQueue: 'taskQueue',
  namespace: 'temporal.namespace',
  connection: 'temporal.connection',
  activities: '',
  workflowBundle: 'workflowBundle',
  workflowsPath: '',
  sinks: '',
  interceptors: '',
};

const isPlainObject = (v: unknown): v is Record<string, unknown> => v !== null && typeof v === 'object' && !Array.isArray(v);

const TOP_LEVEL: readonly (keyof CreateWorkerOptions)[] = [
  'database', 'temporal', 'stripe', 'taskQueue', 'schema', 'migrate', 'handleSignals', 'http', 'log', 'tuning', 'workflowBundle', 'workerOptions', 'tracing',
];

/**
 * The Config a worker with `options` runs on, built as loadConfig builds it from the environment
 * (the options are fed to it as the variables they stand for), with every problem named by its
 * option. Throws ConfigError.
 */
export function workerConfig(options: CreateWorkerOptions): Config {
  const problems: string[] = [];
  const env: Record<string, string> = {};
  const take = (group: string, given: unknown, variables: Record<string, string>) => {
    if (given === undefined) return;
    if (given === null || typeof given !== 'object' || Array.isArray(given)) return void problems.push(`${group}: must be an object`);
    for (const [key, value] of Object.entries(given)) {
      const variable = variables[key];
      const name = `${group}.${key}`;
      if (variable === undefined) {
        if (!(group === 'temporal' && (key === 'tls' || key === 'connection'))) problems.push(`${name}: is not an option (${Object.keys(variables).join(', ')})`);
        continue;
      }
      put(name, variable, value);
    }
  };
  const put = (name: string, variable: string, value: unknown) => {
    if (value === undefined) return;
    if (typeof value === 'string' || typeof value === 'number' || typeof value === 'boolean') env[variable] = String(value);
    else problems.push(`${name}: must be a string or a number`);
  };

  if (options === null || typeof options !== 'object') throw new ConfigError(['createWorker: takes an options object']);
  for (const key of Object.keys(options)) {
    if (!(TOP_LEVEL as readonly string[]).includes(key)) problems.push(`${key}: is not an option of createWorker (${TOP_LEVEL.join(', ')})`);
  }
  const { database, stripe, taskQueue, schema } = options;
  // Not an object (null included): named below by `take`, and read as none here.
  const temporal = isPlainObject(options.temporal) ? options.temporal : {};
  if (typeof database === 'string') put('database', 'DATABASE_URL', database);
  else if (database === undefined || database === null || typeof (database as pg.Pool).connect !== 'function') {
    problems.push('database: is required: a pg.Pool of the application, or a postgres:// URL');
  }
  if (stripe === undefined) problems.push('stripe: is required ({ apiKey } for Stripe; { apiKey, apiBase } for a Stripe-compatible server)');
  take('stripe', stripe, STRIPE_VARIABLES);
  take('temporal', options.temporal, TEMPORAL_VARIABLES);
  if (temporal.connection !== undefined) {
    for (const key of ['address', 'tls', 'apiKey', 'apiKeyFile'] as const) {
      if (temporal[key] !== undefined) problems.push(`temporal.${key}: is set with temporal.connection (the connection already says how to reach Temporal)`);
    }
  }
  const { tls } = temporal;
  if (typeof tls === 'boolean') put('temporal.tls', 'TEMPORAL_TLS', tls);
  else if (tls !== undefined) {
    // An object, even empty, asks for TLS (the system's CAs when it names no CA).
    put('temporal.tls', 'TEMPORAL_TLS', true);
    take('temporal.tls', tls, TLS_VARIABLES);
  }
  take('tuning', options.tuning, TUNING_VARIABLES);
  put('taskQueue', 'TEMPORAL_TASK_QUEUE', taskQueue);
  // Checked by the configuration, as DATABASE_SCHEMA is.
  put('schema', 'DATABASE_SCHEMA', schema);
  for (const flag of ['migrate', 'handleSignals'] as const) {
    if (options[flag] !== undefined && typeof options[flag] !== 'boolean') problems.push(`${flag}: must be true or false`);
  }
  if (options.http !== undefined && !isPlainObject(options.http)) problems.push('http: must be an object ({ port, host })');
  else if (options.http !== undefined) {
    const { port, host } = options.http;
    if (!Number.isInteger(port) || port < 0 || port > 65_535) problems.push('http.port: must be a whole number from 0 to 65535');
    if (host !== undefined && (typeof host !== 'string' || host.trim() === '')) problems.push('http.host: must be a host name or address');
  }
  // What the worker sets itself: given here, a task queue or namespace would have the SDK's worker
  // poll another queue than its own relays and schedule, every event then pending in silence.
  if (options.workerOptions !== undefined && !isPlainObject(options.workerOptions)) problems.push('workerOptions: must be an object');
  for (const key of Object.keys(isPlainObject(options.workerOptions) ? options.workerOptions : {})) {
    const instead = WORKER_SETS[key];
    if (instead !== undefined) problems.push(`workerOptions.${key}: is set by the worker itself${instead ? `; use the option ${instead}` : ''}`);
  }
  // Stripe itself needs a key, as the worker command says (src/cli/commands/worker.ts). Blank
  // counts as not given, as in the configuration: an empty apiBase is Stripe itself.
  const given = (v: unknown) => typeof v === 'string' && v.trim() !== '';
  if (!given(stripe?.apiKey) && !given(stripe?.apiKeyFile) && (!given(stripe?.apiBase) || isStripeItself(String(stripe?.apiBase)))) {
    problems.push('stripe.apiKey: is required to report usage to Stripe (or give stripe.apiBase, a Stripe-compatible server)');
  }
  // Every problem at once: ours, then loadConfig's in the options' words.
  let config: Config | undefined;
  try {
    config = loadConfig(env);
  } catch (err) {
    if (!(err instanceof ConfigError)) throw err;
    // A key read from a file is the file's option to name (its content is what is wrong).
    const fromFile = new Map<string, string>([
      ...(given(stripe?.apiKeyFile) && !given(stripe?.apiKey) ? [['STRIPE_API_KEY', 'stripe.apiKeyFile'] as const] : []),
      ...(given(temporal.apiKeyFile) && !given(temporal.apiKey) ? [['TEMPORAL_API_KEY', 'temporal.apiKeyFile'] as const] : []),
    ]);
    problems.push(...err.problems.map((p) => p.replace(VARIABLE, (v) => fromFile.get(v) ?? OPTION_OF.get(v) ?? v)));
  }
  if (problems.length > 0 || !config) throw new ConfigError(problems);
  return config;
}

const prefixed = (group: string, variables: Record<string, string>) => Object.entries(variables).map(([key, v]) => [v, `${group}.${key}`] as const);
/** Each variable's option, to say a problem of loadConfig's in the caller's words. */
const OPTION_OF = new Map<string, string>([
  ['DATABASE_URL', 'database'],
  ['TEMPORAL_TASK_QUEUE', 'taskQueue'],
  ['TEMPORAL_TLS', 'temporal.tls'],
  ['DATABASE_SCHEMA', 'schema'],
  ...prefixed('temporal', TEMPORAL_VARIABLES),
  ...prefixed('temporal.tls', TLS_VARIABLES),
  ...prefixed('stripe', STRIPE_VARIABLES),
  ...prefixed('tuning', TUNING_VARIABLES),
]);
// Longest first, so TEMPORAL_TLS_CA_FILE is not read as TEMPORAL_TLS.
const VARIABLE = new RegExp(`\\b(${[...OPTION_OF.keys()].sort((x, y) => y.length - x.length).join('|')})\\b`, 'g');

/**
 * A worker for `options`, connected (and migrated, unless `migrate: false`), ready to `run()`.
 * Refuses bad options with a ConfigError before opening anything.
 */
export async function createWorker(options: CreateWorkerOptions): Promise<WorkerHandle> {
  const config = workerConfig(options);
  // The SDK's runtime, made by default at the first connection, takes SIGINT, SIGTERM, SIGQUIT and
  // SIGUSR2 from the application: the process would no longer end on them, and every worker would
  // drain. Its default logger writes every event's line to standard error. One the application
  // installed is its own; otherwise ours has no signal handlers and logs to `log` (warnings and
  // errors: a refused Stripe key, reconcile's drift), or nowhere. The runtime is the process's: the
  // first worker's `log` is the one it keeps.
  if (Runtime._instance === undefined) {
    Runtime.install({
      shutdownSignals: [],
      logger: sdkLogger(options.log, 'WARN'),
      // The SDK core's own lines (its gRPC retries while Temporal is away) the same way, not to the console.
      telemetryOptions: { logging: { filter: { core: 'WARN', other: 'ERROR' }, forward: {} } },
    });
  }
  return launchWorker(config, {
    ...(typeof options.database === 'string' ? {} : { pool: options.database }),
    ...(options.temporal?.connection ? { connection: options.temporal.connection } : {}),
    migrate: options.migrate ?? true,
    handleSignals: options.handleSignals ?? false,
    ...(options.http ? { http: { host: options.http.host ?? '127.0.0.1', port: options.http.port } } : {}),
    log: options.log,
    workflowBundle: options.workflowBundle,
    workerOptions: options.workerOptions,
    ...(options.tracing ? { tracing: options.tracing } : {}),
  });
}
