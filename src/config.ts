/**
 * Configuration, read once from the environment and validated at start-up.
 *
 * Every variable is documented in `.env.example`. A bad value stops the process with one line per
 * offending variable; secret values (the Stripe key, database passwords) are never echoed back.
 */
import { existsSync, readFileSync } from 'node:fs';
import { z } from 'zod';
import type { RetryPolicy } from '../workflows/shared.js';
import { DEFAULT_LIVE_RATE, DEFAULT_TEST_RATE, SAFE_RESEND_WINDOW_MS, SECRET_KEY_PATTERN, WEBHOOK_SECRET_PATTERN } from './stripe/rules.js';
import { DEFAULT_SCHEMA, schemaNameProblem } from './outbox/sql/schema.js';
import { MAX_EVENT_NAME_LENGTH, tenantProblem, textProblem } from './outbox/validate.js';

const STRIPE_DEFAULT_BASE = 'https://api.stripe.com';

/** Whether `base` is Stripe itself, however its URL is written (a trailing slash, :443, capitals). */
export function isStripeItself(base: string): boolean {
  return URL.parse(base.trim())?.origin === STRIPE_DEFAULT_BASE;
}

/**
 * What Kubernetes puts in every pod of a namespace for each Service in it (a service link): a
 * Service named `api` sets API_PORT=tcp://10.96.0.12:8080 in the worker's pod too. Not a setting of
 * ours: a port variable holding one is taken as unset.
 */
const SERVICE_LINK = /^(tcp|udp|sctp):\/\/[^\s/]+:\d+$/;

/** A positive integer read from a string, with an inclusive range. */
function int(min: number, max: number) {
  return z
    .string()
    .trim()
    .regex(/^\d+$/, `must be a whole number between ${min} and ${max}`)
    .transform(Number)
    .pipe(z.number().int().min(min, `must be at least ${min}`).max(max, `must be at most ${max}`));
}

function decimal(min: number, max: number) {
  return z
    .string()
    .trim()
    .regex(/^\d+(\.\d+)?$/, `must be a number between ${min} and ${max}`)
    .transform(Number)
    .pipe(z.number().min(min, `must be at least ${min}`).max(max, `must be at most ${max}`));
}

const nonEmpty = (what: string) => z.string().trim().min(1, `must not be empty (${what})`);

/** Scopes a bearer token can carry; each route requires one. */
export const API_SCOPES = ['usage:write', 'metrics:read'] as const;
export type ApiScope = (typeof API_SCOPES)[number];

const apiToken = z.object({
  name: z.string().min(1, 'each token needs a name (used in logs instead of the token)'),
  token: z
    .string()
    .min(24, 'each token must be at least 24 characters')
    // What an Authorization header can carry as one word: a space or a character past ASCII in
    // it could never match, and every request with it would be refused (401).
    .regex(/^[\x21-\x7e]+$/, 'each token must be visible ASCII characters only (no spaces)'),
  /** Tenants this token may record usage for; ["*"] for all. */
  tenants: z.array(z.string().min(1)).min(1, 'each token needs tenants (["*"] for all)'),
  scopes: z.array(z.enum(API_SCOPES)).min(1, `each token needs scopes (${API_SCOPES.join(', ')})`),
});
export type ApiToken = z.infer<typeof apiToken>;

/** NODE_ENV values that mean production (its refusals of unsafe settings apply), and those that do not. */
export const PRODUCTION_ENVS = ['production', 'prod', 'staging'] as const;
const OTHER_ENVS = ['development', 'dev', 'local', 'test'] as const;

/** The longest STRIPE_TIMEOUT_MS: what a run's attempt timeout leaves room for (DeliveryTimings.attemptTimeoutMs). */
const LONGEST_STRIPE_TIMEOUT_MS = 120_000;

/** RETRY_MAX_OUTAGE_MS's default: 6 h of an outage waited out, from an event's first attempt. */
const MAX_OUTAGE_MS = 21_600_000;

/**
 * The longest RETRY_MAX_OUTAGE_MS and RETRY_MAX_RATE_LIMITED_MS: 20 h, under the 23 h resend window
 * (SAFE_RESEND_WINDOW_MS), so an event that waited out a long outage still has hours to be retried
 * in rather than die of the window itself (`identifier_window_expired`, which asks an operator to
 * reconcile) instead of its own error.
 */
const LONGEST_RETRY_MS = 72_000_000;

/**
 * How long an event's failed attempts can take at most, end to end: each attempt's timeout, and
 * the retry policy's waits between them (the first attempt, in the workflow task, is followed by
 * the initial interval, then the regular activity's backoff starts again from it).
 */
export function longestAttemptsMs(retry: Pick<RetryPolicy, 'initialIntervalMs' | 'backoffCoefficient' | 'maximumIntervalMs' | 'maximumAttempts'>, attemptMs: number): number {
  let total = retry.maximumAttempts * attemptMs;
  if (retry.maximumAttempts > 1) total += retry.initialIntervalMs;
  let wait = retry.initialIntervalMs;
  for (let i = 2; i < retry.maximumAttempts; i++) {
    total += Math.min(wait, retry.maximumIntervalMs);
    wait *= retry.backoffCoefficient;
  }
  return total;
}

const schema = z.object({
  // An application's own spellings are taken (`staging` is production, `dev` is not); any other
  // value is refused rather than guessed: production decides which unsafe settings are refused.
  NODE_ENV: z.preprocess((v) => (typeof v === 'string' ? v.trim().toLowerCase() : v), z.enum([...PRODUCTION_ENVS, ...OTHER_ENVS])).default('development'),
  DATABASE_URL: z
    .string()
    .trim()
    .refine((v) => /^postgres(ql)?:\/\//.test(v), 'must be a postgres:// or postgresql:// URL')
    // What the driver would throw later as a bare "Invalid URL", naming nothing (the value is never echoed).
    .refine(
      (v) => !/^postgres(ql)?:\/\//.test(v) || parsesAsConnectionString(v),
      'is not a valid URL: percent-encode special characters in the user name or password (# as %23, / as %2F, ? as %3F, @ as %40)',
    )
    .optional(),
  // The PostgreSQL schema of every table; the application's recordUsage must be given the same.
  DATABASE_SCHEMA: z
    .string()
    .trim()
    .superRefine((v, ctx) => {
      const problem = schemaNameProblem(v);
      if (problem) ctx.addIssue({ code: 'custom', message: problem });
    })
    .default(DEFAULT_SCHEMA),
  TEMPORAL_ADDRESS: z
    .string()
    .trim()
    .regex(/^[^\s:/]+:\d{1,5}$/, 'must be host:port, e.g. localhost:7233')
    .optional(),
  TEMPORAL_NAMESPACE: nonEmpty('a Temporal namespace').default('default'),
  // TLS to Temporal: on with any of the files, the server name or an API key (Temporal Cloud);
  // TEMPORAL_TLS=true for TLS with the system's CAs alone, false to refuse it outright.
  TEMPORAL_TLS: z.enum(['true', 'false'], { message: 'must be true or false' }).optional(),
  TEMPORAL_TLS_CA_FILE: nonEmpty("a PEM file of the CA that signed the server's certificate").optional(),
  TEMPORAL_TLS_CERT_FILE: nonEmpty("a PEM file of this client's certificate (mTLS)").optional(),
  TEMPORAL_TLS_KEY_FILE: nonEmpty("a PEM file of this client's private key (mTLS)").optional(),
  TEMPORAL_TLS_SERVER_NAME: nonEmpty('the name the server certificate is issued to').optional(),
  TEMPORAL_API_KEY: nonEmpty('a Temporal Cloud API key').optional(),
  TEMPORAL_TASK_QUEUE: nonEmpty('a Temporal task queue').default('billing-outbox'),
  STRIPE_API_KEY: z
    .string()
    .trim()
    .regex(SECRET_KEY_PATTERN, 'must be a Stripe secret or restricted key (sk_test_…, sk_live_…, rk_…)')
    .optional(),
  STRIPE_API_BASE: z
    .string()
    .trim()
    .refine((v) => {
      try {
        const u = new URL(v);
        return (u.protocol === 'https:' || u.protocol === 'http:') && (u.pathname === '/' || u.pathname === '');
      } catch {
        return false;
      }
    }, 'must be an http(s) base URL without a path, e.g. http://127.0.0.1:12111')
    .default(STRIPE_DEFAULT_BASE),
  // The event name of every usage recorded without one: held to the rules of an event name given
  // with a usage, so that a bad one stops the process here instead of refusing each usage later
  // with a 400 the client takes for its own mistake.
  STRIPE_METER_EVENT_NAME: z
    .string()
    .trim()
    .superRefine((v, ctx) => {
      const problem = textProblem(v, MAX_EVENT_NAME_LENGTH);
      if (problem) ctx.addIssue({ code: 'custom', message: problem });
    })
    .default('api_requests'),
  STRIPE_TIMEOUT_MS: int(100, LONGEST_STRIPE_TIMEOUT_MS).default(20_000),
  STRIPE_UNANSWERED_HOLD_MS: int(0, 600_000).default(30_000),
  STRIPE_WEBHOOK_SECRET: z
    .string()
    .trim()
    .regex(WEBHOOK_SECRET_PATTERN, 'must be a Stripe webhook signing secret (whsec_…)')
    .optional(),
  STRIPE_RATE_LIMIT_PER_SECOND: decimal(0.1, 10_000).optional(),
  STRIPE_METER_API: z.enum(['v1', 'v2'], 'must be v1 (meter events) or v2 (the meter event stream)').default('v1'),
  STRIPE_IDENTIFIER_NAMESPACE: z
    .string()
    .trim()
    .regex(/^$|^[A-Za-z0-9_-]{1,24}$/, 'must be at most 24 letters, digits, - or _ (or empty: no namespace)')
    .default(''),
  TEMPORAL_UI_URL: z
    .string()
    .trim()
    .regex(/^https?:\/\/[^\s]+$/, 'must be an http(s) URL')
    .optional(),
  RETRY_INITIAL_INTERVAL_MS: int(1, 3_600_000).default(1_000),
  RETRY_BACKOFF_COEFFICIENT: decimal(1, 10).default(2),
  RETRY_MAXIMUM_INTERVAL_MS: int(1, 86_400_000).default(300_000),
  RETRY_MAXIMUM_ATTEMPTS: int(1, 1_000).default(12),
  RETRY_MAX_RATE_LIMITED_MS: int(1_000, LONGEST_RETRY_MS).default(3_600_000),
  RETRY_MAX_OUTAGE_MS: int(0, LONGEST_RETRY_MS).default(MAX_OUTAGE_MS),
  DEAD_LETTER_OPEN_DAYS: decimal(0.001, 365).default(7),
  RELAY_BATCH_SIZE: int(1, 5_000).default(200),
  RELAY_COUNT: int(1, 64).default(2),
  RELAY_CLAIM_TIMEOUT_MS: int(1_000, 3_600_000).default(60_000),
  RELAY_POLL_INTERVAL_MS: int(10, 60_000).default(1_000),
  LANE_MAX_IN_FLIGHT: int(1, 10_000).optional(),
  WORKER_MAX_CONCURRENT_DELIVERIES: int(2, 100_000).default(500),
  STARTUP_WAIT_MS: int(0, 3_600_000).default(60_000),
  API_HOST: z.string().trim().min(1).default('127.0.0.1'),
  API_PORT: int(0, 65_535).default(8080),
  API_BODY_LIMIT_BYTES: int(256, 10_485_760).default(65_536),
  API_REQUEST_TIMEOUT_MS: int(100, 600_000).default(10_000),
  API_KEEP_ALIVE_TIMEOUT_MS: int(100, 600_000).default(5_000),
  API_TOKENS: z
    .string()
    .trim()
    .transform((v, ctx) => {
      try {
        return JSON.parse(v) as unknown;
      } catch {
        ctx.addIssue({ code: 'custom', message: 'must be a JSON array of {"name","token","tenants","scopes"} (not valid JSON)' });
        return z.NEVER;
      }
    })
    .pipe(z.array(apiToken, 'must be a JSON array of {"name","token","tenants","scopes"}'))
    .optional(),
  WORKER_METRICS_PORT: int(0, 65_535).optional(),
  // Never less than Stripe's 35-day window plus a day: reconciliation (31 days at most) and a
  // cancel (24 h) read delivered rows; pruning them earlier would blind both.
  OUTBOX_RETENTION_DAYS: decimal(36, 36_500).default(45),
  OUTBOX_PRUNE_INTERVAL_MS: int(1_000, 86_400_000).default(600_000),
  // The reconcile schedule (src/temporal/reconcile-schedule.ts). The lag keeps the window clear of
  // the minutes Stripe's summaries may still be counting; a day at most, so the window stays well
  // inside Stripe's 35 days and the outbox's retention.
  RECONCILE_SCHEDULE: z.enum(['on', 'off'], 'must be on or off').default('on'),
  RECONCILE_INTERVAL_MS: int(60_000, 86_400_000).default(3_600_000),
  RECONCILE_LAG_MS: int(600_000, 86_400_000).default(3_600_000),
  DATA_DIR: z.string().trim().min(1).optional(),
  TEMPORAL_CLI_PATH: z.string().trim().min(1).optional(),
  LOG_LEVEL: z.preprocess((v) => (typeof v === 'string' ? v.trim().toLowerCase() : v), z.enum(['fatal', 'error', 'warn', 'info', 'debug', 'trace', 'silent'])).default('info'),
  // OpenTelemetry's own names: a collector's setup for other services works for this one too.
  OTEL_EXPORTER_OTLP_ENDPOINT: z
    .string()
    .trim()
    .regex(/^https?:\/\/[^\s]+$/, 'must be an http(s) URL (OTLP over HTTP, e.g. http://collector:4318)')
    .optional(),
  OTEL_SERVICE_NAME: z.string().trim().min(1).default('billing-outbox'),
  LOCAL_STRIPE_URL: z
    .string()
    .trim()
    .regex(/^https?:\/\/[^\s]+$/, 'must be an http(s) URL')
    .optional(),
});

type Parsed = z.infer<typeof schema>;

export type { RetryPolicy };

/**
 * Every timing of a delivery, resolved once from the configuration: the ones derived from another
 * are derived here, with their reason, and nowhere else (the activity, the lease, the pacer and the
 * workflow's policy all read them from here).
 */
export interface DeliveryTimings {
  /** One Stripe call at most (STRIPE_TIMEOUT_MS, the client's own timeout). */
  callTimeoutMs: number;
  /** A (customer, meter) lease taken for a call: the call plus room for our own queries around it. */
  leaseMs: number;
  /** Less than this left of the lease beyond the call's timeout, and it is renewed before the call. */
  leaseRenewSlackMs: number;
  /** How long a delivery waits in place for the lease before stepping aside (then a workflow timer). */
  leaseWaitMs: number;
  /**
   * The same for the first attempt, which runs as a local activity inside the workflow task that
   * started the run: whatever it waits keeps the task open (past 80 % of the task's 10 s timeout the
   * SDK warns and keeps it alive itself), and it cannot heartbeat. A busy lease is left to the
   * regular activity, which can.
   */
  inTaskLeaseWaitMs: number;
  /** A waiting delivery re-checks the lease at least this often (an expired lease sends no hand-off). */
  leasePollMs: number;
  /** A waiter's place in the lease's queue outlives its last check by this much, then lapses (a dead worker). */
  waiterTtlMs: number;
  /**
   * A lease handed to the next waiting delivery is its for this long: time enough to begin its
   * attempt (which extends it to `leaseMs`); a waiter that died meanwhile loses it this soon.
   */
  handOffMs: number;
  /** v1: after a call that got no answer, how long its lease is kept and handed to nobody (STRIPE_UNANSWERED_HOLD_MS). */
  unansweredHoldMs: number;
  /** A delivery that stepped aside from a busy lease comes back this much later (a workflow timer). */
  leaseBusyRetryMs: number;
  /** Longest an activity waits in place for its slot in the account-wide pace; a longer queue is waited out in the workflow. */
  maxPacingWaitMs: number;
  /** How late a paced call may go out before it takes a new slot (at least one interval of the pace). */
  lateToleranceMs: number;
  /** When Stripe answers 429 without Retry-After, the wait before the next try. */
  rateLimitedWaitMs: number;
  /** Up to this much is added to each 429 wait, so refused calls do not come back as one burst. */
  rateLimitJitterMs: number;
  /** A delivery that found PostgreSQL away comes back this much later (plus up to a second). */
  databaseRetryMs: number;
  /**
   * A delivery's statement (the attempt, the lease, the pace, the mark) unanswered this long is a
   * connection gone silent (a failover): taken for PostgreSQL away, and its connection dropped.
   */
  statementAnswerMs: number;
  /**
   * The worker's other statements (pruning, the closed-run sweep, reconciliation, /metrics'
   * counts) may take longer; one unanswered this long is a connection gone silent all the same.
   */
  maintenanceAnswerMs: number;
  /** A delivery held because Stripe refused the API key (401/403) tries again this much later. */
  credentialsRetryMs: number;
  /** Stripe is taken for down after this long of 5xx or no answer for several customers, with no other answer (src/stripe/outage.ts). */
  outageAfterMs: number;
  /** Once Stripe is taken for down, no failure for this long ends the outage. */
  outageQuietMs: number;
  /** A delivery held by an outage tries again after its age so far, between these two (plus up to a quarter). */
  outageRetryMinMs: number;
  outageRetryMaxMs: number;
  /**
   * How long after its first attempt an event may wait out an outage without spending attempts
   * (RETRY_MAX_OUTAGE_MS; 0: never). Past it, each failure spends an attempt as any other.
   */
  maxOutageMs: number;
  /** Heartbeats during an attempt (waiting for the lease, pacing, the call). */
  heartbeatEveryMs: number;
  /** A dead worker's attempt is retried elsewhere after this: a few missed heartbeats. */
  heartbeatTimeoutMs: number;
  /**
   * One attempt at most, as Temporal times it (start-to-close, fixed in each run when it starts):
   * the lease wait, then the longest call any worker may make (STRIPE_TIMEOUT_MS's maximum), plus
   * room for the database work and the pace around it. Not this worker's call timeout: a run
   * started before STRIPE_TIMEOUT_MS was raised would otherwise have each attempt timed out by
   * Temporal while its call went on, its answer (an outage's hold included) thrown away and an
   * attempt spent. A dead worker is noticed sooner: by the heartbeat timeout, or in the workflow
   * task by that task's own timeout.
   */
  attemptTimeoutMs: number;
  /** One attempt at most with this worker's STRIPE_TIMEOUT_MS (what its retries can take, end to end). */
  attemptMs: number;
}

/**
 * LANE_MAX_IN_FLIGHT's defaults. v1: Stripe takes one call at a time per customer and meter, so
 * more in flight would only wait for the lease. v2: the stream has no such rule, but a lane with
 * no limit put a whole backlog into Temporal at once, where every queue it passes (the worker's
 * slots, the local activities, the server's CPU) is shared: one tenant's flood of 3,000 held every
 * other tenant's new events 30 s and more (bench fairness). A limit keeps the backlog in the outbox,
 * where the claim serves tenants in turn. The relays hold busy lanes below it while quiet lanes are
 * served on a saturated machine (src/outbox/lane-window.ts).
 */
export const CALL_LANE_MAX_IN_FLIGHT = 4;
export const STREAM_LANE_MAX_IN_FLIGHT = 100;

/** The fixed parts of the timings; `resolveTimings` derives the rest. */
const LEASE_WAIT_MS = 10_000;
const HEARTBEAT_EVERY_MS = 2_000;

/** The delivery timings for a Stripe call timeout and unanswered-call hold (exported for tests). */
export function resolveTimings(callTimeoutMs: number, unansweredHoldMs: number, maxOutageMs = MAX_OUTAGE_MS): DeliveryTimings {
  return {
    callTimeoutMs,
    // 5 s for our own queries around the call while holding the lease (begin, mark sent).
    leaseMs: callTimeoutMs + 5_000,
    leaseRenewSlackMs: 2_000,
    leaseWaitMs: LEASE_WAIT_MS,
    inTaskLeaseWaitMs: Math.min(1_000, LEASE_WAIT_MS),
    leasePollMs: 1_000,
    // Refreshed every poll: a few polls missed means the waiting worker is gone.
    waiterTtlMs: 5_000,
    handOffMs: 5_000,
    unansweredHoldMs,
    leaseBusyRetryMs: 250,
    maxPacingWaitMs: 1_000,
    lateToleranceMs: 100,
    rateLimitedWaitMs: 1_000,
    rateLimitJitterMs: 500,
    databaseRetryMs: 2_000,
    // Each takes milliseconds; the lease leaves our statements around a call 5 s (leaseMs).
    statementAnswerMs: 5_000,
    // Each is bounded (a batch, a window, a count) and takes seconds at most on a big table.
    maintenanceAnswerMs: 120_000,
    // Often enough that delivery resumes within seconds of the key being fixed, rarely enough that
    // a backlog held this way costs Stripe a handful of refused calls a second at most.
    credentialsRetryMs: 15_000,
    // Longer than a blip the retry policy rides out in a few attempts.
    outageAfterMs: 15_000,
    // Each held delivery comes back within 6.25 minutes, on any of the workers: an hour covers ten
    // workers taking two of them in turn. (An answer from Stripe ends the outage at once.)
    outageQuietMs: 3_600_000,
    // Soon after a short outage; every 5 minutes at most (the retry policy's own longest interval)
    // in a long one, so a backlog held in flight costs Stripe a few calls a second when it returns.
    outageRetryMinMs: 15_000,
    outageRetryMaxMs: 300_000,
    maxOutageMs,
    heartbeatEveryMs: HEARTBEAT_EVERY_MS,
    // Five heartbeats missed: not a slow query, a dead worker.
    heartbeatTimeoutMs: 5 * HEARTBEAT_EVERY_MS,
    // The wait for the lease, the call (the longest any worker may make, for Temporal; this
    // worker's own for attemptMs), and 10 s for the database work and the pace's wait around it.
    attemptTimeoutMs: LEASE_WAIT_MS + LONGEST_STRIPE_TIMEOUT_MS + 10_000,
    attemptMs: LEASE_WAIT_MS + callTimeoutMs + 10_000,
  };
}

/** How to reach Temporal: a self-hosted server (TLS, mTLS) or Temporal Cloud (mTLS or an API key). */
export interface TemporalConfig {
  address: string | undefined;
  namespace: string;
  taskQueue: string;
  /** Undefined: plain gRPC. Files are PEM, read when connecting. */
  tls: { caFile?: string; certFile?: string; keyFile?: string; serverName?: string } | undefined;
  apiKey: string | undefined;
  /** TEMPORAL_API_KEY_FILE when the key came from it: read again while running (src/temporal/connection.ts). */
  apiKeyFile?: string;
}

export interface Config {
  production: boolean;
  databaseUrl: string | undefined;
  /** The PostgreSQL schema of billing-outbox's tables (DATABASE_SCHEMA, default billing_outbox). */
  databaseSchema: string;
  temporal: TemporalConfig;
  stripe: {
    /** Undefined outside production means "use the local Stripe-compatible server's test key". */
    apiKey: string | undefined;
    /** STRIPE_API_KEY_FILE when the key came from it: read again while running (src/stripe/client.ts, src/key-file.ts). */
    apiKeyFile?: string;
    apiBase: string;
    /** True when STRIPE_API_BASE was left at Stripe's own API. */
    isRealStripe: boolean;
    meterEventName: string;
    timeoutMs: number;
    /** Secret that verifies Stripe's webhook signatures; unset: the webhook route refuses all. */
    webhookSecret: string | undefined;
    /** STRIPE_WEBHOOK_SECRET_FILE when the secret came from it: read again while running (src/api/webhooks.ts). */
    webhookSecretFile?: string;
    /**
     * Meter-event calls per second across every worker, paced by the shared limiter in PostgreSQL
     * (src/stripe/rate-limit.ts). Default: 900 with a live key (Stripe's live limit is 1,000/s),
     * 20 otherwise (test mode allows 25 operations/s); see src/stripe/rules.ts.
     */
    rateLimitPerSecond: number;
    /**
     * v1: one call per event to POST /v1/billing/meter_events (validated synchronously; one call at
     * a time per customer and meter). v2: batches of up to 100 on the meter event stream
     * (validated asynchronously; no per-customer rule; the rate limit counts requests).
     */
    meterApi: 'v1' | 'v2';
    /**
     * STRIPE_IDENTIFIER_NAMESPACE: put in front of every identifier Stripe gets (not the key, not
     * the workflow id), so that deployments sharing one Stripe account never take each other's
     * identifiers (src/outbox/keys.ts `stripeIdentifierFor`). Empty (the default): identifiers
     * are the keys, as before.
     */
    identifierNamespace: string;
  };
  /** Base URL of the Temporal Web UI, for links (default http://localhost:8233). */
  temporalUiUrl: string;
  /** Temporal's retry policy of the Stripe call, and the bounds around it (the usage workflow's input). */
  retry: RetryPolicy;
  /** Every timing of a delivery, resolved once (see DeliveryTimings). */
  timings: DeliveryTimings;
  relay: { batchSize: number; count: number; claimTimeoutMs: number; pollIntervalMs: number };
  /**
   * A lane is one tenant's events for one meter. At most `maxInFlight` of a lane's events are
   * claimed or dispatched at once (the rest wait, pending).
   */
  lanes: { maxInFlight: number };
  /**
   * Deliveries one worker runs at once. A delivery's first attempt runs as a local activity, which
   * holds a workflow task slot while it waits for its lease and calls Stripe, so this sets both
   * limits (WORKER_MAX_CONCURRENT_DELIVERIES; measured: the SDK's default of 40 slots left the
   * server handing out workflow tasks that waited for one, a third more of its CPU per event).
   */
  worker: { maxConcurrentDeliveries: number };
  /**
   * How long a starting worker or API process waits for the services it needs (PostgreSQL; the
   * worker also Temporal) to accept connections, trying again with backoff and logging each failed
   * try (STARTUP_WAIT_MS; 0: not at all): one started while either restarts comes up once it is
   * back instead of exiting (src/reachable.ts).
   */
  startupWaitMs: number;
  api: { host: string; port: number; bodyLimitBytes: number; requestTimeoutMs: number; keepAliveTimeoutMs: number; tokens: ApiToken[] };
  /**
   * Delivered (and cancelled) rows older than `olderThanMs` (by sent_at) are deleted, in batches,
   * by every worker every `intervalMs`; dead and unfinished rows never are.
   */
  retention: { olderThanMs: number; intervalMs: number };
  /**
   * The reconcile schedule: created by every worker unless `schedule` is false; a run every
   * `intervalMs` compares the whole hours that ended at least `lagMs` ago (see reconcileWindowAt).
   */
  reconcile: { schedule: boolean; intervalMs: number; lagMs: number };
  /** Where the Temporal SDK's Prometheus metrics are served by a worker (unset: not served). */
  workerMetricsPort: number | undefined;
  /** Where `npm start` keeps embedded data (default: .data under the project). */
  dataDir: string | undefined;
  temporalCliPath: string | undefined;
  logLevel: Parsed['LOG_LEVEL'];
  /**
   * Tracing (src/tracing.ts): one OpenTelemetry trace per event, exported over OTLP/HTTP to
   * `otlpEndpoint`. Unset: off, and no SDK is loaded.
   */
  tracing: { otlpEndpoint: string | undefined; serviceName: string };
  /** Where `npm run stripe` finds the local Stripe (unset: from the running stack's endpoints file). */
  localStripeUrl: string | undefined;
}

/**
 * Whether node-postgres will parse `url` (pg-connection-string's own steps: spaces and stray `%`
 * encoded first, then a URL, or one with an empty host, as a socket directory in `?host=` needs).
 */
function parsesAsConnectionString(url: string): boolean {
  const encoded = /[ ]|%[^a-f0-9]|%[a-f0-9][^a-f0-9]/i.test(url) ? encodeURI(url).replace(/%25(\d\d)/g, '%$1') : url;
  const parsed = URL.parse(encoded, 'postgres://base') ?? URL.parse(encoded.replace('@/', '@___DUMMY___/'), 'postgres://base');
  if (!parsed) return false;
  try {
    // Decoded as it does: a %XX that is not UTF-8 throws URIError there.
    decodeURIComponent(parsed.username);
    decodeURIComponent(parsed.password);
    decodeURIComponent(parsed.hostname);
    decodeURI(parsed.pathname);
    return true;
  } catch {
    return false;
  }
}

/** Every environment variable the configuration reads. */
export const CONFIG_VARIABLES: readonly string[] = Object.keys(schema.shape);

/**
 * Variables set in `env` that look like a misspelling of one the configuration reads (another
 * case, a letter or two off: `DATABASE_SCHEME`, `stripe_api_key`), each with the name it is
 * probably meant as. Read by nobody, such a variable leaves its setting at the default in silence
 * (a worker relaying the default schema while the application writes another). Names far from
 * every one of ours (the application's own variables) are not reported.
 */
export function misspelledVariables(env: Record<string, string | undefined> = process.env): { name: string; meant: string }[] {
  const known = new Set(CONFIG_VARIABLES.flatMap((v) => [v, `${v}_FILE`]));
  const found: { name: string; meant: string }[] = [];
  const firstWord = (v: string) => v.split('_')[0];
  for (const name of Object.keys(env)) {
    if (known.has(name) || env[name] === undefined) continue;
    const upper = name.toUpperCase();
    let best: { meant: string; distance: number } | undefined;
    for (const candidate of known) {
      // The same first word (STRIPE_, DATABASE_…): APP_PORT is the application's, not API_PORT
      // misspelled. And only a variable not set itself: set, it was not what was meant.
      if (firstWord(upper) !== firstWord(candidate) || env[candidate] !== undefined) continue;
      const distance = upper === candidate ? 0 : editDistance(upper, candidate, 2);
      if (distance <= 2 && (!best || distance < best.distance)) best = { meant: candidate, distance };
    }
    if (best) found.push({ name, meant: best.meant });
  }
  return found;
}

/** misspelledVariables as the warnings a process logs at start. */
export function misspelledVariableWarnings(env: Record<string, string | undefined> = process.env): string[] {
  return misspelledVariables(env).map(({ name, meant }) => `${name} is set but is not a billing-outbox variable: did you mean ${meant}? (${meant} keeps its default)`);
}

/** Levenshtein distance of `a` and `b`, or `limit + 1` once it is sure to pass `limit`. */
function editDistance(a: string, b: string, limit: number): number {
  if (Math.abs(a.length - b.length) > limit) return limit + 1;
  let previous = Array.from({ length: b.length + 1 }, (_, j) => j);
  for (let i = 1; i <= a.length; i++) {
    const row = [i];
    for (let j = 1; j <= b.length; j++) row[j] = Math.min(previous[j]! + 1, row[j - 1]! + 1, previous[j - 1]! + (a[i - 1] === b[j - 1] ? 0 : 1));
    if (Math.min(...row) > limit) return limit + 1;
    previous = row;
  }
  return previous[b.length]!;
}

export class ConfigError extends Error {
  readonly problems: string[];
  constructor(problems: string[]) {
    super(`Invalid configuration:\n${problems.map((p) => `  - ${p}`).join('\n')}`);
    this.problems = problems;
    this.name = 'ConfigError';
  }
}

function temporalTls(c: Parsed): TemporalConfig['tls'] {
  const files = { caFile: c.TEMPORAL_TLS_CA_FILE, certFile: c.TEMPORAL_TLS_CERT_FILE, keyFile: c.TEMPORAL_TLS_KEY_FILE, serverName: c.TEMPORAL_TLS_SERVER_NAME };
  const any = Object.values(files).some((v) => v !== undefined);
  if (c.TEMPORAL_TLS === 'false') return undefined;
  if (c.TEMPORAL_TLS !== 'true' && !any && c.TEMPORAL_API_KEY === undefined) return undefined;
  return Object.fromEntries(Object.entries(files).filter(([, v]) => v !== undefined));
}

function temporalTlsProblems(c: Parsed): string[] {
  const problems: string[] = [];
  const files = ['TEMPORAL_TLS_CA_FILE', 'TEMPORAL_TLS_CERT_FILE', 'TEMPORAL_TLS_KEY_FILE'] as const;
  if (c.TEMPORAL_TLS === 'false') {
    for (const f of [...files, 'TEMPORAL_TLS_SERVER_NAME'] as const) if (c[f] !== undefined) problems.push(`${f}: is set while TEMPORAL_TLS=false`);
    if (c.TEMPORAL_API_KEY !== undefined) problems.push('TEMPORAL_API_KEY: is set while TEMPORAL_TLS=false (the key would cross the network in clear text on every call)');
  }
  if ((c.TEMPORAL_TLS_CERT_FILE === undefined) !== (c.TEMPORAL_TLS_KEY_FILE === undefined)) {
    problems.push('TEMPORAL_TLS_CERT_FILE: mTLS needs both TEMPORAL_TLS_CERT_FILE and TEMPORAL_TLS_KEY_FILE (one is missing)');
  }
  for (const f of files) {
    const path = c[f];
    if (path !== undefined && !existsSync(path)) problems.push(`${f}: no such file: ${path}`);
  }
  return problems;
}

/**
 * Reads the configuration from `env` (default: `process.env`). Empty strings count as unset, so
 * `FOO=` in a .env file means "use the default".
 */
export function loadConfig(env: NodeJS.ProcessEnv = process.env): Config {
  const input: Record<string, string> = {};
  const fileProblems: string[] = [];
  // The files that values were read from: a secret's file may be read again while running.
  const fromFile: Record<string, string> = {};
  for (const key of Object.keys(schema.shape)) {
    const value = env[key];
    const file = env[`${key}_FILE`];
    const given = value !== undefined && value.trim() !== '';
    if (file !== undefined && file.trim() !== '') {
      // Secrets from files (Docker and Kubernetes secrets): FOO_FILE=/run/secrets/foo.
      if (given) fileProblems.push(`${key}_FILE: ${key} is set too; set one of them`);
      else {
        try {
          input[key] = readFileSync(file.trim(), 'utf8').trim();
          fromFile[key] = file.trim();
        } catch (err) {
          fileProblems.push(`${key}_FILE: cannot read ${file.trim()} (${(err as NodeJS.ErrnoException).code ?? (err as Error).message})`);
        }
      }
    } else if (given && !(key.endsWith('_PORT') && SERVICE_LINK.test(value.trim()))) input[key] = value;
  }
  if (fileProblems.length > 0) throw new ConfigError(fileProblems);
  const result = schema.safeParse(input);
  if (!result.success) {
    const problems = result.error.issues.map((issue) => {
      const [name, ...rest] = issue.path.map(String);
      const where = rest.length ? ` (at ${rest.join('.')})` : '';
      return `${name ?? '(environment)'}: ${issue.message}${where}`;
    });
    throw new ConfigError(problems);
  }
  const c = result.data;
  const problems: string[] = [];
  if (c.RETRY_MAXIMUM_INTERVAL_MS < c.RETRY_INITIAL_INTERVAL_MS) {
    problems.push('RETRY_MAXIMUM_INTERVAL_MS: must not be smaller than RETRY_INITIAL_INTERVAL_MS');
  }
  // Compared as the URL it names (a trailing slash, an explicit :443 are Stripe itself).
  const stripeBase = new URL(c.STRIPE_API_BASE).origin;
  if (c.STRIPE_API_KEY?.includes('_live_') && !isStripeItself(stripeBase)) {
    problems.push('STRIPE_API_KEY: a live key may only be sent to Stripe itself; unset STRIPE_API_BASE');
  }
  const names = new Set<string>();
  const values = new Map<string, string>();
  for (const t of c.API_TOKENS ?? []) {
    if (names.has(t.name)) problems.push(`API_TOKENS: token name ${JSON.stringify(t.name)} is used twice`);
    names.add(t.name);
    // The first of two entries with one value would always win: the second's tenants and scopes never apply.
    if (t.token.startsWith('change-me')) problems.push(`API_TOKENS: token ${JSON.stringify(t.name)} is .env.example's placeholder; make one (openssl rand -hex 32)`);
    const first = values.get(t.token);
    if (first !== undefined) problems.push(`API_TOKENS: tokens ${JSON.stringify(first)} and ${JSON.stringify(t.name)} have the same value`);
    else values.set(t.token, t.name);
    // A tenant no usage can name (a trailing space, a hidden character) would refuse every request as forbidden.
    for (const tenant of t.tenants) {
      const problem = tenant === '*' ? undefined : tenantProblem(tenant);
      if (problem) problems.push(`API_TOKENS: token ${JSON.stringify(t.name)}: tenant ${JSON.stringify(tenant)} ${problem}`);
    }
  }
  problems.push(...temporalTlsProblems(c));
  const timings = resolveTimings(c.STRIPE_TIMEOUT_MS, c.STRIPE_UNANSWERED_HOLD_MS, c.RETRY_MAX_OUTAGE_MS);
  const attemptsMs = longestAttemptsMs(
    { initialIntervalMs: c.RETRY_INITIAL_INTERVAL_MS, backoffCoefficient: c.RETRY_BACKOFF_COEFFICIENT, maximumIntervalMs: c.RETRY_MAXIMUM_INTERVAL_MS, maximumAttempts: c.RETRY_MAXIMUM_ATTEMPTS },
    timings.attemptMs,
  );
  // An event's waits that spend no attempt come first (an outage's, then a stretch of 429s as the
  // backlog meets Stripe again), then its failures spend attempts: the last must still come before
  // the resend window closes, or the event dies of the window (an operator asked to reconcile)
  // instead of its own error.
  const longestWait = c.RETRY_MAX_OUTAGE_MS + c.RETRY_MAX_RATE_LIMITED_MS;
  if (longestWait + attemptsMs > SAFE_RESEND_WINDOW_MS) {
    const h = (ms: number) => `${Number((ms / 3_600_000).toFixed(1))} h`;
    problems.push(
      `RETRY_MAXIMUM_ATTEMPTS: ${c.RETRY_MAXIMUM_ATTEMPTS} attempts, with the RETRY_* intervals and attempts of up to ${timings.attemptMs / 1000} s (STRIPE_TIMEOUT_MS + 20 s), ` +
        `can take ${h(attemptsMs)}, after the ${h(longestWait)} of RETRY_MAX_OUTAGE_MS and RETRY_MAX_RATE_LIMITED_MS: ` +
        `past the ${h(SAFE_RESEND_WINDOW_MS)} an event may be sent in (Stripe's 24 h identifier dedup); fewer attempts, a shorter RETRY_MAXIMUM_INTERVAL_MS, RETRY_MAX_OUTAGE_MS or RETRY_MAX_RATE_LIMITED_MS`,
    );
  }
  if (problems.length > 0) throw new ConfigError(problems);

  return {
    production: (PRODUCTION_ENVS as readonly string[]).includes(c.NODE_ENV),
    databaseUrl: c.DATABASE_URL,
    databaseSchema: c.DATABASE_SCHEMA,
    temporal: {
      address: c.TEMPORAL_ADDRESS,
      namespace: c.TEMPORAL_NAMESPACE,
      taskQueue: c.TEMPORAL_TASK_QUEUE,
      tls: temporalTls(c),
      apiKey: c.TEMPORAL_API_KEY,
      ...(fromFile.TEMPORAL_API_KEY !== undefined ? { apiKeyFile: fromFile.TEMPORAL_API_KEY } : {}),
    },
    stripe: {
      apiKey: c.STRIPE_API_KEY,
      ...(fromFile.STRIPE_API_KEY !== undefined ? { apiKeyFile: fromFile.STRIPE_API_KEY } : {}),
      apiBase: stripeBase,
      isRealStripe: isStripeItself(stripeBase),
      meterEventName: c.STRIPE_METER_EVENT_NAME,
      timeoutMs: c.STRIPE_TIMEOUT_MS,
      webhookSecret: c.STRIPE_WEBHOOK_SECRET,
      ...(fromFile.STRIPE_WEBHOOK_SECRET !== undefined ? { webhookSecretFile: fromFile.STRIPE_WEBHOOK_SECRET } : {}),
      rateLimitPerSecond: c.STRIPE_RATE_LIMIT_PER_SECOND ?? (c.STRIPE_API_KEY?.includes('_live_') ? DEFAULT_LIVE_RATE : DEFAULT_TEST_RATE),
      meterApi: c.STRIPE_METER_API,
      identifierNamespace: c.STRIPE_IDENTIFIER_NAMESPACE,
    },
    temporalUiUrl: (c.TEMPORAL_UI_URL ?? 'http://localhost:8233').replace(/\/$/, ''),
    retry: {
      initialIntervalMs: c.RETRY_INITIAL_INTERVAL_MS,
      backoffCoefficient: c.RETRY_BACKOFF_COEFFICIENT,
      maximumIntervalMs: c.RETRY_MAXIMUM_INTERVAL_MS,
      maximumAttempts: c.RETRY_MAXIMUM_ATTEMPTS,
      attemptTimeoutMs: timings.attemptTimeoutMs,
      heartbeatTimeoutMs: timings.heartbeatTimeoutMs,
      maxRateLimitedMs: c.RETRY_MAX_RATE_LIMITED_MS,
      deadLetterOpenMs: Math.round(c.DEAD_LETTER_OPEN_DAYS * 86_400_000),
    },
    timings,
    lanes: { maxInFlight: c.LANE_MAX_IN_FLIGHT ?? (c.STRIPE_METER_API === 'v2' ? STREAM_LANE_MAX_IN_FLIGHT : CALL_LANE_MAX_IN_FLIGHT) },
    worker: { maxConcurrentDeliveries: c.WORKER_MAX_CONCURRENT_DELIVERIES },
    startupWaitMs: c.STARTUP_WAIT_MS,
    relay: {
      batchSize: c.RELAY_BATCH_SIZE,
      count: c.RELAY_COUNT,
      claimTimeoutMs: c.RELAY_CLAIM_TIMEOUT_MS,
      pollIntervalMs: c.RELAY_POLL_INTERVAL_MS,
    },
    api: {
      host: c.API_HOST,
      port: c.API_PORT,
      bodyLimitBytes: c.API_BODY_LIMIT_BYTES,
      requestTimeoutMs: c.API_REQUEST_TIMEOUT_MS,
      keepAliveTimeoutMs: c.API_KEEP_ALIVE_TIMEOUT_MS,
      tokens: c.API_TOKENS ?? [],
    },
    retention: { olderThanMs: Math.round(c.OUTBOX_RETENTION_DAYS * 86_400_000), intervalMs: c.OUTBOX_PRUNE_INTERVAL_MS },
    reconcile: { schedule: c.RECONCILE_SCHEDULE === 'on', intervalMs: c.RECONCILE_INTERVAL_MS, lagMs: c.RECONCILE_LAG_MS },
    workerMetricsPort: c.WORKER_METRICS_PORT,
    dataDir: c.DATA_DIR,
    temporalCliPath: c.TEMPORAL_CLI_PATH,
    logLevel: c.LOG_LEVEL,
    tracing: { otlpEndpoint: c.OTEL_EXPORTER_OTLP_ENDPOINT?.replace(/\/+$/, ''), serviceName: c.OTEL_SERVICE_NAME },
    localStripeUrl: c.LOCAL_STRIPE_URL?.replace(/\/+$/, ''),
  };
}
