/**
 * "May this event be sent now?": what stands between a begun attempt and the call, as a pure
 * function of what the attempt found and the time. The delivery activity records each refusal on
 * the row and throws it as a non-retryable failure of `errorType` (workflows/shared.ts ErrorTypes).
 */
import { isAtStripe, type OutboxStatus } from '../outbox/statuses.js';
import { inHours, MAX_EVENT_FUTURE_MS, SAFE_RESEND_WINDOW_MS, timestampProblem } from './rules.js';

/**
 * How far beyond Stripe's 5 future minutes (by Stripe's clock as this worker reads it) an event is waited for rather
 * than refused. An event ahead is clock skew (between the recording machine, this worker and
 * Stripe), which time mends; an hour is more skew than any machine kept in time has, and beyond it
 * the event is refused with its reason.
 */
export const MAX_AHEAD_WAIT_MS = 60 * 60_000;

/** What beginning the attempt found (src/outbox/sql/delivery.ts beginAttempt, then findRowByKey). */
export type AttemptFound =
  /** Begun (and counted, unless already at Stripe). */
  | { begun: true; status: OutboxStatus; stripeCustomerId: string | null; occurredAt: Date }
  /** Not begun: no such row. */
  | { begun: false; exists: false; key: string }
  /**
   * Not begun: the row's first attempt is older than the safe resend window, and no force. Its
   * last error (`code: message`), if any: what kept it failing until then.
   */
  | { begun: false; exists: true; firstAttemptedAt: Date | null; lastError?: string | null };

export interface Refusal {
  errorType: 'missing' | 'unsafeToSend' | 'rejected';
  code: string;
  message: string;
  /** Recorded on the row as its last error (a missing row has nowhere to record it). */
  record: boolean;
  /** Counted in billing_outbox_stripe_errors_total under this class (none: not counted). */
  metricClass?: 'unsafe' | 'rejected';
}

export type SendVerdict =
  | { verdict: 'send'; stripeCustomerId: string }
  /** Stamped ahead of Stripe's window by this clock, within skew: wait `waitMs`, then try again. */
  | { verdict: 'wait'; waitMs: number }
  /** Stripe already has it (and may since have rejected it, or we cancelled it): never again. */
  | { verdict: 'already_at_stripe' }
  | { verdict: 'refuse'; refusal: Refusal };

/**
 * How long an event may take from this check to Stripe's receipt of it (a v2 batch's wait, the
 * pace, the request, the two clocks a little apart): Stripe's timestamp window is judged that much
 * narrower at both ends.
 */
export const SEND_MARGIN_MS = 60_000;

/**
 * v2: the 35-day edge is judged as of five minutes on: an event the stream holds longer than its
 * attempt (a session renewed and the request sent again, 20 s each, after a 40 s attempt gave up)
 * still leaves inside Stripe's window, which the stream would otherwise drop without a word. v1
 * keeps SEND_MARGIN_MS: Stripe answers a call out of its window at once.
 */
export const PAST_SEND_MARGIN_MS = 5 * 60_000;

/**
 * The furthest ahead of the recording machine's clock a usage is taken at enqueue: as far as the
 * send check waits for (64 minutes). A machine whose clock runs a few minutes fast records usage
 * Stripe would take once the time comes; refusing it would lose it.
 */
export const MAX_RECORDED_AHEAD_MS = MAX_EVENT_FUTURE_MS - SEND_MARGIN_MS + MAX_AHEAD_WAIT_MS;

/**
 * In order: the row must exist and be inside the resend window (or forced: then it was begun),
 * not already at Stripe, mapped to a customer, and inside Stripe's timestamp window at `now`;
 * an event ahead of that window by clock skew (up to MAX_AHEAD_WAIT_MS) is waited for.
 */
export function maySendNow(found: AttemptFound, now: number, pastMarginMs = SEND_MARGIN_MS): SendVerdict {
  if (!found.begun) {
    if (!found.exists) {
      return { verdict: 'refuse', refusal: { errorType: 'missing', code: 'outbox_row_missing', message: `no outbox row with key ${found.key}`, record: false } };
    }
    const message =
      `first attempted ${found.firstAttemptedAt?.toISOString()}, more than ${inHours(SAFE_RESEND_WINDOW_MS)} h ago: ` +
      `Stripe's 24 h identifier dedup may no longer catch a duplicate. Reconcile, then retry with force.` +
      (found.lastError && !found.lastError.startsWith('identifier_window_expired:') ? ` Its last error: ${found.lastError}` : '');
    return { verdict: 'refuse', refusal: { errorType: 'unsafeToSend', code: 'identifier_window_expired', message, record: true, metricClass: 'unsafe' } };
  }
  if (isAtStripe(found.status)) return { verdict: 'already_at_stripe' };
  if (!found.stripeCustomerId) {
    return {
      verdict: 'refuse',
      refusal: { errorType: 'missing', code: 'customer_mapping_missing', message: 'the tenant has no Stripe customer mapping', record: true },
    };
  }
  // Judged as of SEND_MARGIN_MS from now, when Stripe may receive it: the stream drops an event
  // outside the window silently and later (v1 at least answers), so one sent at its edge was lost.
  const ahead = found.occurredAt.getTime() - now - (MAX_EVENT_FUTURE_MS - SEND_MARGIN_MS);
  if (ahead > 0 && ahead <= MAX_AHEAD_WAIT_MS) return { verdict: 'wait', waitMs: ahead };
  // An event ahead has been waited for above: here only the past edge, or far ahead, is refused.
  const outside = timestampProblem(found.occurredAt, now + pastMarginMs);
  if (outside) return { verdict: 'refuse', refusal: { errorType: 'unsafeToSend', ...outside, record: true, metricClass: 'unsafe' } };
  return { verdict: 'send', stripeCustomerId: found.stripeCustomerId };
}

/**
 * An event whose meter Stripe does not have: a payload under other keys would be accepted and
 * rejected later, so it is a dead letter now, with its reason.
 */
export function noMeterRefusal(eventName: string): Refusal {
  return {
    errorType: 'rejected',
    code: 'no_meter',
    message: `Stripe has no active meter for event name ${JSON.stringify(eventName)}: create the meter, then retry`,
    record: true,
    metricClass: 'rejected',
  };
}
