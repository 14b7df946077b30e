/**
 * POST /v1/usage: records one usage and queues its meter event in one transaction (recordUsage).
 * Repeating a request is safe: the usage_id is the idempotency key.
 */
import type { FastifyInstance, FastifyReply, FastifyRequest } from 'fastify';
import type { IngestionDeps } from './ingestion.js';
import { withTransaction } from '../db.js';
import { withoutPreparedStatements } from '../outbox/adapters/unprepared.js';
import { recordUsage } from '../outbox/enqueue.js';
import { findEntryByKey } from '../outbox/sql/enqueue.js';
import { schemaFor } from '../outbox/sql/schema.js';
import { InvalidUsageError, type OutboxEntry } from '../outbox/errors.js';
import { idempotencyKeyFor } from '../outbox/keys.js';
import { inRequestSpan } from '../tracing.js';
import { DATE_TIME_PROBLEM, MAX_EVENT_NAME_LENGTH, MAX_QUANTITY, MAX_TENANT_ID_LENGTH, MAX_USAGE_ID_LENGTH, parseDateTime, validateUsage } from '../outbox/validate.js';
import type { MeterCatalog } from '../stripe/meters.js';
import { requireTenant } from './auth.js';
import { ApiError } from './errors.js';
import { TenantTurns } from './turns.js';

export interface UsageRequestBody {
  tenant_id: string;
  usage_id: string;
  quantity: number;
  event_name?: string;
  occurred_at?: string;
}

export interface UsageResponseBody {
  idempotency_key: string;
  status: string;
  tenant_id: string;
  usage_id: string;
  quantity: number;
  event_name: string;
  occurred_at: string;
  /** False when this usage_id was already recorded with the same values (nothing was added). */
  created: boolean;
}

// Types are not coerced and unknown fields are refused (see STRICT_AJV in ingestion.ts): "5" is
// not a quantity, and a misspelt `ocurred_at` must not silently become "now". recordUsage checks
// again what JSON Schema cannot (control characters, surrounding spaces, impossible dates).
export const usageBodySchema = {
  type: 'object',
  additionalProperties: false,
  required: ['tenant_id', 'usage_id', 'quantity'],
  properties: {
    tenant_id: { type: 'string', minLength: 1, maxLength: MAX_TENANT_ID_LENGTH },
    usage_id: { type: 'string', minLength: 1, maxLength: MAX_USAGE_ID_LENGTH },
    quantity: { type: 'integer', minimum: 1, maximum: MAX_QUANTITY },
    event_name: { type: 'string', minLength: 1, maxLength: MAX_EVENT_NAME_LENGTH },
    occurred_at: { type: 'string', format: 'date-time' },
  },
} as const;

function responseBody(entry: OutboxEntry, usageId: string, created: boolean): UsageResponseBody {
  return {
    idempotency_key: entry.idempotencyKey,
    status: entry.status,
    tenant_id: entry.tenantId,
    usage_id: usageId,
    quantity: entry.quantity,
    event_name: entry.eventName,
    occurred_at: entry.occurredAt.toISOString(),
    created,
  };
}

/** How long the door waits for Stripe's meter list before letting the usage in unchecked. */
const METER_CHECK_TIMEOUT_MS = 1_000;

/**
 * Whether Stripe has an active meter for `eventName`: false only when Stripe said so. If Stripe
 * cannot be asked (away, slow), the usage is let in: the worker checks again before sending, and
 * refusing usage because Stripe is down would lose it. Only a name the last read of the meter list
 * did not find waits for Stripe (METER_CHECK_TIMEOUT_MS at most): a known one is answered from
 * that read however old (refreshed behind the answer), so neither a Stripe outage nor the cache's
 * minute running out puts a wait on every request.
 */
async function meterMissing(meters: Pick<MeterCatalog, 'keysFor' | 'known'>, eventName: string): Promise<boolean> {
  switch (meters.known(eventName, METER_CHECK_TIMEOUT_MS)) {
    // Known; being replaced (its delivery waits for the new meter); or the list's last read failed
    // a moment ago (another would not be answered either).
    case 'active':
    case 'replacing':
    case 'unanswered':
      return false;
    // Stripe said so within the last second: that stands. Asking again would wait for the catalog's
    // pace (a read a second at most), past this timeout: a burst of one misspelt name would be let
    // in unchecked after its first request was refused, and die later as no_meter.
    case 'missing':
      return true;
    case 'ask':
      break;
  }
  let timer: NodeJS.Timeout | undefined;
  const unknown = new Promise<'unknown'>((resolve) => (timer = setTimeout(() => resolve('unknown'), METER_CHECK_TIMEOUT_MS)));
  try {
    const keys = await Promise.race([meters.keysFor(eventName).catch(() => 'unknown' as const), unknown]);
    // Read just now: none active, unless its meter is being replaced.
    return keys === undefined && meters.known(eventName, METER_CHECK_TIMEOUT_MS) !== 'replacing';
  } finally {
    clearTimeout(timer);
  }
}

/** How long a request waits for its tenant's turn and a database connection before a 503. */
export const TURN_WAIT_MS = 5_000;

export function registerUsageRoutes(
  app: FastifyInstance,
  deps: Omit<IngestionDeps, 'tokens'>,
): void {
  // One tenant's flood waits behind itself: the pool's connections go to the tenants in turn.
  const turns = new TenantTurns(deps.db.options.max ?? 10);
  app.post<{ Body: UsageRequestBody }>(
    '/v1/usage',
    { schema: { body: usageBodySchema }, config: { scope: 'usage:write' }, bodyLimit: deps.bodyLimitBytes },
    async (request: FastifyRequest<{ Body: UsageRequestBody }>, reply: FastifyReply) => {
      const body = request.body;
      const usage = {
        usageId: body.usage_id,
        tenantId: body.tenant_id,
        quantity: body.quantity,
        eventName: body.event_name,
        occurredAt: body.occurred_at === undefined ? undefined : parseDateTime(body.occurred_at),
      };
      // The schema's format check lets a leap second (23:59:60) through: no instant of ours, refused.
      if (body.occurred_at !== undefined && usage.occurredAt === undefined) throw new InvalidUsageError('occurredAt', DATE_TIME_PROBLEM);
      // The fields first (400, naming the field): a tenant_id with a hidden character is a bad
      // field, not another tenant (a scoped token heard 403), and an event_name with one is not a
      // meter Stripe lacks ("create the meter first" would send the caller the wrong way).
      const { eventName } = validateUsage(usage, deps.defaultEventName);
      requireTenant(request.billingOutboxToken!, body.tenant_id);
      // Every later line of this request, including Fastify's "request completed", carries the key.
      const key = idempotencyKeyFor(body.tenant_id, body.usage_id);
      const log = request.log.child({ idempotencyKey: key });
      request.log = log;
      reply.log = log;

      // New usage that names a meter Stripe does not have could never be billed: refused at the
      // door. Usage already recorded is answered as recorded whatever became of its meter since: a
      // client retrying a request that timed out after its 201 must not hear it was refused.
      const meterGone = deps.meters !== undefined && (await meterMissing(deps.meters, eventName));

      // The event's trace begins here (or in the caller's, by its traceparent header): the row keeps
      // this span's context. A no-op span unless the process registered an OpenTelemetry SDK.
      const { entry, created } = await inRequestSpan('POST /v1/usage', request.headers, key, async (span) => {
        // A connection by the deadline, in the tenant's turn, or 503 (ConnectWaitError).
        const connectBy = performance.now() + (deps.turnWaitMs ?? TURN_WAIT_MS);
        const release = await turns.enter(body.tenant_id, connectBy);
        try {
          const recorded = await withTransaction(
            deps.db,
            async (pooled) => {
              const client = deps.preparedStatements === false ? withoutPreparedStatements(pooled) : pooled;
              if (meterGone && !(await findEntryByKey(client, schemaFor(deps.schema), body.tenant_id, key))) {
                throw new ApiError(422, 'unknown_meter', `Stripe has no active meter for event_name ${JSON.stringify(eventName)}; create the meter first`);
              }
              return recordUsage(client, usage, { defaultEventName: deps.defaultEventName, schema: deps.schema });
            },
            { short: true, connectBy },
          );
          span.setAttribute('http.response.status_code', recorded.created ? 201 : 200);
          return recorded;
        } finally {
          release();
        }
      });
      log.info({ tenantId: entry.tenantId, quantity: entry.quantity, created, status: entry.status }, created ? 'usage recorded' : 'usage already recorded');
      return reply.code(created ? 201 : 200).send(responseBody(entry, body.usage_id, created));
    },
  );
}
