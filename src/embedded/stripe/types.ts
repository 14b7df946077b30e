/**
 * Public types of the local Stripe server. `server.ts` re-exports all of them.
 */

/**
 * What a local Stripe keeps across restarts (`snapshot()`, then `state` when starting again):
 * the account (customers, meters) and the meter events it recorded, so that after a restart it
 * still agrees with an outbox that remembers what it sent, and its identifier dedup still holds.
 */
export interface LocalStripeState {
  version: 1;
  customers: import('./catalog.js').CustomerObject[];
  meters: import('./catalog.js').MeterObject[];
  events: RecordedMeterEvent[];
  /** Error reports published (GET /v2/core/events), and the ids of those no webhook took yet. */
  errorReports?: import('./error-reports.js').ErrorReportEvent[];
  undeliveredReports?: string[];
}

export interface LocalStripeOptions {
  /** 0 (default) picks an ephemeral port. */
  port?: number;
  /** Default '127.0.0.1'. The control API (`/_local/*`) answers loopback clients only. */
  host?: string;
  /**
   * If set, only this secret key is accepted. Otherwise any `sk_test_…` or `rk_test_…` key is,
   * which is what stripe-mock does too.
   */
  apiKey?: string;
  /** Event names of active meters; default ['api_requests']. Each gets the id `mtr_local_<n>`. */
  meters?: string[];
  /** Customer ids that exist from the start. */
  customers?: string[];
  /** Customers whose every v1 meter-event call is refused so (LocalStripe.refuseCustomer), until admitted or healed. */
  refuseCustomers?: Record<string, { status: number } & FailNextOptions>;
  /** A snapshot from an earlier run (see LocalStripeState), applied before `meters` and `customers`. */
  state?: LocalStripeState;
  /**
   * Clock in ms (default Date.now). Every rule Stripe states in calendar time — the 24 h identifier
   * window, the 24 h cancel window, the 24 h idempotency-key lifetime, the 35-day / 5-minute
   * timestamp bounds — reads this clock, so a test can jump a day ahead. Rate limits, latency and
   * `refuseFor` use real time: they are about the network, not the calendar.
   */
  now?: () => number;
  /**
   * Account-wide limit on meter-event requests per second (sliding 1 s window). Default: none.
   * One allowance for both endpoints: a v1 call and a v2 stream request (of up to 100 events) count
   * one each.
   */
  rateLimitPerSecond?: number;
  /**
   * Default true. Stripe allows one concurrent meter-event call per (customer, meter); a request
   * that arrives while another for the same pair is in flight gets a 429. v1 only: Stripe documents
   * no such rule for the v2 stream, so stream requests neither obey nor count towards it.
   */
  enforcePerCustomerConcurrency?: boolean;
  /**
   * How long (real ms) events the v2 stream answered 200 wait before Stripe's later validation
   * decides on them and they show up in `events()`. Default 0: the next turn of the event loop.
   * `flushStream()` (and `flushAsyncErrors()`) process them at once.
   */
  streamProcessingDelayMs?: number;
  /** Where to POST asynchronous error reports (`v1.billing.meter.error_report_triggered`). */
  webhook?: WebhookTarget;
  /**
   * How long a v2 meter event session lasts (ms of the `now` clock). Default: Stripe's 15 minutes.
   * A stand-in issuing shorter sessions is how the batcher's refresh is tested against them.
   */
  sessionLifetimeMs?: number;
}

export interface WebhookTarget {
  url: string;
  /** Signing secret, conventionally `whsec_…`. */
  secret: string;
}

/**
 * The payload keys a meter reads the customer and the value from (Stripe's defaults:
 * stripe_customer_id, value), and how it aggregates the values (`default_aggregation.formula`;
 * default sum).
 */
export interface MeterKeyOptions {
  customerKey?: string;
  valueKey?: string;
  formula?: MeterFormula;
}

/** How a meter aggregates its events: their values summed, the events counted, or the last value. */
export type MeterFormula = 'sum' | 'count' | 'last';

export interface MeterInfo {
  id: string;
  eventName: string;
}

export interface AsyncErrorInfo {
  code: string;
  message: string;
}

/** A meter event Stripe answered with 200 (and therefore stored). */
export interface RecordedMeterEvent {
  identifier: string;
  eventName: string;
  customer: string;
  /** `payload[value]` as a number. */
  value: number;
  /** The whole payload as sent (strings, like the wire format). */
  payload: Record<string, string>;
  /** Usage time, unix seconds (the request's `timestamp`, or the time of receipt). */
  timestamp: number;
  /** When Stripe received it, ms by the `now` clock. Starts the 24 h dedup and cancel windows. */
  receivedAt: number;
  /** Cancelled by a meter event adjustment: no longer counted in summaries. */
  cancelled: boolean;
  /**
   * The meter it was recorded on: the active one with its event name at receipt (null: none).
   * A meter replaced since keeps counting what it took. Absent in state saved before it was kept.
   */
  meterId?: string | null;
  /** Set when the event was answered 200 but failed Stripe's later validation. */
  asyncError?: AsyncErrorInfo;
  idempotencyKey: string | null;
  requestId: string;
}

/** One request that reached POST /v1/billing/meter_events (refused connections never reach it; stream requests: StreamRequestRecord). */
export interface RequestRecord {
  /** Arrival time, ms by the `now` clock. */
  at: number;
  requestId: string;
  /** As sent; for an accepted event without one, the identifier Stripe generated. */
  identifier: string | null;
  customer: string | null;
  eventName: string | null;
  idempotencyKey: string | null;
  /** The status Stripe produced (also when the response was then dropped). */
  status: number;
  errorMessage?: string;
  errorCode?: string;
  /** Answered from the idempotency store (`idempotent-replayed: true`). */
  replayed: boolean;
  /** The response was lost on purpose (`dropAfterRecord`). */
  dropped: boolean;
}

/** One request that reached POST /v2/billing/meter_event_stream (refused connections never reach it). */
export interface StreamRequestRecord {
  /** Arrival time, ms by the `now` clock. */
  at: number;
  requestId: string;
  /** The meter event session whose token authenticated it; null when the token was not a session's. */
  sessionId: string | null;
  /** Events in the body as sent (also when the request was refused), 0 when there was no list. */
  eventCount: number;
  /** The identifier of each event as sent, in order; null where an event had none. */
  identifiers: (string | null)[];
  /** 200 means "received": each event's fate is decided later (see `events()`). */
  status: number;
  errorMessage?: string;
  errorCode?: string;
  /** The response was lost on purpose (`dropAfterRecord`); the events were still taken. */
  dropped: boolean;
}

export interface FailNextOptions {
  /** Only used with status 429: sent as the `Retry-After` header. */
  retryAfterSeconds?: number;
  message?: string;
  /** Stripe's error code in the answer (4xx other than 401, 403, 409 and 429). */
  code?: string;
}

/** JSON body of `POST /_local/faults`; every field is optional and applied in turn. */
/** The faults in force, and those queued for the next calls (`failNext` and the like, oldest first). */
export interface FaultState {
  /** How much longer every API connection is refused. */
  refusingForMs: number;
  latencyMs: number;
  failNext: { count: number; status: number }[];
  dropAfterRecord: number;
  garbleNext: number;
  asyncErrorNext: { count: number; code: string }[];
  /** Customers every v1 meter-event call naming them is refused for, with the status (the stream is not refused). */
  refusedCustomers: { customer: string; status: number }[];
}

export interface FaultRequest {
  failNext?: { count: number; status: number } & FailNextOptions;
  latencyMs?: number;
  dropAfterRecord?: number;
  garbleNext?: number;
  refuseForSeconds?: number;
  /** Customers every meter-event call naming them is refused for, as LocalStripeOptions.refuseCustomers. */
  refuseCustomers?: Record<string, { status: number } & FailNextOptions>;
  asyncErrorNext?: { count: number; code: string; message?: string };
}
