/**
 * GET /v1/billing/meters/:id/event_summaries — what Stripe counted, the way a pipeline reconciles.
 *
 * Aggregates `payload[value]` of the meter's billable events (those it took while active; not
 * cancelled, not failed validation) by their usage `timestamp`, for one customer, over [start_time, end_time), by the meter's formula: the
 * values summed, the events counted, or the value of the latest event. Real Stripe aggregates
 * asynchronously (eventually consistent); here a summary is exact as soon as the event is accepted.
 */
import { createHash } from 'node:crypto';
import type { MeterObject } from './catalog.js';
import type { RecordedMeterEvent } from './types.js';
import { invalidRequest, list, missingParam, type ApiResponse } from './wire.js';

const WINDOW_SECONDS = { hour: 3600, day: 86400 } as const;
type GroupingWindow = keyof typeof WINDOW_SECONDS;

interface SummaryQuery {
  customer: string;
  start: number;
  end: number;
  window: GroupingWindow | undefined;
}

export interface MeterEventSummary {
  id: string;
  object: 'billing.meter_event_summary';
  aggregated_value: number;
  start_time: number;
  end_time: number;
  meter: string;
  livemode: false;
}

export function eventSummaries(meter: MeterObject, query: URLSearchParams, events: readonly RecordedMeterEvent[]): ApiResponse {
  const parsed = parseQuery(query);
  if ('status' in parsed) return parsed;
  // The meter's own events: those it took while active (a meter replaced since keeps them).
  const relevant = events.filter(
    (e) => (e.meterId === undefined ? e.eventName === meter.event_name : e.meterId === meter.id) && e.customer === parsed.customer && e.timestamp >= parsed.start && e.timestamp < parsed.end,
  );
  const summaries = parsed.window
    ? windowedSummaries(meter, parsed, relevant, WINDOW_SECONDS[parsed.window])
    : [summary(meter, parsed.customer, parsed.start, parsed.end, aggregate(meter, relevant))];
  return list(summaries, `/v1/billing/meters/${meter.id}/event_summaries`, query);
}

/** One summary per window that has usage, newest first (the order Stripe's examples show). */
function windowedSummaries(meter: MeterObject, q: SummaryQuery, events: readonly RecordedMeterEvent[], size: number): MeterEventSummary[] {
  const byWindow = new Map<number, RecordedMeterEvent[]>();
  for (const event of events) {
    const windowStart = Math.floor(event.timestamp / size) * size;
    const inWindow = byWindow.get(windowStart);
    if (inWindow) inWindow.push(event);
    else byWindow.set(windowStart, [event]);
  }
  return [...byWindow.entries()]
    .sort(([a], [b]) => b - a)
    .map(([start, inWindow]) => summary(meter, q.customer, start, start + size, aggregate(meter, inWindow)));
}

/** The events' aggregated value by the meter's formula (`last`: the latest by timestamp, then by arrival). */
function aggregate(meter: MeterObject, events: readonly RecordedMeterEvent[]): number {
  switch (meter.default_aggregation.formula) {
    case 'count':
      return events.length;
    case 'last':
      return events.reduce<RecordedMeterEvent | undefined>((latest, e) => (!latest || e.timestamp >= latest.timestamp ? e : latest), undefined)?.value ?? 0;
    default:
      return events.reduce((total, event) => total + event.value, 0);
  }
}

function summary(meter: MeterObject, customer: string, start: number, end: number, total: number): MeterEventSummary {
  // Deterministic, so `starting_after` keeps working across calls.
  const digest = createHash('sha256').update(`${meter.id}|${customer}|${start}|${end}`).digest('hex').slice(0, 24);
  return {
    id: `mtrusg_local_${digest}`,
    object: 'billing.meter_event_summary',
    aggregated_value: total,
    start_time: start,
    end_time: end,
    meter: meter.id,
    livemode: false,
  };
}

function parseQuery(query: URLSearchParams): SummaryQuery | ApiResponse {
  const customer = query.get('customer');
  if (!customer) return missingParam('customer');
  const start = parseAlignedTime(query, 'start_time');
  if (typeof start !== 'number') return start;
  const end = parseAlignedTime(query, 'end_time');
  if (typeof end !== 'number') return end;
  if (start >= end) return invalidRequest('start_time must be before end_time.', 'start_time');

  const rawWindow = query.get('value_grouping_window');
  if (rawWindow === null) return { customer, start, end, window: undefined };
  if (rawWindow !== 'hour' && rawWindow !== 'day') {
    return invalidRequest(`Invalid value_grouping_window: must be one of hour or day.`, 'value_grouping_window');
  }
  // Grouped summaries need the range to start and end on window boundaries (UTC days for `day`).
  const size = WINDOW_SECONDS[rawWindow];
  for (const [param, value] of [['start_time', start], ['end_time', end]] as const) {
    if (value % size !== 0) {
      return invalidRequest(`${param} must be aligned with ${rawWindow} boundaries when value_grouping_window is ${rawWindow}.`, param);
    }
  }
  return { customer, start, end, window: rawWindow };
}

/** Summary ranges are unix seconds on minute boundaries. */
function parseAlignedTime(query: URLSearchParams, param: string): number | ApiResponse {
  const raw = query.get(param);
  if (raw === null || raw === '') return missingParam(param);
  if (!/^\d+$/.test(raw)) return invalidRequest(`Invalid integer: ${raw}`, param, 'parameter_invalid_integer');
  const value = Number(raw);
  if (value % 60 !== 0) return invalidRequest(`${param} must be aligned with minute boundaries.`, param);
  return value;
}
