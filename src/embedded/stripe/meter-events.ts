/**
 * Validation of POST /v1/billing/meter_events parameters and the shape of its answer.
 *
 * As at Stripe, a 200 here means "received": the request's shape (parameters, lengths, the value,
 * the timestamp's range) and the event name's meter are checked at once, and what depends on the
 * account's data later. An event whose customer Stripe does not have, or whose payload lacks the
 * keys its meter reads (`customer_mapping.event_payload_key`, `value_settings.event_payload_key`),
 * is answered 200, never counted, and named in the next `v1.billing.meter.error_report_triggered`
 * (error-reports.ts). `asyncErrorNext` makes any accepted event fail so.
 */
import { MAX_EVENT_AGE_MS, MAX_EVENT_FUTURE_MS, MAX_EVENT_NAME_LENGTH, MAX_IDENTIFIER_LENGTH } from '../../stripe/rules.js';
import type { Catalog } from './catalog.js';
import type { AsyncErrorInfo, RecordedMeterEvent } from './types.js';
import { flatStrings, invalidRequest, missingParam, objectParam, stringParam, unknownParams, type ApiResponse, type FormObject } from './wire.js';

const PAST_LIMIT_SECONDS = MAX_EVENT_AGE_MS / 1000;
const FUTURE_LIMIT_SECONDS = MAX_EVENT_FUTURE_MS / 1000;
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
  /** Set when the payload does not carry its meter's keys: accepted now, rejected asynchronously. */
  asyncError?: AsyncErrorInfo;
}

/** The fields the concurrency rule and the request log need, read before any validation. */
export function meterEventKeys(form: FormObject, catalog: Catalog): { eventName: string | null; customer: string | null; identifier: string | null } {
  const eventName = stringParam(form, 'event_name') ?? null;
  const customerKey = (eventName && catalog.meterForEvent(eventName)?.customer_mapping.event_payload_key) ?? 'stripe_customer_id';
  return {
    eventName,
    customer: stringParam(objectParam(form, 'payload'), customerKey) ?? null,
    identifier: stringParam(form, 'identifier') ?? null,
  };
}

/** Returns the event to record, or the 400 Stripe answers. */
export function validateMeterEvent(form: FormObject, catalog: Catalog, nowMs: number): MeterEventInput | ApiResponse {
  const unknown = unknownParams(form, ALLOWED_PARAMS);
  if (unknown) return unknown;

  const eventName = stringParam(form, 'event_name');
  if (!eventName) return missingParam('event_name');
  if (eventName.length > MAX_EVENT_NAME_LENGTH) return tooLong('event_name', MAX_EVENT_NAME_LENGTH);

  const payload = flatStrings(objectParam(form, 'payload'));
  const meter = catalog.meterForEvent(eventName);
  const customerKey = meter?.customer_mapping.event_payload_key ?? 'stripe_customer_id';
  const valueKey = meter?.value_settings.event_payload_key ?? 'value';
  const customer = payload[customerKey];
  const rawValue = payload[valueKey];
  // Keys the meter does not read, or a customer the account does not have: Stripe takes the event
  // and rejects it in its next error report.
  let asyncError: MeterEventInput['asyncError'];
  if (meter && !customer) {
    asyncError = { code: 'meter_event_no_customer_defined', message: `The event payload has no customer under the meter's key '${customerKey}'.` };
  } else if (meter && customer && !catalog.customer(customer)) {
    asyncError = customerNotFound(customer, customerKey);
  } else if (meter && (rawValue === undefined || rawValue === '')) {
    asyncError = { code: 'meter_event_invalid_value', message: `The event payload has no value under the meter's key '${valueKey}'.` };
  }
  const value = rawValue === undefined || rawValue === '' ? 0 : parseWholeNumber(rawValue);
  if (value === undefined) {
    return invalidRequest(
      `Invalid payload[${valueKey}]: '${rawValue}'. The value must be a whole number of 0 or more.`,
      `payload[${valueKey}]`,
      'meter_event_invalid_value',
    );
  }

  const identifier = stringParam(form, 'identifier');
  if (identifier !== undefined && identifier.length > MAX_IDENTIFIER_LENGTH) return tooLong('identifier', MAX_IDENTIFIER_LENGTH);
  if (identifier === '') return invalidRequest('identifier must not be empty.', 'identifier');

  const timestamp = parseTimestamp(stringParam(form, 'timestamp'));
  if (timestamp === 'invalid') {
    return invalidRequest(`Invalid integer: ${String(stringParam(form, 'timestamp'))}`, 'timestamp', 'parameter_invalid_integer');
  }

  if (!meter) {
    return invalidRequest(`No active meter was found for event name '${eventName}'.`, 'event_name', 'no_meter');
  }
  if (timestamp !== undefined) {
    const rangeError = checkTimestampRange(timestamp, Math.floor(nowMs / 1000));
    if (rangeError) return rangeError;
  }
  return { eventName, customer: customer ?? '', value, payload, identifier, timestamp, ...(asyncError ? { asyncError } : {}) };
}

/** What the error report says of an event naming a customer Stripe does not have (v1 and the stream alike). */
export function customerNotFound(customer: string, customerKey: string): AsyncErrorInfo {
  return { code: 'meter_event_customer_not_found', message: `No customer was found with the id '${customer}' in payload[${customerKey}].` };
}

/** The v1 answer to a timestamp out of range: a 400 there, where the stream reports it later. */
function checkTimestampRange(timestamp: number, nowSeconds: number): ApiResponse | undefined {
  const problem = timestampRangeProblem(timestamp, nowSeconds);
  return problem && invalidRequest(problem.message, 'timestamp', problem.code);
}

/** Stripe accepts events up to 35 days old and at most 5 minutes ahead of its clock. */
export function timestampRangeProblem(timestamp: number, nowSeconds: number): AsyncErrorInfo | undefined {
  if (timestamp < nowSeconds - PAST_LIMIT_SECONDS) {
    return {
      code: 'timestamp_too_far_in_past',
      message: `Timestamp ${timestamp} is more than 35 days in the past. Meter events must be sent within 35 days of their usage.`,
    };
  }
  if (timestamp > nowSeconds + FUTURE_LIMIT_SECONDS) {
    return { code: 'timestamp_in_future', message: `Timestamp ${timestamp} is more than 5 minutes in the future.` };
  }
  return undefined;
}

/** A meter value: a whole number of 0 or more, as digits. */
export function parseWholeNumber(raw: string): number | undefined {
  if (!/^\d+$/.test(raw)) return undefined;
  const value = Number(raw);
  return Number.isSafeInteger(value) ? value : undefined;
}

function parseTimestamp(raw: string | undefined): number | undefined | 'invalid' {
  if (raw === undefined) return undefined;
  return /^-?\d+$/.test(raw) && Number.isSafeInteger(Number(raw)) ? Number(raw) : 'invalid';
}

function tooLong(param: string, max: number): ApiResponse {
  return invalidRequest(`${param} is too long (maximum is ${max} characters).`, param, 'string_length_exceeds');
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
