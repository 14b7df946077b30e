/**
 * Every error the API answers with has one shape, `{ error: { code, message, fields? } }`, and is
 * decided here: our own ApiErrors, Fastify's validation and body-parsing errors, and the typed
 * errors of recordUsage.
 */
import type { FastifyError, FastifyReply, FastifyRequest } from 'fastify';
import { InvalidUsageError, UnknownTenantError, UsageConflictError, UsageError } from '../outbox/errors.js';
import { ConnectWaitError, isDatabaseUnavailable } from '../db.js';
import { plainError } from './request-log.js';

export interface FieldError {
  field: string;
  message: string;
}

export interface ErrorBody {
  error: { code: string; message: string; fields?: FieldError[] };
}

export class ApiError extends Error {
  readonly statusCode: number;
  readonly code: string;
  readonly fields?: FieldError[];
  readonly headers: Record<string, string>;
  constructor(
    statusCode: number,
    code: string,
    message: string,
    fields?: FieldError[],
    headers: Record<string, string> = {},
  ) {
    super(message);
    this.statusCode = statusCode;
    this.code = code;
    this.fields = fields;
    this.headers = headers;
    this.name = 'ApiError';
  }
}

/** recordUsage names fields as in code; the API names them as in the request body. */
const BODY_FIELD: Record<string, string> = {
  usageId: 'usage_id',
  tenantId: 'tenant_id',
  quantity: 'quantity',
  eventName: 'event_name',
  occurredAt: 'occurred_at',
};

type AjvError = NonNullable<FastifyError['validation']>[number];

function describe(e: AjvError): FieldError {
  const p = e.params as Record<string, unknown>;
  const path = e.instancePath.replace(/^\//, '').replace(/\//g, '.');
  switch (e.keyword) {
    case 'required':
      return { field: String(p.missingProperty), message: 'is required' };
    case 'additionalProperties':
      return { field: String(p.additionalProperty), message: 'is not a known field' };
    case 'type': {
      const type = String(p.type);
      const noun = type === 'object' ? 'JSON object' : type;
      const article = /^[aeiou]/.test(noun) ? 'an' : 'a';
      return { field: path || '(body)', message: `must be ${article} ${noun}` };
    }
    case 'minimum':
      return { field: path, message: `must be at least ${String(p.limit)}` };
    case 'maximum':
      return { field: path, message: `must be at most ${String(p.limit)}` };
    case 'minLength':
      return { field: path, message: 'must not be empty' };
    case 'maxLength':
      return { field: path, message: `must be at most ${String(p.limit)} characters` };
    case 'format':
      return { field: path, message: 'must be an RFC 3339 date-time with a time zone, e.g. 2025-01-31T12:00:00Z' };
    default:
      return { field: path || '(body)', message: e.message ?? 'is invalid' };
  }
}

/** One message per field (with allErrors, Ajv may report a field more than once). */
export function validationFields(errors: AjvError[]): FieldError[] {
  const byField = new Map<string, FieldError>();
  for (const e of errors) {
    const f = describe(e);
    if (!byField.has(f.field)) byField.set(f.field, f);
  }
  return [...byField.values()];
}


function toApiError(err: unknown): ApiError | undefined {
  if (err instanceof ApiError) return err;
  if (err instanceof InvalidUsageError) {
    const field = BODY_FIELD[err.field ?? ''] ?? err.field ?? '(body)';
    return new ApiError(400, 'invalid_request', `${field}: ${err.reason}`, [{ field, message: err.reason }]);
  }
  if (err instanceof UnknownTenantError) return new ApiError(422, 'unknown_tenant', err.message);
  if (err instanceof UsageConflictError || err instanceof UsageError) return new ApiError(409, err.code, err.message);
  const fe = err as Partial<FastifyError>;
  if (fe.validation) {
    const fields = validationFields(fe.validation);
    return new ApiError(400, 'invalid_request', fields.map((f) => `${f.field}: ${f.message}`).join('; '), fields);
  }
  switch (fe.code) {
    case 'FST_ERR_CTP_BODY_TOO_LARGE':
      return new ApiError(413, 'payload_too_large', 'the request body is larger than the configured limit');
    case 'FST_ERR_CTP_INVALID_MEDIA_TYPE':
      return new ApiError(415, 'unsupported_media_type', 'send the body as application/json');
    case 'FST_ERR_CTP_EMPTY_JSON_BODY':
    case 'FST_ERR_CTP_INVALID_JSON_BODY':
      return new ApiError(400, 'invalid_json', 'the body is not valid JSON');
  }
  if (typeof fe.statusCode === 'number' && fe.statusCode >= 400 && fe.statusCode < 500) {
    return new ApiError(fe.statusCode, fe.statusCode === 429 ? 'rate_limited' : 'bad_request', fe.message ?? 'bad request');
  }
  if (err instanceof ConnectWaitError) {
    return new ApiError(503, 'busy', `${err.message}; retry with the same usage_id`, undefined, { 'retry-after': '1' });
  }
  if (isDatabaseUnavailable(err)) {
    return new ApiError(503, 'unavailable', 'the database is unavailable; retry with the same usage_id', undefined, { 'retry-after': '5' });
  }
  // A status the application's own hooks gave the error on our route (the plugin: a load shedder's
  // 503, a gateway's 504): kept, with any header they set (Retry-After), not turned into a 500.
  if (typeof fe.statusCode === 'number' && fe.statusCode > 500 && fe.statusCode < 600) {
    return new ApiError(fe.statusCode, fe.statusCode === 503 ? 'unavailable' : 'server_error', `${fe.message ?? 'unavailable'}; retry with the same usage_id`);
  }
  return undefined;
}

export function errorHandler(err: unknown, request: FastifyRequest, reply: FastifyReply): FastifyReply {
  const api = toApiError(err);
  if (!api) {
    request.log.error({ error: plainError(err) }, 'request failed');
    return reply.code(500).send({ error: { code: 'internal_error', message: 'internal error' } } satisfies ErrorBody);
  }
  if (api.statusCode >= 500) request.log.warn({ error: plainError(err) }, api.message);
  const body: ErrorBody = { error: { code: api.code, message: api.message, ...(api.fields ? { fields: api.fields } : {}) } };
  return reply.code(api.statusCode).headers(api.headers).send(body);
}
