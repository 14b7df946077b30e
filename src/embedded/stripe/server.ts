/**
 * A local Stripe-compatible HTTP server for tests and the embedded demo mode.
 *
 * The real `stripe` package talks to it through
 * `new Stripe(key, { host: '127.0.0.1', port, protocol: 'http' })`; a custom `host` redirects the
 * package's meter-events base address (the v2 stream's) here too. It implements the part of the
 * API the billing pipeline uses — meter events (v1, and the v2 meter event stream with its
 * sessions), their adjustments and summaries, meters, customers, and the asynchronous error
 * report — with the behaviour the pipeline has to survive: identifier deduplication for 24 hours,
 * Idempotency-Key replay, rate limits, one concurrent call per customer and meter, expiring stream
 * sessions, and injectable failures (errors, latency, lost responses, outages). Everything it
 * accepted can be read back, in process or through the control API (`control.ts`).
 *
 * Order of checks for POST /v1/billing/meter_events, as Stripe applies them:
 *   refuse (outage) → auth → Idempotency-Key replay → injected failure → rate limit →
 *   per-customer concurrency → parameter validation → identifier dedup → record,
 * then the (simulated) latency, then the answer — or a dropped connection. Later: the customer and
 * the meter's payload keys, a failure reported through the error report (the event never counts).
 *
 * Order for POST /v2/billing/meter_event_stream (JSON, authenticated by a session's token):
 *   refuse (outage) → session token (401; expired: `temporary_session_expired`) → injected
 *   failure → rate limit → request shape (400 for the whole request: ≤ 100 events, each well
 *   formed) → take the events, answer `{}`,
 * then the latency, then the answer or a dropped connection. Later, per event in order: identifier
 * dedup (silent) → meter → customer → value → timestamp window → record, a failure reported
 * through the error report. No per-customer concurrency rule, and no Idempotency-Key replay: v2
 * retries "don't repeat successful operations", which identifier dedup gives events that carry an
 * identifier; an event sent without one is counted again on a resend here, the stricter outcome.
 */
import { randomUUID } from 'node:crypto';
import http, { type IncomingMessage, type ServerResponse } from 'node:http';
import type { AddressInfo } from 'node:net';
import { localUrl } from '../ports.js';
import { createAdjustment } from './adjustments.js';
import { checkApiKey, checkSessionToken } from './auth.js';
import { Catalog, type CustomerObject } from './catalog.js';
import { InFlightTracker } from './concurrency.js';
import { handleControl, type ControlTarget } from './control.js';
import { ErrorReporter, type WebhookDelivery } from './error-reports.js';
import { FaultPlan, failureResponse, isStoredFailure } from './faults.js';
import { IdempotencyStore } from './idempotency.js';
import { MeterEventLedger } from './ledger.js';
import { checkStreamEvent, parseStreamRequest, streamRequestKeys, type StreamEvent } from './meter-event-stream.js';
import { duplicateIdentifier, meterEventBody, meterEventKeys, validateMeterEvent, type MeterEventInput } from './meter-events.js';
import { SlidingWindowLimiter } from './rate-limiter.js';
import { MeterEventSessions, sessionBody } from './sessions.js';
import { eventSummaries } from './summaries.js';
import type {
  FailNextOptions,
  FaultRequest,
  FaultState,
  LocalStripeOptions,
  LocalStripeState,
  MeterInfo,
  MeterKeyOptions,
  RecordedMeterEvent,
  RequestRecord,
  StreamRequestRecord,
  WebhookTarget,
} from './types.js';
import {
  canonicalParams,
  flatStrings,
  headerValue,
  invalidRequest,
  json,
  list,
  newId,
  notFound,
  objectParam,
  parseJsonBody,
  parseStripeForm,
  readBody,
  stringParam,
  stripeError,
  writeGarbled,
  writeResponse,
  type ApiResponse,
  type FormObject,
  type JsonBody,
} from './wire.js';

export type * from './types.js';
export type { ErrorReportEvent, WebhookDelivery } from './error-reports.js';
export { signatureHeader } from './error-reports.js';

/** One API request, once its body has been read. */
interface ApiCall {
  method: string;
  path: string;
  query: URLSearchParams;
  /** v1 parameters (form-encoded); empty for v2. */
  form: FormObject;
  /** v2 body (JSON); null for v1. */
  json: JsonBody | null;
  authorization: string | null;
  idempotencyKey: string | null;
  requestId: string;
  /** ms by the simulated clock */
  arrivedAt: number;
}

/** What executing an endpoint produced, and whether Stripe would save it under the Idempotency-Key. */
interface Execution {
  response: ApiResponse;
  store: boolean;
  event?: RecordedMeterEvent;
}

interface Outcome {
  response: ApiResponse;
  replayed: boolean;
  event?: RecordedMeterEvent;
}

interface Route {
  method: 'GET' | 'POST';
  pattern: RegExp;
  handle: (call: ApiCall, params: string[]) => ApiResponse;
}

const METER_EVENTS_PATH = '/v1/billing/meter_events';
const METER_EVENT_STREAM_PATH = '/v2/billing/meter_event_stream';
const ADJUSTMENTS_PATH = '/v1/billing/meter_event_adjustments';

/** Stream events answered 200 and waiting for Stripe's later validation. */
interface PendingStreamRequest {
  events: StreamEvent[];
  call: ApiCall;
}

export class LocalStripe implements ControlTarget {
  private readonly server: http.Server;
  private readonly clock: () => number;
  private readonly catalog: Catalog;
  private readonly ledger = new MeterEventLedger();
  private readonly idempotency: IdempotencyStore;
  private readonly limiter: SlidingWindowLimiter;
  private readonly inFlight = new InFlightTracker();
  private readonly faults = new FaultPlan();
  private readonly reporter: ErrorReporter;
  private readonly sessions: MeterEventSessions;
  private readonly routes: Route[];
  private requestLog: RequestRecord[] = [];
  private streamLog: StreamRequestRecord[] = [];
  private streamQueue: PendingStreamRequest[] = [];
  private streamTimer: NodeJS.Timeout | undefined;
  private clockOffsetMs = 0;
  /** Resolvers of pending latency waits, so close() does not wait for them. */
  private readonly sleepers = new Set<() => void>();
  private closed = false;
  private boundPort = 0;
  private boundHost = '127.0.0.1';

  static async start(opts: LocalStripeOptions = {}): Promise<LocalStripe> {
    const instance = new LocalStripe(opts);
    await instance.listen(opts.port ?? 0, opts.host ?? '127.0.0.1');
    return instance;
  }

  private readonly options: LocalStripeOptions;
  /** The one secret key accepted (options.apiKey; `rollApiKey` changes it); undefined: any test key. */
  private requiredKey: string | undefined;
  private constructor(options: LocalStripeOptions) {
    this.options = options;
    this.requiredKey = options.apiKey;
    this.clock = options.now ?? Date.now;
    this.catalog = new Catalog(() => Math.floor(this.now() / 1000));
    this.idempotency = new IdempotencyStore(() => this.now());
    this.limiter = new SlidingWindowLimiter(options.rateLimitPerSecond);
    this.reporter = new ErrorReporter(() => this.now(), options.webhook);
    this.sessions = new MeterEventSessions(() => this.now(), options.sessionLifetimeMs);
    if (options.state) {
      this.catalog.restore(options.state.customers, options.state.meters);
      this.ledger.restore(options.state.events);
      this.reporter.restore(options.state.errorReports ?? [], options.state.undeliveredReports ?? []);
    }
    for (const eventName of options.meters ?? ['api_requests']) this.catalog.addMeter(eventName);
    for (const id of options.customers ?? []) this.catalog.addCustomer(id);
    for (const [id, { status, ...opts }] of Object.entries(options.refuseCustomers ?? {})) this.faults.refuseCustomer(id, status, opts);
    this.routes = this.buildRoutes();
    this.server = http.createServer((req, res) => this.onRequest(req, res));
  }

  get port(): number {
    return this.boundPort;
  }

  /** Where clients on this machine reach it (a wildcard bind, `0.0.0.0` or `::`, by loopback). */
  get url(): string {
    return localUrl(this.boundHost, this.boundPort);
  }

  /** Closes the server, every open (keep-alive) socket and pending latency waits. */
  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    this.clearStreamQueue();
    for (const wake of [...this.sleepers]) wake();
    const serverClosed = new Promise<void>((resolve, reject) => {
      this.server.close((error) => (error ? reject(error) : resolve()));
    });
    this.server.closeAllConnections();
    await Promise.all([serverClosed, this.reporter.close()]);
  }

  // ---- setup ----------------------------------------------------------------------------------

  addCustomer(id: string): void {
    this.catalog.addCustomer(id);
  }

  /** Deactivates the meter for `eventName` and creates another that reads other payload keys. */
  replaceMeter(eventName: string, keys: MeterKeyOptions): string {
    return this.catalog.replaceMeter(eventName, keys);
  }

  /** Deactivates the active meter for `eventName` (none active after it, until addMeter). */
  deactivateMeter(eventName: string): void {
    const meter = this.catalog.meterForEvent(eventName);
    if (meter) this.catalog.deactivate(meter);
  }

  /** A meter for `eventName`; `keys` are the payload keys it reads (Stripe's defaults otherwise). */
  addMeter(eventName: string, keys: MeterKeyOptions = {}): string {
    return this.catalog.addMeter(eventName, keys);
  }

  meters(): MeterInfo[] {
    return this.catalog.meterInfos();
  }

  /**
   * Moves the simulated clock forward (on top of `options.now`), e.g. by 25 hours to leave the
   * identifier window, or by 16 minutes to expire stream sessions. Returns the new time in ms. For
   * processes that cannot pass `now`.
   */
  advanceClock(ms: number): number {
    this.clockOffsetMs += ms;
    return this.now();
  }

  // ---- what Stripe saw ------------------------------------------------------------------------

  /** Every accepted meter event, in acceptance order (cancelled ones included, flagged). */
  events(): RecordedMeterEvent[] {
    return this.ledger.all();
  }

  /** Every request that reached POST /v1/billing/meter_events, in arrival order. */
  requests(): RequestRecord[] {
    return this.requestLog.map((record) => ({ ...record }));
  }

  /** Every request that reached POST /v2/billing/meter_event_stream, in arrival order. */
  streamRequests(): StreamRequestRecord[] {
    return this.streamLog.map((record) => ({ ...record, identifiers: [...record.identifiers] }));
  }

  /** Highest number of v1 meter-event requests for the pair in flight at once, counted at arrival (the stream is not counted). */
  maxConcurrencySeen(customer: string, eventName: string): number {
    return this.inFlight.maxSeen(customer, eventName);
  }

  /**
   * Where error reports are delivered from now on (undefined: nowhere; they stay listed at GET
   * /v2/core/events). A stack whose API listens after this server starts sets it then.
   */
  setWebhook(target: WebhookTarget | undefined): void {
    this.reporter.setWebhook(target);
  }

  /** Outcome of each error-report webhook delivery. */
  webhookDeliveries(): WebhookDelivery[] {
    return this.reporter.deliveries();
  }

  // ---- fault injection ------------------------------------------------------------------------

  /**
   * Stripe's "roll key" with the old key expiring at once: from now on only `key` is accepted, and
   * every call with another one is answered 401 (undefined: any test key again).
   */
  rollApiKey(key: string | undefined): void {
    this.requiredKey = key;
  }

  /**
   * The next `count` meter-event (or cancel adjustment) requests fail with `status` (Stripe-shaped
   * body); nothing is recorded. A 5xx is stored under the request's Idempotency-Key, as Stripe does.
   */
  failNext(count: number, status: number, opts?: FailNextOptions): void {
    this.faults.failNext(count, status, opts);
  }

  /** Every v1 meter-event call naming `customer` answers `status` (with `opts.code`, `opts.message`) until `heal()`. */
  refuseCustomer(customer: string, status: number, opts?: FailNextOptions): void {
    this.faults.refuseCustomer(customer, status, opts);
  }

  /** Ends `refuseCustomer` for one customer. */
  admitCustomer(customer: string): void {
    this.faults.admitCustomer(customer);
  }

  /**
   * Every v2 stream request whose events include `identifier` fails with `status` (before anything
   * of it is kept), whatever else it carries, until `heal()`: one event that breaks the request it
   * is in. Other requests go through.
   */
  failStreamRequestsWith(identifier: string, status: number): void {
    this.faults.failRequestsWith(identifier, status);
  }

  /** How long sessions created from now on last (ms of the `now` clock). */
  setSessionLifetime(ms: number): void {
    this.sessions.lifetimeMs = ms;
  }

  /** v2 meter event sessions handed out so far. */
  sessionsIssued(): number {
    return this.sessions.issued;
  }

  /** Meter-event calls Stripe is working on right now (arrived, answer not yet due). */
  callsInFlight(): number {
    return this.inFlight.totalNow();
  }

  /** Delay before answering each meter-event request (the request stays in flight meanwhile). */
  setLatency(ms: number): void {
    this.faults.latencyMs = ms;
  }

  /** The next `count` meter-event (or cancel adjustment) requests are processed (and recorded) but never answered. */
  dropAfterRecord(count: number): void {
    this.faults.dropAfterRecord(count);
  }

  /**
   * The next `count` meter-event (or stream) requests are processed as usual, then answered 200
   * with a body that is not valid JSON (a proxy cutting it short): the caller cannot tell what happened.
   */
  garbleNext(count: number): void {
    this.faults.garbleNext(count);
  }

  /** For `seconds` of real time, every API connection is cut before anything is processed. */
  refuseFor(seconds: number): void {
    this.faults.refuseFor(seconds);
  }

  /** The next `count` accepted events get a 200 and are then reported failed via the webhook. */
  asyncErrorNext(count: number, code: string, message?: string): void {
    this.faults.asyncErrorNext(count, code, message);
  }

  /** Runs the later validation of stream events now (recording them), instead of on its timer. */
  flushStream(): void {
    clearTimeout(this.streamTimer);
    this.streamTimer = undefined;
    const pending = this.streamQueue;
    this.streamQueue = [];
    for (const { events, call } of pending) {
      for (const event of events) this.processStreamEvent(event, call);
    }
  }

  /** Processes pending stream events, publishes pending error reports now and waits for their webhook deliveries. */
  flushAsyncErrors(): Promise<void> {
    this.flushStream();
    return this.reporter.flush();
  }

  /** The faults in force and still queued. */
  faultState(): FaultState {
    return this.faults.state();
  }

  /** Stripe answering normally again: no outage, no latency, no queued failure, drop, garble or error report. */
  heal(): void {
    this.faults.reset();
  }

  applyFaults(request: FaultRequest): void {
    const { failNext, latencyMs, dropAfterRecord, garbleNext, refuseForSeconds, asyncErrorNext, refuseCustomers } = request;
    if (failNext) this.failNext(failNext.count, failNext.status, failNext);
    if (latencyMs !== undefined) this.setLatency(latencyMs);
    if (dropAfterRecord !== undefined) this.dropAfterRecord(dropAfterRecord);
    if (garbleNext !== undefined) this.garbleNext(garbleNext);
    if (refuseForSeconds !== undefined) this.refuseFor(refuseForSeconds);
    if (asyncErrorNext) this.asyncErrorNext(asyncErrorNext.count, asyncErrorNext.code, asyncErrorNext.message);
    for (const [customer, { status, ...opts }] of Object.entries(refuseCustomers ?? {})) this.refuseCustomer(customer, status, opts);
  }

  /** The account and the recorded events, to start a later instance from (LocalStripeState). */
  snapshot(): LocalStripeState {
    // Failures still collecting for their report are reported now, so the snapshot holds them.
    this.reporter.publishPending();
    const { reports, undelivered } = this.reporter.state();
    return { version: 1, customers: this.catalog.listCustomers(), meters: this.catalog.listMeters(), events: this.ledger.all(), errorReports: reports, undeliveredReports: undelivered };
  }

  /** Changes whenever the snapshot would (cheap: for deciding whether one is due). */
  get stateMark(): string {
    return `${this.ledger.count}/${this.catalog.counts}/${this.reporter.mark}`;
  }

  /**
   * Forgets events (pending stream events too), requests, idempotency keys, faults, error reports
   * and the clock offset; keeps customers, meters and stream sessions (credentials a running
   * pipeline may hold).
   */
  reset(): void {
    this.clearStreamQueue();
    this.ledger.reset();
    this.requestLog = [];
    this.streamLog = [];
    this.idempotency.reset();
    this.limiter.reset();
    this.inFlight.reset();
    this.faults.reset();
    this.reporter.reset();
    this.clockOffsetMs = 0;
  }

  // ---- HTTP -----------------------------------------------------------------------------------

  private now(): number {
    return this.clock() + this.clockOffsetMs;
  }

  private async listen(port: number, host: string): Promise<void> {
    await new Promise<void>((resolve, reject) => {
      this.server.once('error', reject);
      this.server.listen(port, host, () => {
        this.server.off('error', reject);
        resolve();
      });
    });
    const address = this.server.address() as AddressInfo;
    this.boundPort = address.port;
    this.boundHost = host;
  }

  private onRequest(req: IncomingMessage, res: ServerResponse): void {
    this.route(req, res).catch((error: unknown) => {
      if (res.headersSent) {
        res.destroy();
        return;
      }
      const message = error instanceof Error ? error.message : String(error);
      writeResponse(res, stripeError(500, { type: 'api_error', message: `Local Stripe failed: ${message}` }), {});
    });
  }

  private async route(req: IncomingMessage, res: ServerResponse): Promise<void> {
    const url = new URL(req.url ?? '/', 'http://local');
    if (url.pathname.startsWith('/_local/')) {
      await handleControl(this, req, res, url);
      return;
    }
    // Stripe unreachable: the connection dies before any byte of an answer. The client cannot
    // tell this from a lost response; here nothing was processed.
    if (this.faults.isRefusing()) {
      req.socket.destroy();
      return;
    }
    const call = await this.readCall(req, url);
    const headers = this.responseHeaders(req, call);
    if (call.method === 'POST' && call.path === METER_EVENTS_PATH) {
      await this.handleMeterEvent(res, call, headers);
      return;
    }
    if (call.method === 'POST' && call.path === METER_EVENT_STREAM_PATH) {
      await this.handleStream(res, call, headers);
      return;
    }
    const response = checkApiKey(call.authorization, this.requiredKey) ?? this.withIdempotency(call, () => this.dispatch(call)).response;
    // A cancel's answer can be lost too (Stripe cancelled the event; the caller hears nothing).
    if (call.method === 'POST' && call.path === ADJUSTMENTS_PATH && this.faults.takeDrop()) {
      res.destroy();
      return;
    }
    writeResponse(res, response, headers);
  }

  private async readCall(req: IncomingMessage, url: URL): Promise<ApiCall> {
    const raw = await readBody(req);
    // v2 bodies are JSON (stripe-node sends every /v2 call so), v1 bodies a form.
    const isV2 = url.pathname.startsWith('/v2/');
    const isForm = !isV2 && (headerValue(req, 'content-type') ?? '').includes('application/x-www-form-urlencoded');
    return {
      method: req.method ?? 'GET',
      path: url.pathname,
      query: url.searchParams,
      form: isForm ? parseStripeForm(raw) : {},
      json: isV2 ? parseJsonBody(raw) : null,
      authorization: headerValue(req, 'authorization'),
      idempotencyKey: headerValue(req, 'idempotency-key'),
      requestId: newId('req'),
      arrivedAt: this.now(),
    };
  }

  private responseHeaders(req: IncomingMessage, call: ApiCall): Record<string, string> {
    const headers: Record<string, string> = { 'request-id': call.requestId };
    const version = headerValue(req, 'stripe-version');
    if (version) headers['stripe-version'] = version;
    if (call.idempotencyKey && call.method === 'POST') headers['idempotency-key'] = call.idempotencyKey;
    return headers;
  }

  private sleep(ms: number): Promise<void> {
    if (ms <= 0) return Promise.resolve();
    return new Promise((resolve) => {
      const wake = () => {
        clearTimeout(timer);
        this.sleepers.delete(wake);
        resolve();
      };
      const timer = setTimeout(wake, ms);
      this.sleepers.add(wake);
    });
  }

  // ---- meter events ---------------------------------------------------------------------------

  private async handleMeterEvent(res: ServerResponse, call: ApiCall, headers: Record<string, string>): Promise<void> {
    const keys = meterEventKeys(call.form, this.catalog);
    // Stripe keeps working on a call after its caller hangs up, so the call stays in flight until
    // its answer is due, whether or not anyone is still listening.
    const latencyMs = this.faults.latencyMs;
    const flight = this.inFlight.enter(keys.customer ?? '', keys.eventName ?? '', latencyMs);

    const denied = checkApiKey(call.authorization, this.requiredKey);
    const outcome: Outcome = denied
      ? { response: denied, replayed: false }
      : this.withIdempotency(call, () => this.executeMeterEvent(call, keys.customer, flight.othersInFlight));
    const dropped = this.faults.takeDrop();
    const garbled = !dropped && this.faults.takeGarble();
    this.logRequest(call, keys, outcome, dropped);

    await this.sleep(latencyMs);
    flight.leave();
    if (dropped || this.closed) {
      // A lost response: Stripe did the work, the caller never hears about it.
      res.destroy();
      return;
    }
    if (garbled) return writeGarbled(res);
    writeResponse(res, outcome.response, headers);
  }

  private executeMeterEvent(call: ApiCall, customer: string | null, othersInFlight: number): Execution {
    const failure = this.faults.takeFailure() ?? this.faults.customerRefusal(customer);
    if (failure) return { response: failureResponse(failure), store: isStoredFailure(failure) };
    if (!this.limiter.tryAcquire()) return { response: rateLimited(), store: false };
    if (othersInFlight > 0 && this.options.enforcePerCustomerConcurrency !== false) {
      return { response: concurrentCall(meterEventKeys(call.form, this.catalog)), store: false };
    }
    const now = this.now();
    const input = validateMeterEvent(call.form, this.catalog, now);
    if ('status' in input) return { response: input, store: false };
    if (input.identifier !== undefined && this.ledger.isDuplicate(input.identifier, now)) {
      return { response: duplicateIdentifier(input.identifier), store: true };
    }
    const event = this.recordMeterEvent(input, call, now);
    return { response: json(meterEventBody(event)), store: true, event };
  }

  private recordMeterEvent(input: MeterEventInput, call: ApiCall, now: number): RecordedMeterEvent {
    const asyncError = input.asyncError ?? this.faults.takeAsyncError();
    const event: RecordedMeterEvent = {
      identifier: input.identifier ?? randomUUID(),
      eventName: input.eventName,
      customer: input.customer,
      value: input.value,
      payload: input.payload,
      timestamp: input.timestamp ?? Math.floor(now / 1000),
      receivedAt: now,
      cancelled: false,
      meterId: this.catalog.meterForEvent(input.eventName)?.id ?? null,
      ...(asyncError ? { asyncError } : {}),
      idempotencyKey: call.idempotencyKey,
      requestId: call.requestId,
    };
    this.ledger.record(event);
    if (asyncError) {
      const meterId = this.catalog.meterForEvent(event.eventName)?.id ?? null;
      this.reporter.add({ ...asyncError, meterId, identifier: event.identifier, receivedAt: now });
    }
    return event;
  }

  private logRequest(call: ApiCall, keys: ReturnType<typeof meterEventKeys>, outcome: Outcome, dropped: boolean): void {
    const error = errorOf(outcome.response);
    this.requestLog.push({
      at: call.arrivedAt,
      requestId: call.requestId,
      identifier: outcome.event?.identifier ?? keys.identifier,
      customer: keys.customer,
      eventName: keys.eventName,
      idempotencyKey: call.idempotencyKey,
      status: outcome.response.status,
      ...(error?.message !== undefined ? { errorMessage: error.message } : {}),
      ...(error?.code !== undefined ? { errorCode: error.code } : {}),
      replayed: outcome.replayed,
      dropped,
    });
  }

  // ---- the v2 meter event stream --------------------------------------------------------------

  private async handleStream(res: ServerResponse, call: ApiCall, headers: Record<string, string>): Promise<void> {
    const { response, sessionId } = this.executeStream(call);
    const dropped = this.faults.takeDrop();
    const garbled = !dropped && this.faults.takeGarble();
    const error = errorOf(response);
    this.streamLog.push({
      at: call.arrivedAt,
      requestId: call.requestId,
      sessionId,
      ...streamRequestKeys(call.json?.ok ? call.json.value : undefined),
      status: response.status,
      ...(error?.message !== undefined ? { errorMessage: error.message } : {}),
      ...(error?.code !== undefined ? { errorCode: error.code } : {}),
      dropped,
    });

    await this.sleep(this.faults.latencyMs);
    if (dropped || this.closed) {
      res.destroy();
      return;
    }
    if (garbled) return writeGarbled(res);
    writeResponse(res, response, headers);
  }

  private executeStream(call: ApiCall): { response: ApiResponse; sessionId: string | null } {
    const session = checkSessionToken(call.authorization, this.sessions);
    if ('status' in session) return { response: session, sessionId: null };
    const sessionId = session.id;
    const failure = this.faults.takeFailure() ?? this.faults.takePoisoned(streamRequestKeys(call.json?.ok ? call.json.value : undefined).identifiers);
    if (failure) return { response: failureResponse(failure), sessionId };
    if (!this.limiter.tryAcquire()) return { response: rateLimited(), sessionId };
    const events = call.json?.ok
      ? parseStreamRequest(call.json.value)
      : invalidRequest(`The request body is not valid JSON (${call.json?.error ?? 'no body'}).`);
    if ('status' in events) return { response: events, sessionId };
    this.streamQueue.push({ events, call });
    this.streamTimer ??= setTimeout(() => this.flushStream(), this.options.streamProcessingDelayMs ?? 0);
    // Received, not validated: the answer says nothing about any one event.
    return { response: json({}), sessionId };
  }

  /** Stripe's later look at one stream event, as of its receipt. */
  private processStreamEvent(event: StreamEvent, call: ApiCall): void {
    const receivedAt = call.arrivedAt;
    // No "already exists" on the stream: a repeated identifier is simply not counted again.
    if (event.identifier !== undefined && this.ledger.isDuplicate(event.identifier, receivedAt)) return;
    this.recordMeterEvent(checkStreamEvent(event, this.catalog, receivedAt), call, receivedAt);
  }

  private clearStreamQueue(): void {
    clearTimeout(this.streamTimer);
    this.streamTimer = undefined;
    this.streamQueue = [];
  }

  // ---- idempotency ----------------------------------------------------------------------------

  private withIdempotency(call: ApiCall, execute: () => Execution): Outcome {
    const key = call.idempotencyKey;
    if (call.method !== 'POST' || key === null) return { ...execute(), replayed: false };
    const endpoint = `${call.method} ${call.path}`;
    const params = call.json ? JSON.stringify(call.json) : canonicalParams(call.form);
    const found = this.idempotency.lookup(key, endpoint, params);
    if (found.kind !== 'new') return { response: found.response, replayed: found.kind === 'replay' };
    const result = execute();
    if (result.store) this.idempotency.save(key, endpoint, params, result.response);
    return { response: result.response, replayed: false, event: result.event };
  }

  // ---- other endpoints ------------------------------------------------------------------------

  private dispatch(call: ApiCall): Execution {
    for (const route of this.routes) {
      const match = route.method === call.method ? route.pattern.exec(call.path) : null;
      if (!match) continue;
      const params = match.slice(1).map((p) => decodeURIComponent(p));
      // A cancel can fail like a meter event (an injected 5xx is stored under its key, as Stripe does).
      const failure = call.path === ADJUSTMENTS_PATH ? this.faults.takeFailure() : undefined;
      if (failure) return { response: failureResponse(failure), store: isStoredFailure(failure) };
      const response = route.handle(call, params);
      // Successful writes and the refusals an endpoint made while executing are replayed, as Stripe
      // does; a malformed request is evaluated afresh.
      return { response, store: response.status < 300 || response.executed === true };
    }
    return {
      response: stripeError(404, {
        type: 'invalid_request_error',
        message: `Unrecognized request URL (${call.method}: ${call.path}).`,
      }),
      store: false,
    };
  }

  private buildRoutes(): Route[] {
    const catalog = this.catalog;
    return [
      { method: 'GET', pattern: /^\/v1\/customers$/, handle: (c) => list(catalog.listCustomers(), '/v1/customers', c.query) },
      { method: 'POST', pattern: /^\/v1\/customers$/, handle: (c) => json(catalog.createCustomer(customerFields(c.form))) },
      {
        method: 'GET',
        pattern: /^\/v1\/customers\/([^/]+)$/,
        handle: (_c, [id = '']) => found(catalog.customer(id), `No such customer: '${id}'`),
      },
      { method: 'GET', pattern: /^\/v1\/billing\/meters$/, handle: (c) => list(catalog.listMeters(), '/v1/billing/meters', c.query) },
      {
        method: 'GET',
        pattern: /^\/v1\/billing\/meters\/([^/]+)$/,
        handle: (_c, [id = '']) => found(catalog.meter(id), `No such billing meter: '${id}'`),
      },
      {
        method: 'POST',
        pattern: /^\/v1\/billing\/meters\/([^/]+)\/deactivate$/,
        handle: (_c, [id = '']) => {
          const meter = catalog.meter(id);
          return meter ? json(catalog.deactivate(meter)) : notFound(`No such billing meter: '${id}'`, 'id');
        },
      },
      {
        method: 'GET',
        pattern: /^\/v1\/billing\/meters\/([^/]+)\/event_summaries$/,
        handle: (c, [id = '']) => {
          const meter = catalog.meter(id);
          return meter ? eventSummaries(meter, c.query, this.ledger.billable()) : notFound(`No such billing meter: '${id}'`, 'id');
        },
      },
      {
        method: 'POST',
        pattern: new RegExp(`^${ADJUSTMENTS_PATH}$`),
        handle: (c) => createAdjustment(c.form, this.ledger, this.now()),
      },
      { method: 'POST', pattern: /^\/v2\/billing\/meter_event_session$/, handle: () => json(sessionBody(this.sessions.create())) },
      { method: 'GET', pattern: /^\/v2\/core\/events$/, handle: (c) => this.listErrorReports(c.query) },
      {
        method: 'GET',
        pattern: /^\/v2\/core\/events\/([^/]+)$/,
        handle: (_c, [id = '']) => found(this.reporter.event(id), `No such event: '${id}'`),
      },
    ];
  }

  /** GET /v2/core/events (v2 list shape); `object_id` filters by the related meter. */
  private listErrorReports(query: URLSearchParams): ApiResponse {
    const objectId = query.get('object_id');
    const data = this.reporter.events().filter((event) => objectId === null || event.related_object?.id === objectId);
    return json({ data, next_page_url: null, previous_page_url: null });
  }
}

function found(object: object | undefined, missingMessage: string): ApiResponse {
  return object ? json(object) : notFound(missingMessage, 'id');
}

function customerFields(form: FormObject): Partial<Pick<CustomerObject, 'name' | 'email' | 'metadata'>> {
  return {
    name: stringParam(form, 'name'),
    email: stringParam(form, 'email'),
    metadata: flatStrings(objectParam(form, 'metadata')),
  };
}

function rateLimited(): ApiResponse {
  return stripeError(
    429,
    { type: 'rate_limit_error', code: 'rate_limit', message: 'Request rate limit exceeded. Back off and retry after a moment.' },
    { 'retry-after': '1' },
  );
}

function concurrentCall(keys: { customer: string | null; eventName: string | null }): ApiResponse {
  const { customer, eventName } = keys;
  return stripeError(429, {
    type: 'rate_limit_error',
    code: 'rate_limit',
    message:
      `Too many concurrent requests for customer '${customer ?? ''}' and event name '${eventName ?? ''}'. ` +
      'Stripe accepts one meter event request at a time per customer and meter.',
  });
}

function errorOf(response: ApiResponse): { message?: string; code?: string } | undefined {
  const body = response.body as { error?: { message?: unknown; code?: unknown } } | null;
  const error = body?.error;
  if (!error) return undefined;
  return {
    ...(typeof error.message === 'string' ? { message: error.message } : {}),
    ...(typeof error.code === 'string' ? { code: error.code } : {}),
  };
}
