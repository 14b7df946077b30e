/**
 * POST /v1/billing/meter_event_adjustments with `type=cancel`: the only correction Stripe offers
 * for a meter event, and only within 24 hours of Stripe receiving it. After that, wrong usage can
 * only be offset (e.g. by a credit), which is why a pipeline must not send an event twice.
 */
import { DAY_MS, type MeterEventLedger } from './ledger.js';
import { invalidRequest, json, missingParam, objectParam, stringParam, unknownParams, type ApiResponse, type FormObject } from './wire.js';

const ALLOWED_PARAMS = ['event_name', 'type', 'cancel', 'expand'] as const;

export function createAdjustment(form: FormObject, ledger: MeterEventLedger, nowMs: number): ApiResponse {
  const unknown = unknownParams(form, ALLOWED_PARAMS);
  if (unknown) return unknown;
  const eventName = stringParam(form, 'event_name');
  if (!eventName) return missingParam('event_name');
  const type = stringParam(form, 'type');
  if (!type) return missingParam('type');
  if (type !== 'cancel') return invalidRequest(`Invalid type: must be one of cancel.`, 'type');
  const identifier = stringParam(objectParam(form, 'cancel'), 'identifier');
  if (!identifier) return missingParam('cancel[identifier]');

  const event = ledger.latest(identifier);
  if (!event || event.eventName !== eventName) {
    return {
      ...invalidRequest(`No meter event with identifier '${identifier}' and event name '${eventName}' was found.`, 'cancel[identifier]', 'resource_missing'),
      executed: true,
    };
  }
  if (nowMs - event.receivedAt >= DAY_MS) {
    return {
      ...invalidRequest(
        `The meter event with identifier '${identifier}' was received more than 24 hours ago ` +
          `(${new Date(event.receivedAt).toISOString()}); only events received within the last 24 hours can be cancelled.`,
        'cancel[identifier]',
      ),
      executed: true,
    };
  }
  // A cancel is taken once, like the event it cancels: a second cancel of the same event under
  // another Idempotency-Key is refused (a 400 that resending cannot change), not answered as if it
  // were the first. Stripe documents no wording for this refusal: this one is ours (see
  // src/ops/cancel.ts, which also reads it), so that repeated cancels are exercised at all.
  if (event.cancelled) return alreadyCancelled(identifier);
  ledger.cancel(event);
  return json({
    object: 'billing.meter_event_adjustment',
    event_name: eventName,
    status: 'pending',
    type: 'cancel',
    cancel: { identifier },
    livemode: false,
  });
}

/**
 * The answer to a second cancel of one event. Like "An event already exists with identifier …" for
 * a resent meter event, it carries no error code: the message is the only signal.
 */
export function alreadyCancelled(identifier: string): ApiResponse {
  const response = invalidRequest(`The meter event with identifier '${identifier}' has already been cancelled.`, 'cancel[identifier]');
  return { ...response, headers: { 'stripe-should-retry': 'false' }, executed: true };
}
