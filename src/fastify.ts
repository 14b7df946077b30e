/**
 * billing-outbox/fastify: the HTTP ingestion route (POST /v1/usage) as a plugin for an
 * application's own Fastify server, with the standalone API's bearer tokens, validation and answers.
 *
 *   import billingOutbox from 'billing-outbox/fastify';
 *   await app.register(billingOutbox, { prefix: '/billing', pool, tokens: [{ name, token, tenants: ['*'], scopes: ['usage:write'] }] });
 *
 * Encapsulated: its token check, JSON parser, validator and error handler apply to its route only;
 * the application's routes, parsers, hooks and error handler are left as they were. The pool is the
 * application's: used (through billing-outbox's own type parsers), never ended. Timeouts of the
 * server itself (request, headers, keep-alive) are the application's to set; see src/api/index.ts
 * for the standalone API's.
 */
import type { FastifyInstance, FastifyPluginAsync } from 'fastify';
import type pg from 'pg';
import { ingestion } from './api/ingestion.js';
import { ConfigError, loadConfig, type ApiToken } from './config.js';
import { HEARS_NO_ERRORS, hearsNoErrors, OPENS_WITHOUT_LIMIT, opensWithoutLimit, withPgTypes } from './db.js';
import { createStripeClient, requireStripeKey } from './stripe/client.js';
import { MeterCatalog } from './stripe/meters.js';

export { ConfigError };
export type { ApiToken };

export interface BillingOutboxPluginOptions {
  /** The application's pool; each usage is recorded in a transaction of its own on it. */
  pool: pg.Pool;
  /** Bearer tokens, as API_TOKENS: a name (logged instead of the token), the token (24+ characters), tenants (["*"]: all), scopes (usage:write). */
  tokens: ApiToken[];
  /** The meter of usage posted without event_name (default api_requests). */
  meterEventName?: string;
  /** The PostgreSQL schema billing-outbox's tables are in (default billing_outbox): the one you migrated. */
  schema?: string;
  /** Largest body accepted, in bytes (default 65536). */
  bodyLimitBytes?: number;
  /** With it, usage for a meter Stripe does not have is refused (422); without it, not checked at the door. */
  stripe?: { apiKey: string; apiBase?: string };
  /**
   * False when the pool goes through a transaction pooler that cannot keep named prepared
   * statements (PgBouncer before 1.21, or `max_prepared_statements = 0`): statements go unnamed.
   */
  preparedStatements?: boolean;
}

const KNOWN = ['pool', 'tokens', 'meterEventName', 'schema', 'bodyLimitBytes', 'stripe', 'preparedStatements', 'prefix', 'logLevel', 'logSerializers'];

/** Checks the options as the standalone API checks its environment; throws ConfigError naming each bad one. */
function resolve(opts: BillingOutboxPluginOptions) {
  const problems: string[] = [];
  for (const key of Object.keys(opts)) if (!KNOWN.includes(key)) problems.push(`${key}: is not an option of the billing-outbox plugin`);
  if (!opts.pool || typeof opts.pool.connect !== 'function') problems.push("pool: is required (the application's pg.Pool)");
  if (!Array.isArray(opts.tokens) || opts.tokens.length === 0) problems.push('tokens: is required: at least one { name, token, tenants, scopes }');
  if (opts.preparedStatements !== undefined && typeof opts.preparedStatements !== 'boolean') problems.push('preparedStatements: must be true or false');
  const env: Record<string, string> = {
    API_TOKENS: JSON.stringify(opts.tokens ?? []),
    ...(opts.meterEventName === undefined ? {} : { STRIPE_METER_EVENT_NAME: String(opts.meterEventName) }),
    ...(opts.schema === undefined ? {} : { DATABASE_SCHEMA: String(opts.schema) }),
    ...(opts.bodyLimitBytes === undefined ? {} : { API_BODY_LIMIT_BYTES: String(opts.bodyLimitBytes) }),
    ...(opts.stripe?.apiKey === undefined ? {} : { STRIPE_API_KEY: String(opts.stripe.apiKey) }),
    ...(opts.stripe?.apiBase === undefined ? {} : { STRIPE_API_BASE: String(opts.stripe.apiBase) }),
  };
  const names: Record<string, string> = {
    API_TOKENS: 'tokens',
    STRIPE_METER_EVENT_NAME: 'meterEventName',
    DATABASE_SCHEMA: 'schema',
    API_BODY_LIMIT_BYTES: 'bodyLimitBytes',
    STRIPE_API_KEY: 'stripe.apiKey',
    STRIPE_API_BASE: 'stripe.apiBase',
  };
  // The problems as the options' names, not the variables' the standalone API reads.
  const variable = new RegExp(`\\b(${Object.keys(names).join('|')})\\b`, 'g');
  const asOptions = (check: () => void): void => {
    try {
      check();
    } catch (err) {
      if (!(err instanceof ConfigError)) throw err;
      problems.push(...err.problems.map((p) => p.replace(variable, (v) => names[v] ?? v)));
    }
  };
  let config: ReturnType<typeof loadConfig> | undefined;
  asOptions(() => (config = loadConfig(env)));
  // Without a key, Stripe refuses every meter read: the check at the door would let every meter in,
  // each request after waiting for a read.
  if (config && opts.stripe) asOptions(() => requireStripeKey(config!.stripe, 'the meter check at the door (`stripe`)'));
  if (problems.length > 0 || !config) throw new ConfigError(problems);
  return {
    // The route's statements each take milliseconds: one unanswered for 5 s is a connection gone
    // silent (a failover), answered 503 as the standalone API does, and dropped from the pool.
    db: withPgTypes(opts.pool, { answerMs: config.timings.statementAnswerMs }),
    schema: config.databaseSchema,
    tokens: config.api.tokens,
    defaultEventName: config.stripe.meterEventName,
    bodyLimitBytes: config.api.bodyLimitBytes,
    meters: opts.stripe ? new MeterCatalog(createStripeClient(config.stripe)) : undefined,
    preparedStatements: opts.preparedStatements !== false,
  };
}

/** Register it with `app.register(billingOutbox, { prefix, pool, tokens })`; POST <prefix>/v1/usage. */
export const billingOutbox: FastifyPluginAsync<BillingOutboxPluginOptions> = async (scope: FastifyInstance, opts: BillingOutboxPluginOptions) => {
  const resolved = resolve(opts);
  if (opensWithoutLimit(opts.pool)) scope.log.warn(OPENS_WITHOUT_LIMIT);
  if (hearsNoErrors(opts.pool)) scope.log.warn(HEARS_NO_ERRORS);
  await ingestion(scope, resolved);
};

export default billingOutbox;
