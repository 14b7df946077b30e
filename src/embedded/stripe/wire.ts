/**
 * Stripe's wire format: form-encoded request bodies with bracketed keys (v1; v2 sends JSON), JSON
 * responses, errors as `{ error: { type, code?, message, param?, doc_url? } }` in both versions
 * (stripe-node picks a v2 error class by `type`, then `code`, then falls back to v1's choice by
 * status), and the ids and headers every answer has.
 */
import { randomBytes } from 'node:crypto';
import type { IncomingMessage, ServerResponse } from 'node:http';

export type FormValue = string | FormObject;
export interface FormObject {
  [key: string]: FormValue;
}

/**
 * Decodes a v1 request body. Stripe nests parameters with brackets: `payload[value]=3` means
 * `{ payload: { value: '3' } }` (arrays arrive as `expand[0]=…`, i.e. numeric keys).
 */
export function parseStripeForm(raw: string): FormObject {
  const root: FormObject = {};
  for (const [key, value] of new URLSearchParams(raw)) {
    assignPath(root, bracketPath(key), value);
  }
  return root;
}

function bracketPath(key: string): string[] {
  const open = key.indexOf('[');
  if (open === -1) return [key];
  const segments = [key.slice(0, open)];
  for (const match of key.slice(open).matchAll(/\[([^\]]*)\]/g)) segments.push(match[1] ?? '');
  return segments;
}

function assignPath(root: FormObject, path: string[], value: string): void {
  const last = path[path.length - 1];
  if (last === undefined) return;
  let node = root;
  for (const segment of path.slice(0, -1)) {
    const child = node[segment];
    if (typeof child === 'object') {
      node = child;
    } else {
      const created: FormObject = {};
      node[segment] = created;
      node = created;
    }
  }
  node[last] = value;
}

/** A v2 request body: JSON. An empty body is an empty object (what a call without parameters sends). */
export type JsonBody = { ok: true; value: unknown } | { ok: false; error: string };

export function parseJsonBody(raw: string): JsonBody {
  if (raw.trim() === '') return { ok: true, value: {} };
  try {
    return { ok: true, value: JSON.parse(raw) as unknown };
  } catch (error) {
    return { ok: false, error: error instanceof Error ? error.message : String(error) };
  }
}

/** A string parameter, or undefined when absent or nested. */
export function stringParam(form: FormObject, name: string): string | undefined {
  const value = form[name];
  return typeof value === 'string' ? value : undefined;
}

/** A nested parameter (`payload[...]`), or an empty object when absent. */
export function objectParam(form: FormObject, name: string): FormObject {
  const value = form[name];
  return typeof value === 'object' ? value : {};
}

/** The string leaves of a nested parameter; nested values deeper down are dropped. */
export function flatStrings(form: FormObject): Record<string, string> {
  const out: Record<string, string> = {};
  for (const [key, value] of Object.entries(form)) {
    if (typeof value === 'string') out[key] = value;
  }
  return out;
}

/** Stable text of a parameter tree, for comparing the parameters of two requests. */
export function canonicalParams(form: FormObject): string {
  const sorted = (node: FormValue): unknown =>
    typeof node === 'string'
      ? node
      : Object.fromEntries(Object.keys(node).sort().map((k) => [k, sorted(node[k] ?? '')]));
  return JSON.stringify(sorted(form));
}

export interface StripeErrorBody {
  type: string;
  code?: string;
  message: string;
  param?: string;
  doc_url?: string;
}

/** What a handler answers; the server turns it into an HTTP response. */
export interface ApiResponse {
  status: number;
  body: unknown;
  headers?: Record<string, string>;
  /**
   * A refusal the endpoint made while executing (a business rule, not a malformed request): Stripe
   * keeps it under the request's Idempotency-Key and replays it, as it does a 200.
   */
  executed?: boolean;
}

export function json(body: unknown, status = 200, headers?: Record<string, string>): ApiResponse {
  return { status, body, headers };
}

export function stripeError(status: number, error: StripeErrorBody, headers?: Record<string, string>): ApiResponse {
  const withDoc = error.code && !error.doc_url ? { ...error, doc_url: docUrl(error.code) } : error;
  return { status, body: { error: withDoc }, headers };
}

function docUrl(code: string): string {
  return `https://stripe.com/docs/error-codes/${code.replaceAll('_', '-')}`;
}

/** The common 400. */
export function invalidRequest(message: string, param?: string, code?: string): ApiResponse {
  return stripeError(400, { type: 'invalid_request_error', message, ...(code ? { code } : {}), ...(param ? { param } : {}) });
}

export function missingParam(param: string): ApiResponse {
  return invalidRequest(`Missing required param: ${param}.`, param, 'parameter_missing');
}

export function unknownParams(form: FormObject, allowed: readonly string[]): ApiResponse | undefined {
  const unknown = Object.keys(form).find((key) => !allowed.includes(key));
  return unknown === undefined
    ? undefined
    : invalidRequest(`Received unknown parameter: ${unknown}`, unknown, 'parameter_unknown');
}

export function notFound(message: string, param?: string): ApiResponse {
  return stripeError(404, { type: 'invalid_request_error', code: 'resource_missing', message, ...(param ? { param } : {}) });
}

export function list<T extends { id: string }>(items: T[], url: string, query: URLSearchParams): ApiResponse {
  const page = paginate(items, query);
  if ('status' in page) return page;
  return json({ object: 'list', data: page.data, has_more: page.hasMore, url });
}

/**
 * Stripe's cursor pagination: `limit` 1–100 (default 10) and `starting_after` = the id of the last
 * object of the previous page. `ending_before` is not needed by anything here.
 */
function paginate<T extends { id: string }>(items: T[], query: URLSearchParams): { data: T[]; hasMore: boolean } | ApiResponse {
  const rawLimit = query.get('limit');
  const limit = rawLimit === null ? 10 : Number(rawLimit);
  if (!Number.isInteger(limit) || limit < 1 || limit > 100) {
    return invalidRequest('This value must be between 1 and 100 (it currently is ' + String(rawLimit) + ').', 'limit');
  }
  let start = 0;
  const after = query.get('starting_after');
  if (after !== null) {
    const index = items.findIndex((item) => item.id === after);
    if (index === -1) return notFound(`No such object: '${after}'`, 'starting_after');
    start = index + 1;
  }
  const data = items.slice(start, start + limit);
  return { data, hasMore: start + limit < items.length };
}

/** Random id with Stripe's look: a prefix and base62 characters. */
export function newId(prefix: string, length = 14): string {
  const alphabet = 'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789';
  const bytes = randomBytes(length);
  let out = '';
  for (const byte of bytes) out += alphabet[byte % alphabet.length];
  return `${prefix}_${out}`;
}

const MAX_BODY_BYTES = 1024 * 1024;

export async function readBody(req: IncomingMessage): Promise<string> {
  const chunks: Buffer[] = [];
  let size = 0;
  for await (const chunk of req) {
    const buffer = chunk as Buffer;
    size += buffer.length;
    if (size > MAX_BODY_BYTES) throw new Error('request body too large');
    chunks.push(buffer);
  }
  return Buffer.concat(chunks).toString('utf8');
}

export function writeResponse(res: ServerResponse, response: ApiResponse, headers: Record<string, string>): void {
  const body = JSON.stringify(response.body, null, 2);
  res.writeHead(response.status, {
    'content-type': 'application/json',
    'content-length': Buffer.byteLength(body),
    ...headers,
    ...response.headers,
  });
  res.end(body);
}

/** A 200 whose body stops half-way through its JSON. */
export function writeGarbled(res: ServerResponse): void {
  const body = '{"object": "billing.meter_event", "event_na';
  res.writeHead(200, { 'content-type': 'application/json', 'content-length': Buffer.byteLength(body) });
  res.end(body);
}

export function headerValue(req: IncomingMessage, name: string): string | null {
  const value = req.headers[name.toLowerCase()];
  if (Array.isArray(value)) return value[0] ?? null;
  return value ?? null;
}
