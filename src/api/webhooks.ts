/**
 * POST /v1/stripe/webhooks: Stripe's asynchronous rejections of meter events it had answered 200.
 *
 * Stripe validates some meter events after acknowledging them, groups the failures per meter and
 * publishes `v1.billing.meter.error_report_triggered` (and `v1.billing.meter.no_meter_found`, same
 * shape) as v2 *thin* events: the webhook body carries only the event's id and type, signed with
 * the endpoint's secret; the failed identifiers are in the full event, fetched from Stripe.
 *
 * Order: secret configured (else 503, so Stripe keeps redelivering until it is) → signature over
 * the raw body (else 400) → already processed? (200, nothing else) → fetch the full event from
 * Stripe (else 503: Stripe redelivers) → record it (src/ops/error-reports.ts: in one transaction,
 * the event id, whose primary key makes a concurrent redelivery wait and then do nothing, and the
 * named rows that are `sent`, `accepted`, `dispatched` or `dead`, found by the identifier Stripe got, moved to `rejected_async`) → 200.
 *
 * No bearer token (Stripe cannot send one): the signature is the authentication. The route has its
 * own raw-body parser, registered in an encapsulated scope so every other route keeps JSON only.
 */
import type { FastifyBaseLogger, FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';
import { randomUUID } from 'node:crypto';
import type pg from 'pg';
import Stripe from 'stripe';
import type { Config } from '../config.js';
import { keyFromFile, newsOn, type KeyLog } from '../key-file.js';
import { scrub } from '../log.js';
import { BoundedLabels, type Metrics } from '../metrics.js';
import { errorReportProcessed, recordErrorReport, type ErrorReport } from '../ops/error-reports.js';
import { createStripeClient } from '../stripe/client.js';
import { classifyStripeError } from '../stripe/errors.js';
import { WEBHOOK_SECRET_PATTERN } from '../stripe/rules.js';
import { ApiError } from './errors.js';
import type { TemporalHealth } from './health.js';
import { rowChangedSignal } from '../../workflows/shared.js';
import { GRPC_NOT_FOUND, grpcCode } from '../temporal/start-usage.js';
import type { Schema } from '../outbox/sql/schema.js';

export const WEBHOOK_PATH = '/v1/stripe/webhooks';

/** Event types whose full data lists failed meter-event requests by identifier. */
export const ERROR_REPORT_EVENT_TYPES: ReadonlySet<string> = new Set(['v1.billing.meter.error_report_triggered', 'v1.billing.meter.no_meter_found']);

/** A thin notification is a few hundred bytes; this only bounds what a misconfigured sender can make us read. */
const WEBHOOK_BODY_LIMIT_BYTES = 256 * 1024;
/**
 * How far Stripe's signature timestamp may be from our clock, either way. Wider than the library's
 * 5 minutes: an API host whose clock is some minutes off would otherwise refuse every report for as
 * long as the skew lasts (Stripe signs each redelivery afresh), and the rejected rows would stay
 * billed-looking. A replayed notification costs nothing: the event is fetched from Stripe, once.
 */
const SIGNATURE_TOLERANCE_MS = 15 * 60_000;
/** Stripe event ids: a prefix and letters, digits, underscores (hyphens allowed). */
const EVENT_ID = /^[A-Za-z0-9_-]{1,255}$/;
/** Stripe waits a limited time for the answer; fetching the full event must fit well inside it. */
const FETCH_TIMEOUT_MS = 10_000;

export type WebhookStripe = Pick<Stripe, 'parseEventNotification'>;

export interface WebhookDeps {
  db: pg.Pool;
  schema: Schema;
  config: Config['stripe'];
  /** Defaults to a client built from `config` (the local server's or Stripe's). */
  stripe?: WebhookStripe;
  metrics?: Partial<Pick<Metrics, 'asyncRejections' | 'stripeErrors'>>;
  /**
   * Tells a dead letter's open run that Stripe's report rejected its row (rowChangedSignal), so the
   * Web UI stops offering a retry. Best effort: the row is the record; unset, no run is told.
   */
  tellRun?: (key: string) => Promise<void>;
}

const str = (v: unknown): string | undefined => (typeof v === 'string' ? v : undefined);
const num = (v: unknown): number | undefined => (typeof v === 'number' && Number.isFinite(v) && v >= 0 ? Math.floor(v) : undefined);
const obj = (v: unknown): Record<string, unknown> => (typeof v === 'object' && v !== null && !Array.isArray(v) ? (v as Record<string, unknown>) : {});
const arr = (v: unknown): unknown[] => (Array.isArray(v) ? v : []);

/** Reads a fetched error-report event; samples without an identifier are skipped (but still counted). */
export function parseErrorReport(event: unknown): ErrorReport {
  const e = obj(event);
  const data = obj(e.data);
  const reason = obj(data.reason);
  const errorTypes = arr(reason.error_types).map((t) => {
    const type = obj(t);
    const samples = arr(type.sample_errors).flatMap((s) => {
      const sample = obj(s);
      const identifier = str(obj(sample.request).identifier);
      return identifier ? [{ identifier, message: str(sample.error_message) ?? '' }] : [];
    });
    return { code: str(type.code) ?? 'unknown', errorCount: num(type.error_count) ?? samples.length, samples };
  });
  const summed = errorTypes.reduce((n, t) => n + t.errorCount, 0);
  const related = obj(e.related_object);
  return {
    eventId: str(e.id) ?? '',
    type: str(e.type) ?? '',
    meterId: str(related.type) === 'billing.meter' ? (str(related.id) ?? null) : null,
    errorCount: Math.max(num(reason.error_count) ?? summed, errorTypes.reduce((n, t) => n + t.samples.length, 0)),
    errorTypes,
    validationStart: str(data.validation_start) ?? null,
    validationEnd: str(data.validation_end) ?? null,
  };
}

/** What is kept in stripe_error_reports.report: the event as Stripe sent it, without client helpers. */
function storable(event: Record<string, unknown>): Record<string, unknown> {
  const { id, object, type, created, livemode, related_object, data } = event;
  return { id, object, type, created, livemode, related_object, data };
}

/**
 * The signing secret to verify with now: STRIPE_WEBHOOK_SECRET, read again while running when it
 * came from STRIPE_WEBHOOK_SECRET_FILE (../key-file.ts), so a rolled secret needs no restart.
 * Stripe signs with the old and the new secret while a roll lasts (up to 24 h), so either works.
 */
function webhookSecret(config: Config['stripe'], log: KeyLog): () => string | undefined {
  const first = config.webhookSecret;
  if (first === undefined || config.webhookSecretFile === undefined) return () => first;
  const file = config.webhookSecretFile;
  return keyFromFile(file, first, {
    refuse: (secret) => (WEBHOOK_SECRET_PATTERN.test(secret) ? undefined : 'does not hold a webhook signing secret (whsec_…)'),
    onNews: newsOn(log, file, { what: 'Stripe webhook secret', noun: 'secret', variable: 'STRIPE_WEBHOOK_SECRET_FILE' }),
  });
}

/** How long telling one run may take. */
const TELL_RUN_MS = 5_000;

/**
 * rowChangedSignal to an event's run, over the API's own lazy Temporal connection (its health
 * probe's: no retries, so a Temporal away costs one try within TELL_RUN_MS).
 */
export function rowChangedTeller(temporal: TemporalHealth): (key: string) => Promise<void> {
  return async (key) => {
    await temporal.withDeadline(Date.now() + TELL_RUN_MS, () =>
      temporal.workflowService.signalWorkflowExecution({
        namespace: temporal.namespace,
        workflowExecution: { workflowId: key },
        signalName: rowChangedSignal.name,
        identity: 'billing-outbox api (Stripe error report)',
        requestId: randomUUID(),
      }),
    );
  };
}

/**
 * Tells each dead letter's run, one at a time, after the answer: Stripe waits for no one. A run
 * that cannot be told (Temporal away, credentials that may not signal) keeps showing a dead letter
 * until it closes; `retry` then refuses the row and says to rebill, as for any rejected row.
 */
async function tellRuns(tell: (key: string) => Promise<void>, keys: string[], log: Pick<FastifyBaseLogger, 'info' | 'warn'>): Promise<void> {
  for (const key of keys) {
    await tell(key).catch((err: unknown) => {
      // The run has closed (its dead-letter wait ended): nothing shows it as waiting. Only that
      // NOT_FOUND: another (a namespace or a run this API cannot see) is a warning like the rest.
      const closed = grpcCode(err) === GRPC_NOT_FOUND && /already completed/i.test(String((err as { message?: unknown }).message));
      if (closed) return log.info({ idempotencyKey: key }, "a rejected dead letter's run has closed: nothing to tell");
      log.warn(
        { idempotencyKey: key, error: scrub(String(err)) },
        "a rejected dead letter's open run was not told (Temporal away, or the API's Temporal credentials may not signal): the Web UI shows it as a dead letter until it closes; the row is rejected_async",
      );
    });
  }
}

export function registerWebhookRoutes(app: FastifyInstance, deps: WebhookDeps): void {
  const secretNow = webhookSecret(deps.config, app.log);
  // The metric's `code` label is Stripe's, from each report: a bounded set of them.
  const codes = new BoundedLabels();
  const stripe = deps.stripe ?? createStripeClient({ ...deps.config, timeoutMs: Math.min(deps.config.timeoutMs, FETCH_TIMEOUT_MS) }, { log: app.log });

  void app.register(async (scope) => {
    // The signature covers the exact bytes Stripe sent: parse nothing, keep the Buffer.
    scope.removeAllContentTypeParsers();
    scope.addContentTypeParser('*', { parseAs: 'buffer', bodyLimit: WEBHOOK_BODY_LIMIT_BYTES }, (_request, body, done) => done(null, body));

    scope.post(WEBHOOK_PATH, { config: { public: true } }, async (request: FastifyRequest, reply: FastifyReply) => {
      const secret = secretNow();
      if (!secret) {
        throw new ApiError(
          503,
          'webhook_not_configured',
          'STRIPE_WEBHOOK_SECRET is not set, so no Stripe webhook can be verified; set it to the endpoint\'s signing secret (whsec_…). Stripe redelivers meanwhile.',
        );
      }
      const signature = request.headers['stripe-signature'];
      if (typeof signature !== 'string' || signature.trim() === '') {
        throw new ApiError(400, 'invalid_signature', 'the Stripe-Signature header is missing');
      }
      const body = request.body;
      if (!Buffer.isBuffer(body) || body.length === 0) throw new ApiError(400, 'invalid_signature', 'the body is empty');
      // Stripe's library refuses a signature older than its tolerance but not one from the future,
      // which would stay "fresh" (replayable) until that future came: refused here. Exactly one
      // timestamp: the library verifies against the last `t=`, so with two this check would read
      // another one than the signature covers (`t=<now>,t=<next year>,v1=…`).
      const stamps = [...signature.matchAll(/(?:^|,)\s*t=([^,]*)/g)].map((m) => m[1]!.trim());
      const signedAt = stamps.length === 1 && /^\d+$/.test(stamps[0]!) ? Number(stamps[0]) : NaN;
      if (!Number.isFinite(signedAt) || signedAt * 1000 > Date.now() + SIGNATURE_TOLERANCE_MS) {
        throw new ApiError(400, 'invalid_signature', 'the Stripe-Signature timestamp is missing, repeated or in the future');
      }

      let notification: Stripe.V2.Core.EventNotification;
      try {
        notification = stripe.parseEventNotification(body, signature, secret, SIGNATURE_TOLERANCE_MS / 1000);
      } catch (err) {
        if (err instanceof Stripe.errors.StripeSignatureVerificationError) {
          throw new ApiError(
            400,
            'invalid_signature',
            `the Stripe-Signature header does not match the body (a different STRIPE_WEBHOOK_SECRET, a modified body, or a signature over 15 minutes from this server's clock, ${new Date().toISOString()})`,
          );
        }
        throw new ApiError(400, 'invalid_event', `not a Stripe v2 event notification: ${scrub((err as Error).message)}`);
      }

      const eventId = notification.id;
      // Signed, but still from outside: an id that is not a plain event id (a NUL byte, which
      // PostgreSQL refuses in text) is a bad request, not a 500 Stripe would redeliver for days.
      if (typeof eventId !== 'string' || !EVENT_ID.test(eventId)) {
        throw new ApiError(400, 'invalid_event', 'the event id is not a Stripe event id');
      }
      // The account the event is about when it is not the key's own (`context`: an organization's
      // destination names each account, ours too): said with each line, and processed all the same.
      const log = request.log.child({ stripeEventId: eventId, stripeEventType: notification.type, ...(notification.context ? { stripeContext: String(notification.context) } : {}) });
      if (!ERROR_REPORT_EVENT_TYPES.has(notification.type)) {
        log.info('Stripe event ignored: not an error report');
        return reply.code(200).send({ received: true, eventId, handled: false });
      }
      if (await errorReportProcessed(deps.db, deps.schema, eventId)) {
        log.info('Stripe error report redelivered: already processed');
        return reply.code(200).send({ received: true, eventId, handled: true, duplicate: true });
      }

      let event: unknown;
      try {
        event = await notification.fetchEvent();
      } catch (err) {
        const failure = classifyStripeError(err);
        if (failure.kind === 'credentials') {
          // The API's own key, not Stripe, is at fault: said as such, and counted where a refused
          // worker key is (its alert fires), while Stripe keeps redelivering for a few days.
          deps.metrics?.stripeErrors?.inc({ class: 'credentials' });
          throw new ApiError(
            503,
            'stripe_credentials_refused',
            `Stripe refused this API's STRIPE_API_KEY reading event ${eventId} (${failure.code}: expired, rolled, or a restricted key without permission to read events); fix the key before Stripe stops redelivering it`,
          );
        }
        throw new ApiError(503, 'stripe_unavailable', `could not fetch event ${eventId} from Stripe (${scrub((err as Error).message)}); Stripe will redeliver it`);
      }
      const report = parseErrorReport(event);
      if (report.eventId !== eventId) throw new ApiError(502, 'stripe_mismatch', `Stripe returned event ${report.eventId || '(no id)'} for ${eventId}`);

      const outcome = await recordErrorReport(deps.db, deps.schema, report, storable(obj(event)));
      if (!outcome.duplicate) {
        for (const type of report.errorTypes) deps.metrics?.asyncRejections?.inc({ code: codes.of(type.code) }, type.errorCount);
        log.warn(
          {
            meterId: report.meterId,
            errorCount: report.errorCount,
            codes: report.errorTypes.map((t) => ({ code: t.code, errorCount: t.errorCount })),
            markedRejected: outcome.marked,
            namedNotSent: outcome.notSent,
            unknownIdentifiers: outcome.unknown,
            unmatched: outcome.unmatched,
            validationStart: report.validationStart,
            validationEnd: report.validationEnd,
          },
          `Stripe rejected ${report.errorCount} meter event(s) after accepting them: ${outcome.marked.length} row(s) marked rejected_async, ` +
            `${outcome.unmatched} not matched to a row. Stripe names only a sample of the failed events, so more events than those ` +
            'named may be affected: reconcile the period (billing-outbox reconcile).',
        );
        if (deps.tellRun && outcome.markedDead.length > 0) void tellRuns(deps.tellRun, outcome.markedDead, log);
      } else {
        log.info('Stripe error report redelivered: already processed');
      }
      return reply.code(200).send({
        received: true,
        eventId,
        handled: true,
        duplicate: outcome.duplicate,
        errorCount: outcome.errorCount,
        matched: outcome.matched,
        marked: outcome.marked.length,
        unmatched: outcome.unmatched,
      });
    });
  });
}
