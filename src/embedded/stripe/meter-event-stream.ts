/**
 * POST /v2/billing/meter_event_stream: the checks Stripe makes before answering, and the ones it
 * makes after.
 *
 * The request is JSON, `{ events: [...] }`, up to 100 events. A request that is malformed as a
 * whole — not that shape, too many or no events, an event without `event_name`, a payload that is
 * not an object of strings, an `identifier` over 100 characters, a `timestamp` that is not an
 * ISO-8601 date-time — is refused with a 400 and nothing of it is kept. Everything else is answered
 * with an empty 200: "Events are processed asynchronously, including validation". Whether the meter
 * exists, whether the payload names a known customer and a whole value under that meter's keys,
 * whether the timestamp is inside Stripe's window: all of that is decided later, per event, and a
 * failure surfaces only in an error report. There is no synchronous "already exists" either: an
 * identifier seen in the last 24 hours is silently not counted again (the server applies that).
 */
import { MAX_EVENT_NAME_LENGTH, MAX_IDENTIFIER_LENGTH, MAX_STREAM_BATCH } from '../../stripe/rules.js';
import type { Catalog } from './catalog.js';
import { customerNotFound, parseWholeNumber, timestampRangeProblem, type MeterEventInput } from './meter-events.js';
import { invalidRequest, type ApiResponse } from './wire.js';

const EVENT_FIELDS = ['event_name', 'payload', 'identifier', 'timestamp'] as const;
/**
 * An RFC 3339 date-time with an explicit offset, which is what Stripe's v2 API reads and writes.
 * A bare date, a local time or unix seconds are refused: stripe-node turns a `Date` given as a
 * parameter into unix seconds, which this refuses rather than guessing what was meant.
 */
const ISO_DATE_TIME = /^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})$/;

/** One event of an accepted request, its shape checked, its meaning not yet. */
export interface StreamEvent {
  eventName: string;
  payload: Record<string, string>;
  identifier: string | undefined;
  /** Unix seconds (sub-second precision dropped); undefined means "when Stripe processes it". */
  timestamp: number | undefined;
}

/** What the request log keeps of a body, read before any validation. */
export function streamRequestKeys(body: unknown): { eventCount: number; identifiers: (string | null)[] } {
  const events = isRecord(body) && Array.isArray(body.events) ? (body.events as unknown[]) : [];
  const identifiers = events.map((event) => (isRecord(event) && typeof event.identifier === 'string' ? event.identifier : null));
  return { eventCount: events.length, identifiers };
}

/** The events to process later, or the 400 that refuses the whole request. */
export function parseStreamRequest(body: unknown): StreamEvent[] | ApiResponse {
  if (!isRecord(body)) return invalidRequest('The request body must be a JSON object: { "events": [...] }.');
  const unknown = Object.keys(body).find((key) => key !== 'events');
  if (unknown !== undefined) return invalidRequest(`Received unknown parameter: ${unknown}`, unknown, 'parameter_unknown');
  const events = body.events;
  if (events === undefined) return invalidRequest('Missing required param: events.', 'events', 'parameter_missing');
  if (!Array.isArray(events)) return invalidRequest('events must be an array of meter events.', 'events', 'parameter_invalid');
  if (events.length === 0) return invalidRequest('events must contain at least one meter event.', 'events', 'parameter_invalid');
  if (events.length > MAX_STREAM_BATCH) {
    return invalidRequest(
      `events has ${events.length} entries; a request carries at most ${MAX_STREAM_BATCH} meter events.`,
      'events',
      'parameter_invalid',
    );
  }
  const parsed: StreamEvent[] = [];
  for (const [index, event] of events.entries()) {
    const result = parseEvent(event, `events[${index}]`);
    if ('status' in result) return result;
    parsed.push(result);
  }
  return parsed;
}

function parseEvent(event: unknown, at: string): StreamEvent | ApiResponse {
  if (!isRecord(event)) return invalidRequest(`${at} must be an object.`, at, 'parameter_invalid');
  const unknown = Object.keys(event).find((key) => !(EVENT_FIELDS as readonly string[]).includes(key));
  if (unknown !== undefined) return invalidRequest(`Received unknown parameter: ${at}.${unknown}`, `${at}.${unknown}`, 'parameter_unknown');

  const eventName = event.event_name;
  if (eventName === undefined) return invalidRequest(`Missing required param: ${at}.event_name.`, `${at}.event_name`, 'parameter_missing');
  if (typeof eventName !== 'string' || eventName === '') return invalid(`${at}.event_name`, 'must be a non-empty string');
  if (eventName.length > MAX_EVENT_NAME_LENGTH) return tooLong(`${at}.event_name`, MAX_EVENT_NAME_LENGTH);

  const payload = event.payload;
  if (payload === undefined) return invalidRequest(`Missing required param: ${at}.payload.`, `${at}.payload`, 'parameter_missing');
  if (!isRecord(payload)) return invalid(`${at}.payload`, 'must be an object of string values');
  const strings: Record<string, string> = {};
  for (const [key, value] of Object.entries(payload)) {
    // A number would be the natural mistake for the value; Stripe's payload is strings only.
    if (typeof value !== 'string') return invalid(`${at}.payload.${key}`, 'must be a string');
    strings[key] = value;
  }

  const identifier = event.identifier;
  if (identifier !== undefined) {
    if (typeof identifier !== 'string' || identifier === '') return invalid(`${at}.identifier`, 'must be a non-empty string');
    if (identifier.length > MAX_IDENTIFIER_LENGTH) return tooLong(`${at}.identifier`, MAX_IDENTIFIER_LENGTH);
  }

  const rawTimestamp = event.timestamp;
  let timestamp: number | undefined;
  if (rawTimestamp !== undefined) {
    const ms = typeof rawTimestamp === 'string' && ISO_DATE_TIME.test(rawTimestamp) ? Date.parse(rawTimestamp) : NaN;
    if (Number.isNaN(ms)) {
      return invalid(`${at}.timestamp`, `must be an ISO-8601 date-time such as 2026-03-10T12:00:00.000Z (got ${JSON.stringify(rawTimestamp)})`);
    }
    timestamp = Math.floor(ms / 1000);
  }
  return { eventName, payload: strings, identifier, timestamp };
}

/**
 * What Stripe's later validation makes of one event, checked at `nowMs` (its receipt): the event
 * to record, with `asyncError` set when it failed. A failed event is recorded too, as v1's are: it
 * holds its identifier and never counts.
 */
export function checkStreamEvent(event: StreamEvent, catalog: Catalog, nowMs: number): MeterEventInput {
  const { eventName, payload, identifier, timestamp } = event;
  const meter = catalog.meterForEvent(eventName);
  const customerKey = meter?.customer_mapping.event_payload_key ?? 'stripe_customer_id';
  const valueKey = meter?.value_settings.event_payload_key ?? 'value';
  const customer = payload[customerKey];
  const rawValue = payload[valueKey];
  const value = rawValue === undefined ? undefined : parseWholeNumber(rawValue);
  const base = { eventName, customer: customer ?? '', value: value ?? 0, payload, identifier, timestamp };

  const fail = (code: string, message: string): MeterEventInput => ({ ...base, asyncError: { code, message } });
  if (!meter) return fail('no_meter', `No active meter was found for event name '${eventName}'.`);
  if (!customer) return fail('meter_event_no_customer_defined', `The event payload has no customer under the meter's key '${customerKey}'.`);
  if (!catalog.customer(customer)) return { ...base, asyncError: customerNotFound(customer, customerKey) };
  if (rawValue === undefined || rawValue === '') {
    return fail('meter_event_invalid_value', `The event payload has no value under the meter's key '${valueKey}'.`);
  }
  if (value === undefined) {
    return fail('meter_event_invalid_value', `The value '${rawValue}' in payload[${valueKey}] is not a whole number of 0 or more.`);
  }
  const rangeProblem = timestamp === undefined ? undefined : timestampRangeProblem(timestamp, Math.floor(nowMs / 1000));
  return rangeProblem ? { ...base, asyncError: rangeProblem } : base;
}

function isRecord(value: unknown): value is Record<string, unknown> {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}

function invalid(param: string, problem: string): ApiResponse {
  return invalidRequest(`Invalid ${param}: ${problem}.`, param, 'parameter_invalid');
}

function tooLong(param: string, max: number): ApiResponse {
  return invalidRequest(`${param} is too long (maximum is ${max} characters).`, param, 'string_length_exceeds');
}
