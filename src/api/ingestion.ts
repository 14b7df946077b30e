/**
 * POST /v1/usage with everything that makes its answers what they are, in one encapsulated Fastify
 * context: the bearer token and scope (checked before the body is read), the strict JSON parser,
 * JSON Schema without coercion, the error handler. The standalone API (buildApi) and the plugin an
 * application registers on its own server (src/fastify.ts) both mount it, so both answer alike; in
 * an application's server none of it reaches the application's own routes, parsers or handlers.
 */
import { AjvCompiler } from '@fastify/ajv-compiler';
import type { FastifyInstance } from 'fastify';
import type pg from 'pg';
import type { ApiToken } from '../config.js';
import type { MeterCatalog } from '../stripe/meters.js';
import { authenticate, requireScope, TokenVerifier } from './auth.js';
import { errorHandler } from './errors.js';
import { useStrictJson } from './json-body.js';
import { registerUsageRoutes } from './usage.js';

export interface IngestionDeps {
  db: pg.Pool;
  /** The PostgreSQL schema billing-outbox's tables are in. */
  schema: string;
  tokens: readonly ApiToken[];
  defaultEventName: string;
  bodyLimitBytes: number;
  /** Stripe's meters, to refuse usage for a meter that does not exist; unchecked without it. */
  meters?: Pick<MeterCatalog, 'keysFor' | 'known'> | undefined;
  /** How long a request waits for its tenant's turn at a connection of `db` before a 503 (default 5 s). */
  turnWaitMs?: number | undefined;
  /** False: statements go unnamed (withoutPreparedStatements), for a pooler that cannot keep named ones. */
  preparedStatements?: boolean | undefined;
}

// Fastify's defaults coerce "5" into 5 and silently drop unknown fields; an ingestion API must
// refuse both, and report every bad field at once. Our own compiler, whatever the server's Ajv says.
export const STRICT_AJV = { coerceTypes: false, removeAdditional: false, useDefaults: false, allErrors: true } as const;
const strictValidator = AjvCompiler()({}, { customOptions: STRICT_AJV });

export async function ingestion(scope: FastifyInstance, deps: IngestionDeps): Promise<void> {
  const verifier = new TokenVerifier(deps.tokens);
  scope.setValidatorCompiler(strictValidator);
  // Strict JSON only. Fastify hands a plugin the application's parsers too: text/plain would reach
  // validation as a string (400, not 415), and a lenient parser of the application's own (a vendor
  // JSON type) would take duplicate keys and 1e3 that the strict one refuses.
  scope.removeAllContentTypeParsers();
  useStrictJson(scope);
  scope.setErrorHandler(errorHandler);
  if (!scope.hasRequestDecorator('billingOutboxToken')) scope.decorateRequest('billingOutboxToken', null);

  scope.addHook('onRequest', async (request, reply) => {
    reply.header('x-request-id', request.id);
    // Checked here on every request, whatever a hook before this one set: on an application's
    // server nothing else authenticates for us. (The standalone API has checked the same token at
    // its root already: the same token found again, its log line is not labelled twice.)
    const token = authenticate(verifier, request);
    if (request.billingOutboxToken !== token) {
      request.billingOutboxToken = token;
      const log = request.log.child({ tokenName: token.name });
      request.log = log;
      reply.log = log;
    }
    const scopeNeeded = request.routeOptions.config.scope;
    if (scopeNeeded) requireScope(token, scopeNeeded);
  });

  registerUsageRoutes(scope, deps);
}
