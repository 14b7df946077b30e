/**
 * Control API (`/_local/*`) for processes that cannot call LocalStripe's methods directly: the demo
 * and tests that run the main job as a separate process. Plain JSON, no API key, processes on this
 * machine only (`refusal`). It is not part of Stripe and `refuseFor` never blocks it.
 */
import type { IncomingMessage, ServerResponse } from 'node:http';
import type { WebhookDelivery } from './error-reports.js';
import type { FaultRequest, FaultState, MeterFormula, MeterInfo, MeterKeyOptions, RecordedMeterEvent, RequestRecord, StreamRequestRecord } from './types.js';
import { headerValue, readBody } from './wire.js';

/** The LocalStripe methods the control API drives. */
export interface ControlTarget {
  events(): RecordedMeterEvent[];
  requests(): RequestRecord[];
  streamRequests(): StreamRequestRecord[];
  meters(): MeterInfo[];
  webhookDeliveries(): WebhookDelivery[];
  maxConcurrencySeen(customer: string, eventName: string): number;
  applyFaults(request: FaultRequest): void;
  faultState(): FaultState;
  heal(): void;
  reset(): void;
  addCustomer(id: string): void;
  addMeter(eventName: string, keys?: MeterKeyOptions): string;
  flushStream(): void;
  flushAsyncErrors(): Promise<void>;
  advanceClock(ms: number): number;
}

class BadRequest extends Error {}

const LOOPBACK = new Set(['127.0.0.1', '::1', '::ffff:127.0.0.1']);
const LOOPBACK_HOSTS = new Set(['127.0.0.1', 'localhost', '[::1]']);

/**
 * Who may drive it: a process on this machine, not a web page open in the developer's browser.
 * Loopback peers only; addressed to a loopback name (a page whose own name resolves to 127.0.0.1,
 * DNS rebinding, sends its name as Host); and no change from a browser (every browser POST carries
 * Origin; our processes and curl send none). Opening `/_local/events` in the browser still works.
 */
function refusal(req: IncomingMessage): string | undefined {
  if (!LOOPBACK.has(req.socket.remoteAddress ?? '')) return 'the control API only answers loopback clients';
  const host = (req.headers.host ?? '').replace(/:\d+$/, '').toLowerCase();
  if (!LOOPBACK_HOSTS.has(host)) return 'the control API only answers requests addressed to 127.0.0.1, localhost or [::1]';
  if (req.method !== 'GET' && req.headers.origin !== undefined) return 'the control API takes no changes from a web page (the request carries Origin)';
  return undefined;
}

export async function handleControl(target: ControlTarget, req: IncomingMessage, res: ServerResponse, url: URL): Promise<void> {
  const refused = refusal(req);
  if (refused) {
    send(res, 403, { error: refused });
    return;
  }
  try {
    const body = req.method === 'POST' ? await readJson(req) : {};
    const result = await dispatch(target, `${req.method ?? 'GET'} ${url.pathname}`, url.searchParams, body);
    if (result === undefined) send(res, 404, { error: `no control endpoint ${req.method ?? 'GET'} ${url.pathname}` });
    else send(res, 200, result);
  } catch (error) {
    const status = error instanceof BadRequest ? 400 : 500;
    send(res, status, { error: error instanceof Error ? error.message : String(error) });
  }
}

async function dispatch(target: ControlTarget, route: string, query: URLSearchParams, body: Record<string, unknown>): Promise<unknown> {
  switch (route) {
    case 'GET /_local/events':
      return target.events();
    case 'GET /_local/requests':
      return target.requests();
    case 'GET /_local/stream-requests':
      return target.streamRequests();
    case 'GET /_local/meters':
      return target.meters();
    case 'GET /_local/webhook-deliveries':
      return target.webhookDeliveries();
    case 'GET /_local/concurrency': {
      const customer = query.get('customer') ?? '';
      const eventName = query.get('eventName') ?? '';
      return { customer, eventName, maxConcurrencySeen: target.maxConcurrencySeen(customer, eventName) };
    }
    case 'GET /_local/faults':
      return target.faultState();
    case 'POST /_local/faults':
      target.applyFaults(parseFaults(body));
      return { ok: true };
    case 'POST /_local/heal':
      target.heal();
      return { ok: true };
    case 'POST /_local/reset':
      target.reset();
      return { ok: true };
    case 'POST /_local/customers':
      target.addCustomer(requireString(body, 'id'));
      return { ok: true };
    case 'POST /_local/meters':
      return {
        id: target.addMeter(requireString(body, 'eventName'), {
          customerKey: optionalString(body, 'customerKey'),
          valueKey: optionalString(body, 'valueKey'),
          formula: meterFormula(optionalString(body, 'formula')),
        }),
      };
    case 'POST /_local/flush-stream':
      target.flushStream();
      return { ok: true };
    case 'POST /_local/flush-async-errors':
      await target.flushAsyncErrors();
      return { ok: true };
    case 'POST /_local/clock':
      return { now: target.advanceClock(requireNumber(body, 'advanceMs', -Infinity)) };
    default:
      return undefined;
  }
}

const FAULTS = Object.keys({
  failNext: true,
  latencyMs: true,
  dropAfterRecord: true,
  garbleNext: true,
  refuseForSeconds: true,
  asyncErrorNext: true,
  refuseCustomers: true,
} satisfies Record<keyof FaultRequest, true>);

function parseFaults(body: Record<string, unknown>): FaultRequest {
  // A fault it does not know would otherwise be taken without effect: refused, naming them all.
  const unknown = Object.keys(body).filter((key) => !FAULTS.includes(key));
  if (unknown.length > 0) throw new BadRequest(`unknown fault ${unknown.join(', ')} (known: ${FAULTS.join(', ')})`);
  const faults: FaultRequest = {};
  if (body.failNext !== undefined) {
    const failNext = requireObject(body, 'failNext');
    faults.failNext = {
      count: requireNumber(failNext, 'count'),
      status: requireNumber(failNext, 'status'),
      retryAfterSeconds: optionalNumber(failNext, 'retryAfterSeconds'),
      message: optionalString(failNext, 'message'),
    };
  }
  faults.latencyMs = optionalNumber(body, 'latencyMs');
  faults.dropAfterRecord = optionalNumber(body, 'dropAfterRecord');
  faults.garbleNext = optionalNumber(body, 'garbleNext');
  faults.refuseForSeconds = optionalNumber(body, 'refuseForSeconds');
  if (body.asyncErrorNext !== undefined) {
    const asyncErrorNext = requireObject(body, 'asyncErrorNext');
    faults.asyncErrorNext = {
      count: requireNumber(asyncErrorNext, 'count'),
      code: requireString(asyncErrorNext, 'code'),
      message: optionalString(asyncErrorNext, 'message'),
    };
  }
  if (body.refuseCustomers !== undefined) {
    const refusals = requireObject(body, 'refuseCustomers');
    faults.refuseCustomers = Object.fromEntries(
      Object.keys(refusals).map((customer) => {
        const refusal = requireObject(refusals, customer);
        return [customer, { status: requireNumber(refusal, 'status'), code: optionalString(refusal, 'code'), message: optionalString(refusal, 'message') }];
      }),
    );
  }
  return faults;
}

async function readJson(req: IncomingMessage): Promise<Record<string, unknown>> {
  const raw = await readBody(req);
  if (raw.trim() === '') return {};
  if (!(headerValue(req, 'content-type') ?? 'application/json').includes('json')) {
    throw new BadRequest('send a JSON body (content-type: application/json)');
  }
  let parsed: unknown;
  try {
    parsed = JSON.parse(raw);
  } catch {
    throw new BadRequest('the body is not valid JSON');
  }
  if (!isRecord(parsed)) throw new BadRequest('the body must be a JSON object');
  return parsed;
}

function isRecord(value: unknown): value is Record<string, unknown> {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}

function requireObject(body: Record<string, unknown>, name: string): Record<string, unknown> {
  const value = body[name];
  if (!isRecord(value)) throw new BadRequest(`${name} must be an object`);
  return value;
}

function requireString(body: Record<string, unknown>, name: string): string {
  const value = body[name];
  if (typeof value !== 'string' || value === '') throw new BadRequest(`${name} must be a non-empty string`);
  return value;
}

function optionalString(body: Record<string, unknown>, name: string): string | undefined {
  return body[name] === undefined ? undefined : requireString(body, name);
}

function requireNumber(body: Record<string, unknown>, name: string, min = 0): number {
  const value = body[name];
  if (typeof value !== 'number' || !Number.isFinite(value) || value < min) {
    throw new BadRequest(`${name} must be a number${min === 0 ? ' of 0 or more' : ''}`);
  }
  return value;
}

function optionalNumber(body: Record<string, unknown>, name: string): number | undefined {
  return body[name] === undefined ? undefined : requireNumber(body, name);
}

function send(res: ServerResponse, status: number, body: unknown): void {
  const text = JSON.stringify(body);
  res.writeHead(status, { 'content-type': 'application/json', 'content-length': Buffer.byteLength(text) });
  res.end(text);
}

/** A meter's formula from the control API (sum unless given). */
function meterFormula(value: string | undefined): MeterFormula | undefined {
  if (value === undefined || value === 'sum' || value === 'count' || value === 'last') return value;
  throw new BadRequest(`formula must be sum, count or last, not ${JSON.stringify(value)}`);
}
