/**
 * A billing-outbox worker: the relay workflows, the usage workflows and their activities, on one
 * Temporal task queue. Run as many as you like; they share the work through Temporal and PostgreSQL.
 */
import { Client, WorkflowIdConflictPolicy, WorkflowNotFoundError } from '@temporalio/client';
import { bundleWorkflowCode, DefaultLogger, NativeConnection, Worker, type WorkerOptions } from '@temporalio/worker';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import type pg from 'pg';
import { Registry } from 'prom-client';
import type Stripe from 'stripe';
import { createActivities } from '../../activities/index.js';
import { RELAY_CALLS_PER_RUN, relayWorkflowId, type RelayWorkflowInput } from '../../workflows/shared.js';
import { checkHealth, oneProbeAtATime, temporalHealthConnection, type ProbeResult, type TemporalHealth } from '../api/health.js';
import { ConfigError, type Config } from '../config.js';
import { answeredWithin, createPool, HEARS_NO_ERRORS, hearsNoErrors, isDatabaseUnavailable, migrate, OPENS_WITHOUT_LIMIT, opensWithoutLimit, pendingMigrations, withPgTypes, type Queryable } from '../db.js';
import type { Logger } from '../log.js';
import { waitUnlessAborted } from '../wait.js';
import { createMetrics, startMetricsServer, type Metrics } from '../metrics.js';
import { sweepClosedRuns, type SweepOptions } from '../ops/closed-runs.js';
import { pruneDelivered } from '../ops/prune.js';
import { OutboxNotifier } from '../outbox/notifier.js';
import { postgresUnreachable, temporalUnreachable, untilReachable } from '../reachable.js';
import { createStripeClient } from '../stripe/client.js';
import { connectTemporal, onTlsFilesChanged } from './connection.js';
import { MeterCatalog } from '../stripe/meters.js';
import { SlotPacer } from '../stripe/rate-limit.js';
import { MeterEventStream, stripeStream } from '../stripe/stream.js';
import { shippedWorkflowBundle } from './workflow-bundle.js';
import { ensureReconcileScheduleOrWarn, reconcileScheduleId, restoreReconcileSchedule } from './reconcile-schedule.js';
import { checkSearchAttributes } from './search-attributes.js';
import { schemaFor } from '../outbox/sql/schema.js';
import { recordIdentifierNamespace } from '../outbox/sql/operator.js';
import { startTracingSdk, temporalTracing, workflowTracingModule, type Tracing } from '../tracing.js';

export const WORKFLOWS_PATH = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..', '..', 'workflows', 'index.ts');

export interface WorkerDeps {
  config: Config;
  /** Where the LISTEN connection goes: a URL, or an application pool's settings (`pool.options`). */
  databaseUrl: string | pg.ClientConfig;
  pool: pg.Pool;
  stripe: Stripe;
  connection: NativeConnection;
  client: Client;
  log?: Logger;
  /** A pre-built bundle (tests bundle once); otherwise the workflows are bundled at start-up. */
  workflowBundle?: WorkerOptions['workflowBundle'];
  relayRunForMs?: number;
  /** Where the activities count deliveries and claims (nothing is counted without it). */
  metrics?: Metrics;
  workerOptions?: Partial<WorkerOptions>;
  /** How often the worker checks that the relay workflows run (default RELAY_CHECK_EVERY_MS). */
  relayCheckEveryMs?: number;
  /**
   * Whether that check also creates the reconcile schedule again when it is gone (launchWorker:
   * with RECONCILE_SCHEDULE=on, the schedule it ensured at start).
   */
  keepReconcileSchedule?: boolean;
  /** This schema's deployment id (readDeployment), when already read; otherwise read at start. */
  deployment?: string;
  /** The sweep for dispatched rows whose run has closed (src/ops/closed-runs.ts); defaults below. */
  closedRunSweep?: Partial<ClosedRunSweepOptions>;
  /**
   * Tracing on (src/tracing.ts): Temporal's OpenTelemetry interceptors on the relay's starts,
   * the workflows and the activities, the workflows' spans to this processor. A `workflowBundle`
   * given with it must have been bundled with `workflowTracingModule()`.
   */
  tracing?: Tracing;
}

/** A closed relay is started again within this (its events wait meanwhile; the other relays go on). */
export const RELAY_CHECK_EVERY_MS = 15_000;

export interface ClosedRunSweepOptions extends Omit<SweepOptions, 'afterId'> {
  intervalMs: number;
}

/**
 * A pass a minute, over rows untouched for five minutes (a run being started or reopened is never
 * taken for closed), a hundred runs described at most per pass.
 */
export const CLOSED_RUN_SWEEP: ClosedRunSweepOptions = { intervalMs: 60_000, staleAfterMs: 300_000, batchSize: 100 };

export interface RunningWorker {
  worker: Worker;
  /** Stops claiming, lets in-flight activities finish (or be retried elsewhere), then resolves. */
  shutdown(): Promise<void>;
  /** Resolves when the worker has stopped (rejects if it crashed). */
  done: Promise<void>;
}

export async function startWorker(deps: WorkerDeps): Promise<RunningWorker> {
  const { config, pool, stripe, client } = deps;
  // Without them every usage start would be refused: refused here instead, saying what to create.
  await checkSearchAttributes(deps.connection, config.temporal.namespace, deps.log);
  // Before polling: a task queue another deployment serves is refused before any of its tasks is taken.
  const deployment = deps.deployment ?? (await readDeployment(pool, config.databaseSchema));
  await ensureRelays(client, config, deployment);
  const stopping = new AbortController();
  const schema = schemaFor(config.databaseSchema);
  // The deployment's identifier namespace is this worker's from now on: operator commands stamp with
  // it. Not a reason to stay down (PostgreSQL away or read-only at this moment): said, and gone on.
  await recordIdentifierNamespace(answeredWithin(pool, config.timings.statementAnswerMs), schema, config.stripe.identifierNamespace).then(
    (before) => {
      if (before == null) return;
      deps.log?.warn(
        { before, now: config.stripe.identifierNamespace },
        "STRIPE_IDENTIFIER_NAMESPACE differs from the one this deployment's workers started with before: events not attempted yet go to Stripe under the new one (those attempted keep theirs)",
      );
    },
    (err: unknown) => deps.log?.warn({ err: String(err) }, 'could not record the identifier namespace in the deployment row; operator commands use the one recorded before'),
  );
  const notifier = new OutboxNotifier(deps.databaseUrl, schema.name);
  const relayLog = (msg: string, fields: Record<string, unknown>) => deps.log?.warn(fields, msg);
  // v2: one batcher per worker on the meter event stream, each request in the account-wide pace.
  // Its pace statement is on every v2 delivery's path: one unanswered (a silent connection) would
  // hold the batcher's requests, so it gets the deliveries' answer time.
  const requestPace = new SlotPacer(answeredWithin(pool, config.timings.statementAnswerMs), schema, { bucket: 'stripe_calls', perSecond: config.stripe.rateLimitPerSecond, maxWaitMs: config.timings.maxPacingWaitMs });
  const stream =
    config.stripe.meterApi === 'v2'
      ? new MeterEventStream(stripeStream(stripe, (token) => createStripeClient(config.stripe, { sessionToken: token })), {
          pace: () => requestPace.waitForSlot(),
          metrics: deps.metrics,
          log: deps.log,
        })
      : undefined;
  const traced = deps.tracing ? await temporalTracing(deps.tracing) : undefined;
  const activities = createActivities({
    db: pool,
    stripe,
    stream,
    meters: new MeterCatalog(stripe),
    // The relays start usage workflows on the worker's own connection, so that eager start can
    // give the first workflow task to this worker directly.
    client: new Client({ connection: deps.connection, namespace: config.temporal.namespace, ...(traced ? { interceptors: { workflow: traced.client } } : {}) }),
    notifier,
    config,
    stopping: stopping.signal,
    log: relayLog,
    runForMs: deps.relayRunForMs,
    metrics: deps.metrics,
    traced: traced !== undefined,
  });
  const worker = await Worker.create({
    connection: deps.connection,
    namespace: config.temporal.namespace,
    taskQueue: config.temporal.taskQueue,
    activities,
    workflowBundle: deps.workflowBundle ?? shippedWorkflowBundle({ tracing: traced !== undefined }) ?? (await bundleWorkflows(deps.log, traced !== undefined)),
    // The workflows' interceptors are in the bundle (workflowTracingModule); their spans leave the
    // sandbox through the `exporter` sink.
    ...(traced ? { interceptors: { activity: traced.activity }, sinks: traced.sinks } : {}),
    // A delivery's first attempt is a local activity that keeps its workflow task (and slot) for
    // as long as it waits for its lease (a second at most; longer waits are the regular
    // activity's) and calls Stripe: the slots bound concurrent deliveries. Their later tries, and
    // the relays' claims, are regular activities, each try holding a slot while it waits for its
    // lease (up to 10 s): the SDK's default of 100 would let the waiters of one customer shared by
    // many tenants (4 per tenant in flight, one call at a time) take every slot, and the relays
    // and every other tenant's retries wait for one.
    maxConcurrentWorkflowTaskExecutions: config.worker.maxConcurrentDeliveries,
    maxConcurrentLocalActivityExecutions: config.worker.maxConcurrentDeliveries,
    maxConcurrentActivityTaskExecutions: config.worker.maxConcurrentDeliveries,
    shutdownGraceTime: '20 seconds',
    ...deps.workerOptions,
  });
  // Maintenance unanswered for minutes is on a silent connection: it fails, is logged, and its
  // loop goes on instead of waiting for good.
  const maintenanceDb = answeredWithin(pool, config.timings.maintenanceAnswerMs);
  const pruner = startPruner(deps, maintenanceDb, stopping.signal);
  const sweeper = startClosedRunSweep(deps, maintenanceDb, stopping.signal);
  const relayKeeper = keepRelaysRunning(deps, deployment, deps.relayCheckEveryMs ?? RELAY_CHECK_EVERY_MS, stopping.signal);
  const done = worker.run().finally(async () => {
    // However the worker ended (shutdown or a crash), the pruner's, the sweep's and the relays'
    // keeper's loops end with it.
    stopping.abort();
    await Promise.all([notifier.close(), pruner, sweeper, relayKeeper]);
  });
  // Whoever waits on it hears how it ended; a crash while nobody waits yet (the relays being
  // started, the reconcile schedule ensured, an old worker draining after a reconnect) must not
  // also be an unhandled rejection, which ends the process, the application's in library mode.
  done.catch(() => undefined);
  deps.log?.info(
    { taskQueue: config.temporal.taskQueue, relays: config.relay.count, stripeCallsPerSecond: config.stripe.rateLimitPerSecond },
    'worker started',
  );
  return {
    worker,
    done,
    async shutdown() {
      stopping.abort();
      if (worker.getState() === 'RUNNING') worker.shutdown();
      await done;
    },
  };
}

/**
 * Bundles the workflows for the sandbox, as Worker.create would from `workflowsPath`, but with the
 * bundler's INFO lines at debug: they are webpack's whole output, a kilobyte and a half of module
 * list on every start. Its warnings and errors stay warnings and errors (a failed bundle throws).
 */
async function bundleWorkflows(log: Logger | undefined, tracing: boolean): Promise<{ code: string }> {
  const logger = new DefaultLogger('TRACE', ({ level, message, meta }) => {
    const fields = { ...meta, sdk: 'temporal' };
    if (level === 'ERROR') log?.error(fields, message);
    else if (level === 'WARN') log?.warn(fields, message);
    else log?.debug(fields, message);
  });
  const { code } = await bundleWorkflowCode({ workflowsPath: WORKFLOWS_PATH, logger, ...(tracing ? { workflowInterceptorModules: [workflowTracingModule()] } : {}) });
  return { code };
}

/**
 * Retention: every OUTBOX_PRUNE_INTERVAL_MS (first one a minute after start), delivered rows past
 * OUTBOX_RETENTION_DAYS are pruned in batches (src/ops/prune.ts). A failure is logged and tried
 * again next time; the loop ends with the worker.
 */
async function startPruner(deps: WorkerDeps, db: Queryable, signal: AbortSignal): Promise<void> {
  const { config, metrics, log } = deps;
  // Its listener leaves the worker's signal with the pause: one left per pass (as before) grew
  // without bound over a worker's life.
  const wait = (ms: number) => waitUnlessAborted(ms, signal);
  await wait(Math.min(60_000, config.retention.intervalMs));
  while (!signal.aborted) {
    try {
      const pruned = await pruneDelivered(db, schemaFor(config.databaseSchema), { olderThanMs: config.retention.olderThanMs, signal, onBatch: (n) => metrics?.prunedRows.inc(n) });
      if (pruned > 0) log?.info({ pruned, olderThanDays: config.retention.olderThanMs / 86_400_000 }, 'pruned delivered outbox rows');
    } catch (err) {
      log?.warn({ err: String(err) }, 'pruning delivered outbox rows failed; trying again later');
    }
    await wait(config.retention.intervalMs);
  }
}

/**
 * The closed-run sweep: every interval, one bounded pass over dispatched rows whose run may have
 * closed without them (src/ops/closed-runs.ts). A pass that went through a whole batch and found
 * closed runs goes on at once with the next rows: orphaned rows by the thousand (Temporal's state
 * lost) hold their lanes until swept, and a hundred a minute took hours. A failure is logged and
 * tried again next time.
 */
async function startClosedRunSweep(deps: WorkerDeps, db: Queryable, signal: AbortSignal): Promise<void> {
  const opts = { ...CLOSED_RUN_SWEEP, ...deps.closedRunSweep };
  const log = (msg: string, fields: Record<string, unknown>) => deps.log?.warn(fields, msg);
  let afterId = 0;
  let goOn = false;
  while (!signal.aborted) {
    if (!goOn) await waitUnlessAborted(opts.intervalMs, signal);
    if (signal.aborted) return;
    goOn = false;
    try {
      const pass = await sweepClosedRuns(
        { db, schema: schemaFor(deps.config.databaseSchema), client: deps.client, taskQueue: deps.config.temporal.taskQueue, identifierNamespace: deps.config.stripe.identifierNamespace, metrics: deps.metrics, log },
        { ...opts, afterId, signal },
      );
      afterId = pass.nextAfterId;
      // A whole batch checked means rows may follow (nextAfterId is then the batch's last id).
      goOn = pass.checked === opts.batchSize && pass.closed + pass.deadLetters > 0;
    } catch (err) {
      deps.log?.warn({ err: String(err) }, 'sweeping dispatched rows for closed runs failed; trying again later');
    }
  }
}

/** The relay workflows' memo field naming the deployment (its schema's `deployment` row) that started them. */
export const RELAY_DEPLOYMENT_MEMO = 'billingOutboxDeployment';

/** This schema's deployment id (migrations/001_schema.sql), put on the relays it starts. */
export async function readDeployment(db: Queryable, schemaName: string): Promise<string> {
  const schema = schemaFor(schemaName);
  // The pause column too: the claim reads it, and a schema without it would fail every claim; and
  // the identifier namespace, recorded at every start.
  const { rows } = await db.query<{ id: string }>(`SELECT id, relays_paused_at, identifier_namespace FROM ${schema.deployment}`).catch(async (err: unknown) => {
    // 42P01: no such table; 42703: no such column. Never migrated, or made by an unreleased build's
    // 001_schema.sql, which lacked it.
    const code = (err as { code?: unknown }).code;
    if (code !== '42P01' && code !== '42703') throw err;
    const migrated = (await db.query<{ ok: boolean }>('SELECT to_regclass($1::text) IS NOT NULL AS ok', [schema.outbox])).rows[0]?.ok;
    throw new ConfigError([
      migrated
        ? `database schema ${schemaName}: made by an earlier build of billing-outbox's 001_schema.sql (its deployment table is missing or older): drop the schema (or delete .data/ for npm start's stack) and migrate again`
        : `database schema ${schemaName}: not migrated; run \`billing-outbox migrate\` (or migrate(url, { schema })) first, or let the worker migrate (migrate: true)`,
    ]);
  });
  if (!rows[0]) throw new ConfigError([`database schema ${schemaName}: its deployment row is missing; it is written once, when the schema is migrated: restore it from a backup or migrate a fresh schema`]);
  return rows[0].id;
}

/**
 * Starts the relay workflows unless they are already running, and refuses a task queue whose relays
 * another deployment started. Every worker calls this at boot, before it polls (then keepRelaysRunning).
 */
export async function ensureRelays(client: Client, config: Config, deployment: string): Promise<void> {
  const indexes = Array.from({ length: config.relay.count }, (_, i) => i);
  // Every relay looked at before any is started: a deployment refused here starts none (run by the
  // other deployment's workers, they would hold the queue against it later).
  for (const i of indexes) {
    const workflowId = relayWorkflowId(config.temporal.taskQueue, i);
    const relay = await relayState(client, workflowId);
    if (isOpen(relay.status) && relay.owner !== deployment) throw anotherDeployment(config, workflowId, relay.owner, deployment);
  }
  await Promise.all(
    indexes.map(async (i) => {
      // Started by another deployment since the look (both starting at once): the start answers
      // with that run, whose memo says whose it is.
      const handle = await startRelay(client, config, i, deployment);
      const owner = (await handle.describe()).memo?.[RELAY_DEPLOYMENT_MEMO];
      if (owner !== deployment) throw anotherDeployment(config, handle.workflowId, owner, deployment);
    }),
  );
}

/** The relay's latest run: its status (NOT_FOUND: none) and the deployment its memo names. */
async function relayState(client: Client, workflowId: string): Promise<{ status: string; owner: unknown }> {
  try {
    const described = await client.workflow.getHandle(workflowId).describe();
    return { status: described.status.name, owner: described.memo?.[RELAY_DEPLOYMENT_MEMO] };
  } catch (err) {
    if (err instanceof WorkflowNotFoundError) return { status: 'NOT_FOUND', owner: undefined };
    throw err;
  }
}

/** Running, or paused by an operator: a run that holds its relay's place. */
const isOpen = (status: string) => status === 'RUNNING' || status === 'PAUSED';

/**
 * Two deployments (two databases, or two schemas) on one namespace and task queue would each poll
 * the other's tasks: a usage run executed against a database without its row, a relay claiming
 * from whichever database its worker has.
 */
function anotherDeployment(config: Config, workflowId: string, owner: unknown, deployment: string): ConfigError {
  const { taskQueue, namespace } = config.temporal;
  return new ConfigError([
    `TEMPORAL_TASK_QUEUE ${JSON.stringify(taskQueue)} in the namespace ${JSON.stringify(namespace)} is another billing-outbox deployment's: ` +
      `its relay ${workflowId} was started for the deployment ${typeof owner === 'string' ? owner : '(none named)'}, and this database schema (${config.databaseSchema}) is ${deployment}. ` +
      'Deployments sharing a task queue would run each other\'s events against the wrong database: give each its own TEMPORAL_NAMESPACE (or TEMPORAL_TASK_QUEUE). ' +
      `If that deployment is gone (its database recreated), terminate its relays (\`temporal workflow terminate --workflow-id ${workflowId}\`, one per relay) and start again`,
  ]);
}

function startRelay(client: Client, config: Config, index: number, deployment: string) {
  return client.workflow.start('relayWorkflow', {
    workflowId: relayWorkflowId(config.temporal.taskQueue, index),
    taskQueue: config.temporal.taskQueue,
    args: [{ relayId: `relay-${index}`, callsPerRun: RELAY_CALLS_PER_RUN } satisfies RelayWorkflowInput],
    memo: { [RELAY_DEPLOYMENT_MEMO]: deployment },
    workflowIdConflictPolicy: WorkflowIdConflictPolicy.USE_EXISTING,
  });
}

/**
 * Starts again every relay workflow that has closed (terminated or cancelled by an operator, a
 * Temporal server that lost its state) and returns what each of those was, and which are open but
 * paused by an operator (nothing to start: the run is there, and claims nothing until unpaused).
 */
export async function restartClosedRelays(
  client: Client,
  config: Config,
  deployment: string,
  signal?: AbortSignal,
): Promise<{ restarted: { workflowId: string; was: string }[]; paused: string[]; foreign: { workflowId: string; owner: unknown }[] }> {
  const restarted: { workflowId: string; was: string }[] = [];
  const paused: string[] = [];
  const foreign: { workflowId: string; owner: unknown }[] = [];
  for (let i = 0; i < config.relay.count && !signal?.aborted; i++) {
    const workflowId = relayWorkflowId(config.temporal.taskQueue, i);
    const relay = await relayState(client, workflowId);
    if (isOpen(relay.status)) {
      // Started by another deployment while this one's was closed: said, never taken over.
      if (relay.owner !== deployment) foreign.push({ workflowId, owner: relay.owner });
      if (relay.status === 'PAUSED') paused.push(workflowId);
      continue;
    }
    await startRelay(client, config, i, deployment);
    restarted.push({ workflowId, was: relay.status });
  }
  return { restarted, paused, foreign };
}

/**
 * The relays kept running: every `everyMs` each worker looks at them and starts again any that has
 * closed, saying so. Without it, the events committed after the last relay closed waited, pending,
 * until a worker restarted. With `keepReconcileSchedule`, the reconcile schedule likewise: one
 * deleted stopped reconciliation, unsaid, until a worker restarted.
 */
async function keepRelaysRunning(deps: WorkerDeps, deployment: string, everyMs: number, signal: AbortSignal): Promise<void> {
  // Said once a pause, not at every look.
  let pausedBefore = new Set<string>();
  while (!signal.aborted) {
    await waitUnlessAborted(everyMs, signal);
    if (signal.aborted) return;
    try {
      const { restarted, paused, foreign } = await restartClosedRelays(deps.client, deps.config, deployment, signal);
      for (const { workflowId, was } of restarted) deps.log?.warn({ workflowId, was }, 'a relay workflow was not running; started it again');
      for (const { workflowId, owner } of foreign) {
        deps.log?.error(
          { workflowId, deployment: owner, ours: deployment, taskQueue: deps.config.temporal.taskQueue },
          "a relay workflow of this task queue is another deployment's: two deployments share it and run each other's events; give each its own TEMPORAL_NAMESPACE (or TEMPORAL_TASK_QUEUE)",
        );
      }
      for (const workflowId of paused) {
        if (!pausedBefore.has(workflowId)) deps.log?.warn({ workflowId }, 'a relay workflow is paused (by an operator, in Temporal): it claims nothing until it is unpaused');
      }
      pausedBefore = new Set(paused);
    } catch (err) {
      deps.log?.warn({ err: String(err) }, 'checking the relay workflows failed; trying again later');
    }
    if (!deps.keepReconcileSchedule) continue;
    try {
      if (await restoreReconcileSchedule(deps.client, deps.config)) {
        deps.log?.warn({ scheduleId: reconcileScheduleId(deps.config.temporal.taskQueue) }, 'the reconcile schedule was gone; created it again');
      }
    } catch (err) {
      deps.log?.warn({ err: String(err) }, 'checking the reconcile schedule failed; trying again later');
    }
  }
}


/** What a worker's GET /health (and `health()`) says: `ok` only while it runs and reaches PostgreSQL. */
export interface WorkerHealth {
  status: 'ok' | 'unavailable';
  /** starting: not yet `run()`; stopping: shutdown under way (in-flight activities draining). */
  worker: 'starting' | 'running' | 'stopping' | 'stopped' | 'failed';
  postgres: ProbeResult;
  /**
   * Whether Temporal answers, for whoever looks: not part of `status`. A running worker rides out
   * Temporal's outages (its polls and starts are tried again), and a probe that restarts unhealthy
   * processes would only replace waiting workers with starting ones.
   */
  temporal: ProbeResult;
  taskQueue: string;
}

/** A worker ready to run: see createWorker (src/worker.ts), the standalone worker (src/bin/worker.ts). */
export interface WorkerHandle {
  /**
   * Runs the relays and the usage workflows until `shutdown()` (or a signal, with
   * `handleSignals`); resolves once everything the worker owns is closed, rejects if it crashed.
   */
  run(): Promise<void>;
  /** Stops claiming, lets in-flight activities finish (up to the grace time), then closes what it owns. */
  shutdown(): Promise<void>;
  health(): Promise<WorkerHealth>;
  readonly taskQueue: string;
  /** The HTTP server's base URL (GET /health, GET /metrics), when one was asked for. */
  readonly url: string | undefined;
}

export interface LaunchOptions {
  /** The application's pool (used through `withPgTypes`, never ended); without it one of ours on `config.databaseUrl`. */
  pool?: pg.Pool;
  /** A connection of the application's (never closed); without it ours, from `config.temporal`. */
  connection?: NativeConnection;
  /** Apply pending migrations before running (safe with many workers at once). */
  migrate: boolean;
  /** Drain on the first SIGTERM or SIGINT; the handlers are removed when the worker stops. */
  handleSignals: boolean;
  /** GET /health and GET /metrics on this address. */
  http?: { host: string; port: number };
  log?: Logger;
  /** The process's metrics, made once the pool exists (its outbox gauges read it); default: ours, with `http`. */
  metrics?: (db: Queryable) => Metrics;
  workflowBundle?: WorkerOptions['workflowBundle'];
  workerOptions?: Partial<WorkerOptions>;
  /** Called once the worker runs (polling its task queue, relays started). */
  onRunning?: () => void;
  /** How long a health probe waits for PostgreSQL (default 2 s). */
  healthTimeoutMs?: number;
  /**
   * Tracing with the application's own OpenTelemetry SDK (registered by the application). Without
   * it, `config.tracing.otlpEndpoint` set starts ours (src/tracing.ts), stopped with the worker.
   */
  tracing?: Tracing;
}

/**
 * A worker told not to migrate (the application migrates in its own pipeline) refuses to start on a
 * schema behind its version, naming what is missing: its statements name every migration's columns,
 * and on an older schema each delivery would fail until its event was dead. PostgreSQL not reachable
 * yet: not checked here (run() waits for it, up to STARTUP_WAIT_MS, to read the schema's deployment).
 */
async function refuseUnmigrated(pool: Queryable, schema: string, answerMs: number): Promise<void> {
  let missing: string[];
  try {
    missing = await pendingMigrations(answeredWithin(pool, answerMs), { schema });
  } catch (err) {
    if (isDatabaseUnavailable(err)) return;
    throw err;
  }
  if (missing.length > 0) {
    throw new ConfigError([
      `database schema ${schema}: not migrated to this version of billing-outbox (missing ${missing.join(', ')}); run \`billing-outbox migrate\` (or migrate(url, { schema })) first, or let the worker migrate (migrate: true)`,
    ]);
  }
}

/**
 * Opens what a worker needs (pool, Temporal connection, Stripe client, HTTP server), migrating
 * first if asked, and returns it ready to run. Whatever it opened is closed again if a later step
 * fails, and when the worker stops; what the caller gave is never closed.
 */
export async function launchWorker(config: Config, opts: LaunchOptions): Promise<WorkerHandle> {
  const { log } = opts;
  const closers: (() => Promise<unknown>)[] = [];
  const closeOwned = async () => {
    for (const close of closers.splice(0).reverse()) await close().catch((err: unknown) => log?.warn({ err: String(err) }, 'closing a worker resource failed'));
  };
  let state: WorkerHealth['worker'] = 'starting';
  let stopRequested = false;
  // Aborted by shutdown(): a start still waiting for Temporal to come back gives up at once.
  const stopping = new AbortController();
  let starting: Promise<RunningWorker> | undefined;
  let running: RunningWorker | undefined;
  let reconnecting: Promise<void> | undefined;
  let runPromise: Promise<void> | undefined;
  let removeSignals: (() => void) | undefined;
  try {
    let tracing = opts.tracing;
    if (!tracing) {
      const sdk = await startTracingSdk(config.tracing);
      // First in, last out: spans of the closing steps are still exported.
      if (sdk) closers.push(() => sdk.shutdown());
      tracing = sdk?.tracing;
    }
    let pool: pg.Pool;
    let listenWith: string | pg.ClientConfig;
    if (opts.pool) {
      pool = withPgTypes(opts.pool, { waitMs: config.timings.statementAnswerMs });
      listenWith = opts.pool.options;
      if (opensWithoutLimit(opts.pool)) log?.warn(OPENS_WITHOUT_LIMIT);
      if (hearsNoErrors(opts.pool)) log?.warn(HEARS_NO_ERRORS);
    } else {
      if (!config.databaseUrl) throw new ConfigError(['database: neither a pool nor a PostgreSQL URL was given']);
      // A delivery waits for a connection no longer than for a statement's answer: past that the
      // database is too busy, and the delivery waits its turn again without spending an attempt.
      const own = createPool(config.databaseUrl, 10, { waitMs: config.timings.statementAnswerMs });
      closers.push(() => own.end());
      pool = own;
      listenWith = config.databaseUrl;
    }
    // PostgreSQL or Temporal restarting as the worker starts: waited for (src/reachable.ts).
    const reach = { waitMs: config.startupWaitMs, signal: stopping.signal, ...(log ? { log } : {}) };
    if (opts.migrate) await untilReachable('PostgreSQL', () => migrate(listenWith, { schema: config.databaseSchema, ...(log ? { onWait: (message: string) => log.warn(message) } : {}) }), { ...reach, unreachable: postgresUnreachable });
    else await refuseUnmigrated(pool, config.databaseSchema, config.timings.statementAnswerMs);
    let temporal: { connection: NativeConnection; client: Client; tlsFiles?: string | undefined; close?: () => Promise<void> };
    const connectOnce = () => connectTemporal(config.temporal, { tracing: tracing !== undefined, ...(log ? { log } : {}) });
    const connect = async () => {
      temporal = await untilReachable('Temporal', connectOnce, { ...reach, unreachable: temporalUnreachable });
    };
    if (opts.connection) {
      temporal = { connection: opts.connection, client: new Client({ connection: opts.connection, namespace: config.temporal.namespace }) };
    } else {
      await connect();
      closers.push(() => temporal.close!());
    }
    const stripe = createStripeClient(config.stripe, { log });
    // The scrape's counts are maintenance too: never waited on for good.
    const countsDb = answeredWithin(pool, config.timings.maintenanceAnswerMs);
    const metrics = opts.metrics?.(countsDb) ?? (opts.http ? createMetrics(new Registry(), { db: countsDb, schema: schemaFor(config.databaseSchema) }) : undefined);
    // Lazy: it connects on the first probe. On the application's own connection, that one is asked
    // (the configuration then names no Temporal: a connection of ours would probe localhost:7233).
    const own = opts.connection;
    let healthConnection: TemporalHealth;
    if (own) healthConnection = { namespace: config.temporal.namespace, workflowService: own.workflowService, withDeadline: (deadline, fn) => own.withDeadline(deadline, fn) };
    else {
      const ours = temporalHealthConnection(config.temporal);
      closers.push(() => ours.close());
      healthConnection = ours;
    }
    // Its /health is unauthenticated, on the pool deliveries and claims use: one probe at a time.
    const probe = oneProbeAtATime(() => checkHealth({ db: pool, temporal: healthConnection, log: log ?? { warn: () => undefined } }, opts.healthTimeoutMs ?? 2_000));
    const handle: WorkerHandle = {
      taskQueue: config.temporal.taskQueue,
      url: undefined,
      async health() {
        const probed = await probe();
        const { postgres } = probed;
        const temporal = probed.temporal === 'not_configured' ? 'error' : probed.temporal;
        return { status: state === 'running' && postgres === 'ok' ? 'ok' : 'unavailable', worker: state, postgres, temporal, taskQueue: config.temporal.taskQueue };
      },
      run() {
        runPromise ??= (async () => {
          if (state !== 'starting') throw new Error(`the worker cannot run: it is ${state}`);
          try {
            // PostgreSQL away as it runs (not migrated here): waited for like Temporal below.
            const deployment = await untilReachable('PostgreSQL', () => readDeployment(answeredWithin(pool, config.timings.statementAnswerMs), config.databaseSchema), { ...reach, unreachable: postgresUnreachable });
            const start = (on = temporal) =>
              startWorker({
                config,
                databaseUrl: listenWith,
                pool,
                stripe,
                connection: on.connection,
                client: on.client,
                log,
                metrics,
                workflowBundle: opts.workflowBundle,
                workerOptions: opts.workerOptions,
                tracing,
                keepReconcileSchedule: config.reconcile.schedule,
                deployment,
              });
            // Temporal going away after the connection was made and before the worker polls
            // (the relays are looked at and started, then Worker.create asks about the namespace) fails the
            // start. The SDK keeps a failed Worker.create's registration on its connection, so
            // with a connection of our own the start is tried again on a new one, waited for
            // like the first (STARTUP_WAIT_MS); the application's connection is its to mend.
            let tries = 0;
            starting = opts.connection
              ? start()
              : untilReachable(
                  'Temporal',
                  async () => {
                    if (tries++ > 0) {
                      await temporal.close!();
                      await connect();
                    }
                    return start();
                  },
                  { ...reach, unreachable: temporalUnreachable },
                );
            running = await starting;
            if (config.reconcile.schedule) await ensureReconcileScheduleOrWarn(temporal.client, config, log);
            if (opts.handleSignals) {
              removeSignals = onFirstSignal((signal) => {
                log?.info({ signal }, 'shutting down: finishing in-flight activities');
                // How the worker ended is reported by run(), which awaits it.
                handle.shutdown().catch(() => undefined);
              }, log);
            }
            // A shutdown asked for while the worker was starting stops it now.
            if (stopRequested) running.shutdown().catch(() => undefined);
            else {
              state = 'running';
              opts.onRunning?.();
            }
            /**
             * Renewed TLS files (a client certificate renewed before it expires) are taken up by
             * connecting again: a connection reads them only when it is made. A worker is started
             * on the new connection, then the old one is drained and its connection closed; the
             * task queue is polled throughout. A failure leaves the worker in use as it was, and
             * the watcher tries again at its next check.
             */
            const reconnect = async (): Promise<void> => {
              if (stopRequested || state !== 'running') return;
              log?.info('Temporal TLS files changed: connecting again with them');
              const old = { worker: running!, temporal };
              let fresh: Awaited<ReturnType<typeof connectOnce>> | undefined;
              let next: RunningWorker;
              try {
                fresh = await connectOnce();
                next = await start(fresh);
              } catch (err) {
                await fresh?.close();
                log?.error({ err: err instanceof Error ? err.message : String(err) }, 'Temporal TLS files changed, but connecting with them failed: the worker goes on with the connection it has, and tries again in 10 s');
                throw err;
              }
              if (stopRequested || state !== 'running') {
                await next.shutdown().catch(() => undefined);
                await fresh.close();
                return;
              }
              temporal = fresh;
              running = next;
              await old.worker.shutdown().catch((err: unknown) => log?.warn({ err: String(err) }, 'the worker on the old Temporal connection did not drain in time'));
              await old.temporal.close!();
              log?.info('Temporal: the worker runs on a connection made with the new TLS files');
            };
            const stopWatching = opts.connection ? () => undefined : onTlsFilesChanged(config.temporal, () => (reconnecting = reconnect()), undefined, temporal.tlsFiles);
            try {
              // The run lasts as long as the worker in use: one replaced by a reconnect ends
              // (drained) while its successor runs on.
              for (;;) {
                const current: RunningWorker = running!;
                await current.done.catch((err: unknown) => {
                  if (current === running) throw err;
                });
                if (current === running) break;
              }
            } finally {
              stopWatching();
            }
            state = 'stopped';
          } catch (err) {
            // A start given up because a stop was asked for (Temporal away meanwhile): stopped, as asked.
            if (stopRequested && running === undefined) {
              state = 'stopped';
              return;
            }
            state = 'failed';
            throw err;
          } finally {
            removeSignals?.();
            await closeOwned();
          }
        })();
        return runPromise;
      },
      async shutdown() {
        stopRequested = true;
        stopping.abort();
        if (!runPromise) {
          if (state === 'starting') state = 'stopped';
          return closeOwned();
        }
        if (state === 'running') state = 'stopping';
        await starting?.catch(() => undefined);
        // A reconnect under way finishes first: the worker to stop is then the one in use.
        await reconnecting?.catch(() => undefined);
        await running?.shutdown().catch(() => undefined);
        await runPromise.catch(() => undefined);
      },
    };
    if (opts.http) {
      const server = await startMetricsServer(metrics!, {
        ...opts.http,
        health: async () => {
          const body = await handle.health();
          return { ok: body.status === 'ok', body: { ...body } };
        },
      });
      closers.push(() => server.close());
      (handle as { url: string | undefined }).url = server.url.replace(/\/metrics$/, '');
    }
    return handle;
  } catch (err) {
    await closeOwned();
    throw err;
  }
}

/**
 * Calls `fn` on the first SIGTERM or SIGINT; later ones are ignored while the drain runs (Ctrl-C
 * reaches a process twice through npm or tsx). Returns a function that removes the handlers, so a
 * library worker leaves `process` as it found it.
 */
function onFirstSignal(fn: (signal: NodeJS.Signals) => void, log?: Logger): () => void {
  let firstAt: number | undefined;
  const on = (signal: NodeJS.Signals) => {
    // One Ctrl-C arrives twice (within a second); a later signal is the operator asking again:
    // told how to end it now (in-flight activities are then retried elsewhere, as after a crash).
    if (firstAt !== undefined) {
      if (Date.now() - firstAt > 1_000) log?.warn({ signal, pid: process.pid }, 'still draining in-flight activities; SIGKILL ends the worker at once');
      return;
    }
    firstAt = Date.now();
    fn(signal);
  };
  process.on('SIGTERM', on);
  process.on('SIGINT', on);
  return () => {
    process.off('SIGTERM', on);
    process.off('SIGINT', on);
  };
}

export { connectTemporal } from './connection.js';
