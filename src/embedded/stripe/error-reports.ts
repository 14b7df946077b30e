/**
 * Asynchronous validation errors: `v1.billing.meter.error_report_triggered`.
 *
 * A 200 from the meter events endpoint means "received", not "billed". Stripe validates some
 * things later, groups the failures per meter over a short window, and publishes one event per
 * meter. It is a *thin* event (Stripe's v2 event system): the webhook body carries only
 * `{ id, object: 'v2.core.event', type, created, related_object, … }`, signed like any webhook,
 * and the receiver fetches the full event — whose `data.reason` lists the failed identifiers —
 * from GET /v2/core/events/:id. stripe-node handles it with `stripe.parseEventNotification(…)` and
 * `notification.fetchEvent()`; `stripe.webhooks.constructEvent` refuses thin events by design.
 *
 * Failures of events whose event name has no meter (only the v2 stream accepts those) cannot be
 * filed under a meter: they go out as `v1.billing.meter.no_meter_found`, the same shape without a
 * related object.
 */
import { createHmac } from 'node:crypto';
import type { AsyncErrorInfo, WebhookTarget } from './types.js';
import { newId } from './wire.js';

export const ERROR_REPORT_EVENT = 'v1.billing.meter.error_report_triggered';
export const NO_METER_EVENT = 'v1.billing.meter.no_meter_found';
/** Real Stripe only promises a sample of the failed requests; here every one up to this cap. */
const MAX_SAMPLES_PER_CODE = 100;
const DELIVERY_TIMEOUT_MS = 5000;

export interface FailedMeterEvent extends AsyncErrorInfo {
  /** null: no meter has the event's name. */
  meterId: string | null;
  identifier: string;
  /** ms by the simulated clock */
  receivedAt: number;
}

export interface ErrorReportEvent {
  id: string;
  object: 'v2.core.event';
  type: typeof ERROR_REPORT_EVENT | typeof NO_METER_EVENT;
  created: string;
  livemode: false;
  context: null;
  reason: null;
  related_object: { id: string; type: 'billing.meter'; url: string } | null;
  data: {
    developer_message_summary: string;
    reason: {
      error_count: number;
      error_types: {
        code: string;
        error_count: number;
        sample_errors: { error_message: string; request: { identifier: string } }[];
      }[];
    };
    validation_start: string;
    validation_end: string;
  };
}

export interface WebhookDelivery {
  eventId: string;
  /** HTTP status of the receiver's answer, when there was one. */
  status?: number;
  error?: string;
}

/** Redeliveries of a report its receiver did not take: 1 s, doubling, at most a minute apart (Stripe's go on for days). */
const REDELIVERY_FIRST_MS = 1_000;
const REDELIVERY_MAX_MS = 60_000;

export class ErrorReporter {
  private pending: FailedMeterEvent[] = [];
  private timer: NodeJS.Timeout | undefined;
  private published: ErrorReportEvent[] = [];
  /** Reports no receiver has answered 2xx yet, with the redeliveries made so far. */
  private readonly undelivered = new Map<string, number>();
  private readonly redeliveries = new Set<NodeJS.Timeout>();
  private deliveryLog: WebhookDelivery[] = [];
  private readonly inFlight = new Map<string, Promise<void>>();
  /** Counted up by reset(): a delivery begun before it leaves no trace after it. */
  private generation = 0;

  private readonly now: () => number;
  private webhook: WebhookTarget | undefined;
  /** How long failures collect before a report goes out (Stripe batches them per window). */
  private readonly batchDelayMs: number;
  constructor(
    now: () => number,
    webhook: WebhookTarget | undefined,
    batchDelayMs = 50,
  ) {
    this.now = now;
    this.webhook = webhook;
    this.batchDelayMs = batchDelayMs;
  }

  add(failure: FailedMeterEvent): void {
    this.pending.push(failure);
    this.timer ??= setTimeout(() => void this.flush(), this.batchDelayMs);
  }

  /**
   * Where reports go from now on (undefined: nowhere). Every report not yet taken is delivered to
   * it at once: a receiver that listens only after this server started (a stack's own API) gets
   * what failed meanwhile.
   */
  setWebhook(target: WebhookTarget | undefined): void {
    this.webhook = target;
    for (const id of this.undelivered.keys()) this.deliver(id);
  }

  /** Publishes everything pending now and waits until every webhook delivery under way has finished. */
  async flush(): Promise<void> {
    this.publishPending();
    await Promise.all([...this.inFlight.values()]);
  }

  /** Builds the reports of the failures collected so far, and starts their delivery. */
  publishPending(): void {
    clearTimeout(this.timer);
    this.timer = undefined;
    const batch = this.pending;
    this.pending = [];
    for (const event of buildReports(batch, this.now())) {
      this.published.push(event);
      this.undelivered.set(event.id, 0);
      this.deliver(event.id);
    }
  }

  event(id: string): ErrorReportEvent | undefined {
    return this.published.find((event) => event.id === id);
  }

  /** Newest first, like Stripe's event lists. */
  events(): ErrorReportEvent[] {
    return [...this.published].reverse();
  }

  deliveries(): WebhookDelivery[] {
    return this.deliveryLog.map((d) => ({ ...d }));
  }

  /** Changes whenever state() would, or a failure waits for its report. */
  get mark(): string {
    return `${this.pending.length}/${this.published.length}/${this.undelivered.size}`;
  }

  /** Every report, oldest first, and the ids of those no receiver took yet (LocalStripeState). */
  state(): { reports: ErrorReportEvent[]; undelivered: string[] } {
    return { reports: [...this.published], undelivered: [...this.undelivered.keys()] };
  }

  /** Reports of an earlier run; those not taken then are delivered once a webhook is set. */
  restore(reports: ErrorReportEvent[], undelivered: string[]): void {
    this.published = [...reports];
    for (const id of undelivered) if (this.event(id)) this.undelivered.set(id, 0);
    for (const id of this.undelivered.keys()) this.deliver(id);
  }

  reset(): void {
    this.generation++;
    this.stopTimers();
    this.pending = [];
    this.published = [];
    this.undelivered.clear();
    this.deliveryLog = [];
  }

  /** Drops what is pending, stops redelivering, and waits for deliveries already on their way. */
  async close(): Promise<void> {
    this.stopTimers();
    this.pending = [];
    this.webhook = undefined;
    await Promise.all([...this.inFlight.values()]);
  }

  private stopTimers(): void {
    clearTimeout(this.timer);
    this.timer = undefined;
    for (const t of this.redeliveries) clearTimeout(t);
    this.redeliveries.clear();
  }

  /**
   * One delivery of report `id`, unless one is under way or there is no receiver. A receiver that
   * did not answer 2xx (down, refused the signature, failed) gets it again later, as from Stripe.
   */
  private deliver(id: string): void {
    const webhook = this.webhook;
    const event = this.event(id);
    if (!webhook || !event || this.inFlight.has(id) || !this.undelivered.has(id)) return;
    const generation = this.generation;
    const delivery = this.post(event, webhook).then((outcome) => {
      // Forgotten meanwhile (reset): no trace of it.
      if (generation !== this.generation) return;
      this.deliveryLog.push(outcome);
      if (outcome.status !== undefined && outcome.status >= 200 && outcome.status < 300) {
        this.undelivered.delete(id);
        return;
      }
      const tries = (this.undelivered.get(id) ?? 0) + 1;
      this.undelivered.set(id, tries);
      // No receiver any more (closed, or unset): it waits for the next setWebhook.
      if (!this.webhook) return;
      const retry = setTimeout(() => {
        this.redeliveries.delete(retry);
        this.deliver(id);
      }, Math.min(REDELIVERY_FIRST_MS * 2 ** (tries - 1), REDELIVERY_MAX_MS));
      retry.unref();
      this.redeliveries.add(retry);
    });
    this.inFlight.set(id, delivery);
    void delivery.finally(() => this.inFlight.delete(id));
  }

  /** One POST of the report's thin notification, and what came of it. */
  private async post(event: ErrorReportEvent, webhook: WebhookTarget): Promise<WebhookDelivery> {
    const body = JSON.stringify(thinNotification(event));
    try {
      const response = await fetch(webhook.url, {
        method: 'POST',
        headers: {
          'content-type': 'application/json; charset=utf-8',
          'stripe-signature': signatureHeader(body, webhook.secret),
          'user-agent': 'Stripe/1.0 (+https://stripe.com/docs/webhooks) local',
        },
        body,
        signal: AbortSignal.timeout(DELIVERY_TIMEOUT_MS),
      });
      await response.arrayBuffer();
      return { eventId: event.id, status: response.status };
    } catch (error) {
      return { eventId: event.id, error: error instanceof Error ? error.message : String(error) };
    }
  }
}

/**
 * Stripe's webhook signature: `t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<raw body>">`.
 * `t` is real time, not the simulated clock: receivers reject signatures older than 5 minutes by
 * their own clock.
 */
export function signatureHeader(rawBody: string, secret: string, timestampSeconds = Math.floor(Date.now() / 1000)): string {
  const signature = createHmac('sha256', secret).update(`${timestampSeconds}.${rawBody}`, 'utf8').digest('hex');
  return `t=${timestampSeconds},v1=${signature}`;
}

/** What a webhook receives: the event without `data`, which must be fetched. */
function thinNotification(event: ErrorReportEvent): Omit<ErrorReportEvent, 'data'> {
  const { data: _data, ...thin } = event;
  return thin;
}

/** One event per meter (and one for events without a meter), its failures grouped by error code. */
function buildReports(batch: FailedMeterEvent[], nowMs: number): ErrorReportEvent[] {
  const byMeter = groupBy(batch, (failure) => failure.meterId ?? '');
  return [...byMeter].map(([meterId, failures]) => {
    const byCode = groupBy(failures, (failure) => failure.code);
    const count = failures.length;
    const firstReceived = Math.min(...failures.map((f) => f.receivedAt));
    return {
      id: newId('evt_local', 24),
      object: 'v2.core.event',
      type: meterId ? ERROR_REPORT_EVENT : NO_METER_EVENT,
      created: new Date(nowMs).toISOString(),
      livemode: false,
      context: null,
      reason: null,
      related_object: meterId ? { id: meterId, type: 'billing.meter', url: `/v1/billing/meters/${meterId}` } : null,
      data: {
        developer_message_summary: count === 1 ? 'There is 1 invalid event' : `There are ${count} invalid events`,
        reason: {
          error_count: count,
          error_types: [...byCode].map(([code, ofCode]) => ({
            code,
            error_count: ofCode.length,
            sample_errors: ofCode.slice(0, MAX_SAMPLES_PER_CODE).map((f) => ({
              error_message: f.message,
              request: { identifier: f.identifier },
            })),
          })),
        },
        validation_start: new Date(Math.floor(firstReceived / 1000) * 1000).toISOString(),
        validation_end: new Date(nowMs).toISOString(),
      },
    };
  });
}

function groupBy<T>(items: T[], key: (item: T) => string): Map<string, T[]> {
  const groups = new Map<string, T[]>();
  for (const item of items) {
    const k = key(item);
    const group = groups.get(k);
    if (group) group.push(item);
    else groups.set(k, [item]);
  }
  return groups;
}
