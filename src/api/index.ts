/**
 * The HTTP ingestion API: POST /v1/usage, GET /health, GET /metrics, and POST /v1/stripe/webhooks
 * (Stripe's asynchronous error reports; signed by Stripe instead of a bearer token, see webhooks.ts).
 *
 * POST /v1/usage is the ingestion plugin (ingestion.ts), the one applications register on their
 * own server (billing-outbox/fastify). `buildApi` returns a Fastify instance that is not listening (tests use `app.inject()`;
 * src/bin/api.ts and src/embedded/stack.ts call `listen`). Request order: request id → bearer token and
 * route scope (before the body is read, so an unauthenticated client cannot make us parse
 * anything) → content type and body limit → JSON Schema → tenant → recordUsage.
 */
import { randomUUID } from 'node:crypto';
import type { Socket } from 'node:net';
import Fastify, { type FastifyBaseLogger, type FastifyRequest } from 'fastify';
import type pg from 'pg';
import { Registry } from 'prom-client';
import type { ApiScope, ApiToken, Config } from '../config.js';
import type { Logger } from '../log.js';
import { createMetrics, type Metrics } from '../metrics.js';
import type { MeterCatalog } from '../stripe/meters.js';
import { authenticate, requireScope, TokenVerifier } from './auth.js';
import { ApiError, errorHandler } from './errors.js';
import { useStrictJson } from './json-body.js';
import { checkHealth, oneProbeAtATime, type TemporalHealth } from './health.js';

export { temporalHealthConnection } from './health.js';
import { RequestLogController } from './request-log.js';
import { ingestion, STRICT_AJV } from './ingestion.js';
import { registerWebhookRoutes, rowChangedTeller, type WebhookStripe } from './webhooks.js';
import { TURN_WAIT_MS } from './usage.js';
import { schemaFor } from '../outbox/sql/schema.js';

declare module 'fastify' {
  interface FastifyContextConfig {
    /** The scope a token needs for this route. */
    scope?: ApiScope;
    /** No token needed (health checks). */
    public?: boolean;
  }
  interface FastifyRequest {
    /**
     * The caller's token as billing-outbox authenticated it (null on public routes). A name of our
     * own: an application's `apiToken` on the same request is not ours, and never trusted as ours.
     */
    billingOutboxToken: ApiToken | null;
  }
}

export interface ApiDeps {
  /** `stripe` whole: the webhook route verifies with its secret and fetches events with its client. */
  config: Pick<Config, 'databaseSchema' | 'stripe'> & { api: Pick<Config['api'], 'bodyLimitBytes' | 'tokens' | 'requestTimeoutMs' | 'keepAliveTimeoutMs'> };
  db: pg.Pool;
  log: Logger;
  /** For /health (see temporalHealthConnection); without it Temporal is `not_configured`. */
  temporal?: TemporalHealth;
  /** The process's registry for /metrics; by default one of the API's own, reading `db`. */
  metrics?: Pick<Metrics, 'render' | 'contentType'> & Partial<Pick<Metrics, 'asyncRejections' | 'stripeErrors'>>;
  /** For the webhook route (tests); by default a client built from `config.stripe`. */
  stripe?: WebhookStripe;
  /** Stripe's meters, to refuse usage for a meter that does not exist; unchecked without it. */
  meters?: Pick<MeterCatalog, 'keysFor' | 'known'>;
  /** How long a usage request waits for its tenant's turn at a database connection before a 503 (default 5 s). */
  turnWaitMs?: number;
  /** How long /health waits for each dependency (default 2 s). */
  healthTimeoutMs?: number;
}

// Printable, header-safe, short: anything else from the outside is replaced, never logged as is.
const SANE_REQUEST_ID = /^[A-Za-z0-9._:@/+=-]{1,64}$/;

export function buildApi(deps: ApiDeps) {
  const verifier = new TokenVerifier(deps.config.api.tokens);
  const schema = schemaFor(deps.config.databaseSchema);
  const metrics = deps.metrics ?? createMetrics(new Registry(), { db: deps.db, schema, worker: false });
  const healthTimeoutMs = deps.healthTimeoutMs ?? 2_000;

  const app = Fastify({
    // Typed as Fastify's base logger so route modules take a plain FastifyInstance.
    loggerInstance: deps.log as FastifyBaseLogger,
    bodyLimit: deps.config.api.bodyLimitBytes,
    // A client that promises more than it sends, or sends it slowly, must not hold a connection
    // (and a slot of the pool behind it) forever: the whole request within requestTimeoutMs, an
    // idle socket closed after it too (but not while its request is handled: below), an idle
    // kept-alive connection after keepAliveTimeoutMs.
    requestTimeout: deps.config.api.requestTimeoutMs,
    connectionTimeout: deps.config.api.requestTimeoutMs,
    // Node enforces the request timeout only when it sweeps its connections, every 30 s by default:
    // a body trickled a byte at a time then outlived a 10 s limit by up to 30 s (and 80 s under
    // many such connections). Swept every tenth of the limit (1 s at most), the limit holds to
    // within that. Headers get the same limit (Node's default is 60 s).
    http: {
      connectionsCheckingInterval: Math.min(1_000, Math.max(50, Math.floor(deps.config.api.requestTimeoutMs / 10))),
      headersTimeout: deps.config.api.requestTimeoutMs,
      requestTimeout: deps.config.api.requestTimeoutMs,
    },
    keepAliveTimeout: deps.config.api.keepAliveTimeoutMs,
    genReqId: (req) => {
      const incoming = req.headers['x-request-id'];
      return typeof incoming === 'string' && SANE_REQUEST_ID.test(incoming) ? incoming : randomUUID();
    },
    logController: new RequestLogController(),
    // The same Ajv as the ingestion route's (which sets its own), for every other route.
    ajv: { customOptions: STRICT_AJV },
    return503OnClosing: true,
  });

  // JSON only: a text/plain body would otherwise reach validation as a string (400, not 415).
  app.removeContentTypeParser('text/plain');
  useStrictJson(app);
  app.decorateRequest('billingOutboxToken', null);
  app.setErrorHandler(errorHandler);
  app.setNotFoundHandler((request) => {
    // The path is not echoed: whatever a client put in it (a token pasted in the wrong place) stays out
    // of the answer and, through it, out of the log.
    throw new ApiError(404, 'not_found', `no route for ${request.method} at this path`);
  });

  // The socket idle timeout also runs while a request is handled, when no byte moves: a usage
  // whose handling (the meter check, its tenant's turn, its statements) outlasted it had its
  // connection reset, and was then recorded with no answer. A socket idle while its request is
  // handled is left open; one idle otherwise is closed, as Node does when nobody listens.
  // Counted per socket: a pipelined request is handled while the one before it is answered.
  const handling = new WeakMap<Socket, number>();
  app.server.on('timeout', (socket: Socket) => {
    if (!handling.get(socket)) socket.destroy();
  });
  app.addHook('onRequest', async (request) => {
    handling.set(request.raw.socket, (handling.get(request.raw.socket) ?? 0) + 1);
  });
  const handled = async (request: FastifyRequest) => {
    const left = (handling.get(request.raw.socket) ?? 1) - 1;
    if (left > 0) handling.set(request.raw.socket, left);
    else handling.delete(request.raw.socket);
  };
  app.addHook('onResponse', handled);
  app.addHook('onRequestAbort', handled);

  app.addHook('onRequest', async (request, reply) => {
    reply.header('x-request-id', request.id);
    const routeConfig = request.routeOptions.config;
    if (routeConfig.public) return;
    const token = authenticate(verifier, request);
    request.billingOutboxToken = token;
    const log = request.log.child({ tokenName: token.name });
    request.log = log;
    reply.log = log;
    if (routeConfig.scope) requireScope(token, routeConfig.scope);
  });

  void app.register(ingestion, {
    db: deps.db,
    schema: schema.name,
    tokens: deps.config.api.tokens,
    defaultEventName: deps.config.stripe.meterEventName,
    bodyLimitBytes: deps.config.api.bodyLimitBytes,
    meters: deps.meters,
    // Within the request's own limit (API_REQUEST_TIMEOUT_MS): a request still waiting when its
    // socket is dropped would run for nobody.
    turnWaitMs: deps.turnWaitMs ?? Math.min(TURN_WAIT_MS, Math.floor(deps.config.api.requestTimeoutMs / 2)),
  });
  registerWebhookRoutes(app, {
    db: deps.db,
    schema,
    config: deps.config.stripe,
    metrics,
    ...(deps.stripe ? { stripe: deps.stripe } : {}),
    ...(deps.temporal ? { tellRun: rowChangedTeller(deps.temporal) } : {}),
  });

  const health = oneProbeAtATime(() => checkHealth({ db: deps.db, temporal: deps.temporal, log: app.log }, healthTimeoutMs));
  app.get('/health', { config: { public: true } }, async (_request, reply) => {
    const body = await health();
    return reply.code(body.status === 'ok' ? 200 : 503).send(body);
  });

  app.get('/metrics', { config: { scope: 'metrics:read' } }, async (_request, reply) => {
    return reply.type(metrics.contentType).send(await metrics.render());
  });

  return app;
}

export type Api = ReturnType<typeof buildApi>;
