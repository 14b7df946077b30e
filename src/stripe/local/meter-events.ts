/**
 * Validation of POST /v1/billing/meter_events parameters and the shape of its answer.
 *
 * Real Stripe runs some of these checks (unknown customer, no meter) after answering 200 and
 * reports failures through `v1.billing.meter.error_report_triggered`; here they are synchronous so
 * tests get a direct answer. `asyncErrorNext` simulates the asynchronous path.
 */
import type { Catalog } from './catalog.js';
import type { RecordedMeterEvent } from './types.js';
import { flatStrings, invalidRequest, missingParam, objectParam, stringParam, unknownParams, type ApiResponse, type FormObject } from './wire.js';

const MAX_NAME_LENGTH = 100;
const PAST_LIMIT_SECONDS = 35 * 24 * 60 * 60;
const FUTURE_LIMIT_SECONDS = 5 * 60;
const ALLOWED_PARAMS = ['event_name', 'payload', 'identifier', 'timestamp', 'expand'] as const;

export interface MeterEventInput {
  eventName: string;
  customer: string;
  value: number;
  payload: Record<string, string>;
  /** Undefined when the caller left it to Stripe. */
  identifier: string | undefined;
  /** Unix seconds; undefined means "now". */
  timestamp: number | undefined;
}

/** The fields the concurrency rule and the request log need, read before any validation. */
export function meterEventKeys(form: FormObject): { eventName: string | null; customer: string | null; identifier: string | null } {
  return {
    eventName: stringParam(form, 'event_name') ?? null,
    customer: stringParam(objectParam(form, 'payload'), 'stripe_customer_id') ?? null,
    identifier: stringParam(form, 'identifier') ?? null,
  };
}

/** Returns the event to record, or the 400 Stripe answers. */
export function validateMeterEvent(form: FormObject, catalog: Catalog, nowMs: number): MeterEventInput | ApiResponse {
  const unknown = unknownParams(form, ALLOWED_PARAMS);
  if (unknown) return unknown;

  const eventName = stringParam(form, 'event_name');
  if (!eventName) return missingParam('event_name');
  if (eventName.length > MAX_NAME_LENGTH) return tooLong('event_name');

  const payload = flatStrings(objectParam(form, 'payload'));
  const customer = payload['stripe_customer_id'];
  if (!customer) return missingParam('payload[stripe_customer_id]');
  const rawValue = payload['value'];
  if (rawValue === undefined || rawValue === '') return missingParam('payload[value]');
  const value = parseWholeNumber(rawValue);
  if (value === undefined) {
    return invalidRequest(
      `Invalid payload[value]: '${rawValue}'. The value must be a whole number of 0 or more.`,
      'payload[value]',
      'meter_event_invalid_value',
    );
  }

  const identifier = stringParam(form, 'identifier');
  if (identifier !== undefined && identifier.length > MAX_NAME_LENGTH) return tooLong('identifier');
  if (identifier === '') return invalidRequest('identifier must not be empty.', 'identifier');

  const timestamp = parseTimestamp(stringParam(form, 'timestamp'));
  if (timestamp === 'invalid') {
    return invalidRequest(`Invalid integer: ${String(stringParam(form, 'timestamp'))}`, 'timestamp', 'parameter_invalid_integer');
  }

  if (!catalog.meterForEvent(eventName)) {
    return invalidRequest(`No active meter was found for event name '${eventName}'.`, 'event_name', 'no_meter');
  }
  if (!catalog.customer(customer)) {
    return invalidRequest(`No such customer: '${customer}'`, 'payload[stripe_customer_id]', 'resource_missing');
  }
  if (timestamp !== undefined) {
    const rangeError = checkTimestampRange(timestamp, Math.floor(nowMs / 1000));
    if (rangeError) return rangeError;
  }
  return { eventName, customer, value, payload, identifier, timestamp };
}

/** Stripe accepts events up to 35 days old and at most 5 minutes ahead of its clock. */
function checkTimestampRange(timestamp: number, nowSeconds: number): ApiResponse | undefined {
  if (timestamp < nowSeconds - PAST_LIMIT_SECONDS) {
    return invalidRequest(
      `Timestamp ${timestamp} is more than 35 days in the past. Meter events must be sent within 35 days of their usage.`,
      'timestamp',
      'timestamp_too_far_in_past',
    );
  }
  if (timestamp > nowSeconds + FUTURE_LIMIT_SECONDS) {
    return invalidRequest(`Timestamp ${timestamp} is more than 5 minutes in the future.`, 'timestamp', 'timestamp_in_future');
  }
  return undefined;
}

function parseWholeNumber(raw: string): number | undefined {
  if (!/^\d+$/.test(raw)) return undefined;
  const value = Number(raw);
  return Number.isSafeInteger(value) ? value : undefined;
}

function parseTimestamp(raw: string | undefined): number | undefined | 'invalid' {
  if (raw === undefined) return undefined;
  return /^-?\d+$/.test(raw) && Number.isSafeInteger(Number(raw)) ? Number(raw) : 'invalid';
}

function tooLong(param: string): ApiResponse {
  return invalidRequest(`${param} is too long (maximum is ${MAX_NAME_LENGTH} characters).`, param, 'string_length_exceeds');
}

/** The "An event already exists" answer: the only signal that an earlier send was recorded. */
export function duplicateIdentifier(identifier: string): ApiResponse {
  const response = invalidRequest(`An event already exists with identifier ${identifier}.`);
  // Stripe tells its client libraries not to retry: resending cannot change the outcome.
  return { ...response, headers: { 'stripe-should-retry': 'false' } };
}

/** The 200 body: a `billing.meter_event`. */
export function meterEventBody(event: RecordedMeterEvent): Record<string, unknown> {
  return {
    object: 'billing.meter_event',
    created: Math.floor(event.receivedAt / 1000),
    event_name: event.eventName,
    identifier: event.identifier,
    livemode: false,
    payload: event.payload,
    timestamp: event.timestamp,
  };
}
