/**
 * Activities of the usage workflow: report one event to Stripe, and keep its outbox row current.
 *
 * A thin factory (Temporal's activities-dependency-injection sample): the activity composes named
 * parts, each in its own module and tested on its own:
 * - `lease`: the (customer, meter) lease and its wait (src/stripe/meter-lease.ts), v1 only;
 * - `pacer`: the account-wide pace of Stripe calls (src/stripe/rate-limit.ts), v1 only (the v2
 *   stream paces its own requests);
 * - `maySendNow`: the pure check before sending (src/stripe/send-check.ts);
 * - `sender`: v1 calls or the v2 stream, one interface (src/stripe/sender.ts);
 * - `classifyStripeError`: how each failure is treated, decided where the call is made (src/stripe/errors.ts);
 * - `store`: the outbox row's statements (src/outbox/sql/delivery.ts).
 */
import { activityInfo, ApplicationFailure, Context, log } from '@temporalio/activity';
import Stripe from 'stripe';
import type { Config } from '../src/config.js';
import { isDatabaseUnavailable } from '../src/db.js';
import type { DeliveryMetrics } from '../src/metrics.js';
import type { AttemptRow, DeadMark, DeliveryStore, Marked } from '../src/outbox/sql/delivery.js';
import { isAtStripe, isUnbilled, type OutboxStatus } from '../src/outbox/statuses.js';
import { classifyStripeError, CREDENTIALS_REFUSED, looksDown, neverReachedStripe, StreamSessionError } from '../src/stripe/errors.js';
import { leaseHolder, type Lease, type WaitContext } from '../src/stripe/meter-lease.js';
import type { MeterCatalog, MeterEvent, MeterKeys } from '../src/stripe/meters.js';
import { outageWatch, type OutageWatch } from '../src/stripe/outage.js';
import type { SlotPacer } from '../src/stripe/rate-limit.js';
import { SAFE_RESEND_WINDOW_MS } from '../src/stripe/rules.js';
import { maySendNow, noMeterRefusal, PAST_SEND_MARGIN_MS, SEND_MARGIN_MS, type AttemptFound, type Refusal } from '../src/stripe/send-check.js';
import type { MeterEventSender } from '../src/stripe/sender.js';
import { ErrorTypes, type DeferralReason, type DeliverInput, type DeliveryResult, type OutageHold } from '../workflows/shared.js';

export type { DeliveryResult };

export interface DeliveryDeps {
  /** The outbox row's bookkeeping. */
  store: DeliveryStore;
  /** v1 calls or the v2 stream (STRIPE_METER_API). */
  sender: MeterEventSender;
  /** v1: the (customer, meter) lease. */
  lease: Lease;
  /** v1: a slot of the account-wide pace for each call. */
  pacer: Pick<SlotPacer, 'take' | 'keepPace'>;
  /** The payload keys of each meter (read from Stripe, cached). */
  meters: Pick<MeterCatalog, 'keysFor'> & Partial<Pick<MeterCatalog, 'swapLeftMs' | 'refresh' | 'lastRead'>>;
  config: Pick<Config, 'timings'>;
  /** This process's counters; nothing is recorded without it. */
  metrics?: DeliveryMetrics;
  /** Whether Stripe is down, judged by this process's calls (one is made from the timings without it). */
  outage?: OutageWatch;
  /**
   * Tells the event's run that the event was delivered after its attempt had timed out (its
   * `rowChanged` signal): a run that has made the row dead meanwhile reads it, finds it at Stripe
   * and ends delivered. Without it, such a run shows a dead letter until it closes.
   */
  tellRunDeliveredLate?: (key: string) => Promise<void>;
}

/** An attempt that ends this close to its start-to-close timeout may have been timed out by Temporal. */
const LATE_MARGIN_MS = 1_000;

/** How often a delivery whose meter is being replaced looks for the new one. */
const METER_SWAP_RETRY_MS = 15_000;

/** Stripe's codes for an event whose meter is not active (v1 answers them at once). */
const METER_GONE_CODES = ['no_meter', 'archived_meter'];

function fail(type: string, code: string, message: string): ApplicationFailure {
  return ApplicationFailure.create({ type, message, details: [code], nonRetryable: true });
}

/** A begun attempt that passed the check: what to send. */
interface Ready {
  row: AttemptRow;
  customer: string;
  keys: MeterKeys;
}

/** How far one attempt got: `begun` once its beginAttempt statement is sent (answered or not). */
interface Progress {
  begun: boolean;
  /** The run's last try of Stripe was held as Stripe down (DeliverInput.heldByOutage). */
  heldByOutage?: OutageHold | undefined;
}

/** The lease's fate after the attempt. */
interface AfterCall {
  /** Already handed on by the row's own update (markSentAndHandOff). */
  handedOff: boolean;
  /** The call's outcome is unknown (no answer): Stripe may still be working on it. */
  unanswered: boolean;
}

export function createDeliveryActivities(deps: DeliveryDeps) {
  const { store, sender, lease, pacer, meters, metrics } = deps;
  const t = deps.config.timings;
  // A 5xx or no answer waits longer than the retry policy only while Stripe fails this way for
  // everyone; a wait this long after the one before is a new stretch.
  const outage = deps.outage ?? outageWatch({ afterMs: t.outageAfterMs, quietMs: t.outageQuietMs });
  // The gauge says what this worker sees now: held deliveries come back within outageRetryMaxMs and
  // a quarter, and one that has met none of their failures for longer is not seeing an outage
  // (the judgement itself stays up to outageQuietMs, for the next failure).
  metrics?.watchStripeDown(() => outage.downSince(t.outageRetryMaxMs * 1.25));
  // When the outage this process last said so in its log began.
  let announcedDown: number | null = null;
  /**
   * Put off without spending an attempt. Attempts of this activity that failed before (Temporal
   * retried them within it) are reported, so the workflow spends them from the event's budget.
   */
  const deferred = (reason: DeferralReason, waitMs: number, attempts: number, begun = true): Extract<DeliveryResult, { outcome: 'deferred' }> => ({
    outcome: 'deferred',
    reason,
    waitMs,
    attempts,
    failedBefore: activityInfo().attempt - 1,
    ...(begun ? {} : { begun: false as const }),
  });
  /**
   * Counted once the row is marked delivered, timed from its commit. `marked` null: the row was not
   * the attempt's to mark any more (rebilled under a new identifier revision, rejected by Stripe's
   * later validation, cancelled): Stripe's answer is about the identifier this attempt sent, so it
   * is logged, not counted, and a row rejected or cancelled meanwhile is said, for the run to end
   * listed as that rather than as one more delivered event.
   */
  const acknowledged = async (key: string, outcome: 'sent' | 'accepted' | 'duplicate', { attempts: marked, first }: Marked, row: AttemptRow): Promise<DeliveryResult> => {
    outage.answered();
    // The SDK's activity logger adds the workflow id, run id and attempt to every line.
    if (marked === null) {
      log.warn('meter event acknowledged by Stripe, but the row moved on meanwhile and was left as it is', {
        idempotencyKey: key,
        outcome,
        identifier: row.identifier,
        identifierRevision: row.identifier_revision,
      });
      // Only read on this rare path; unreadable (our database away), the run ends as before.
      const now = await store.findRow(key).catch(() => undefined);
      if (now && isUnbilled(now.status)) return { outcome: 'already_sent', attempts: row.attempt_count, status: now.status };
      return { outcome, attempts: row.attempt_count };
    }
    log.info('meter event acknowledged by Stripe', { idempotencyKey: key, outcome, attempts: marked });
    // Once per event: another attempt's mark of a row already delivered is not a second event.
    if (first) {
      metrics?.eventsSent.inc();
      metrics?.commitToAck.observe(Math.max(0, Date.now() - row.created_at.getTime()) / 1000);
    }
    return { outcome, attempts: marked };
  };

  return {
    /**
     * One attempt to report the event: count the attempt, call Stripe once, mark the row
     * delivered. Each failure is classified here, where the call is made, into an
     * ApplicationFailure whose type tells Temporal (and the workflow) whether another attempt can help.
     */
    async deliverUsage(input: DeliverInput): Promise<DeliveryResult> {
      // A liveness signal for the whole attempt (v1: waiting for the lease, pacing, the call; v2:
      // waiting for a batch's turn and the stream request): a worker that dies is noticed by the
      // heartbeat timeout, not only by the attempt's timeout, and a slow but live attempt is not
      // taken for a dead one. Not in the workflow task: a local activity has no heartbeat on the
      // server (each one would be answered UnknownActivity); its workflow task is its liveness.
      const ctx = Context.current();
      const beat = activityInfo().isLocal ? undefined : setInterval(() => ctx.heartbeat(), t.heartbeatEveryMs);
      // Set as the attempt's first statement on the row goes out (beginAttempt): before it, the row
      // is untouched, and a forced retry's force is not used up.
      const progress: Progress = { begun: false, heldByOutage: input.heldByOutage };
      const startedAt = performance.now();
      try {
        const result = await (sender.api === 'v1' ? attemptUnderLease(input, progress) : attemptByStream(input, progress));
        // Delivered after Temporal gave up on this attempt (a v2 request queued behind a slow
        // Stripe, an event loop starved past the heartbeat timeout): its answer goes nowhere, and
        // if it was the last attempt the run has marked the row dead, though the row now says
        // sent. The run is told (a run still delivering ignores it). Gone at Temporal shows as a
        // cancellation of the attempt (a heartbeat answered "not found"), or as its time run out.
        const late = ctx.cancellationSignal.aborted || performance.now() - startedAt >= activityInfo().startToCloseTimeoutMs - LATE_MARGIN_MS;
        if (result.outcome !== 'deferred' && late) {
          await deps.tellRunDeliveredLate?.(input.key).catch((err: unknown) => {
            log.warn('delivered after the attempt timed out; could not tell its run', { idempotencyKey: input.key, error: String(err) });
          });
        }
        return result;
      } catch (err) {
        // PostgreSQL away (before the call, or after it when the row could not be marked): not the
        // event's failure. The workflow waits and comes back without spending an attempt; a call
        // made again is caught by Stripe's identifier dedup, and past 23 h by the resend guard.
        if (!isDatabaseUnavailable(err)) throw err;
        log.warn('database unavailable during delivery; waiting it out', { idempotencyKey: input.key, error: String(err) });
        return deferred('database_unavailable', t.databaseRetryMs + Math.floor(Math.random() * 1_000), 0, progress.begun);
      } finally {
        clearInterval(beat);
      }
    },

    /**
     * After the last attempt: the row becomes a dead letter carrying the final error. Returns its
     * attempts and when its resend window began (null when no attempt reached Stripe).
     */
    async markDead(input: { key: string; code: string; message: string }): Promise<DeadMark> {
      return store.markRowDead(input.key, input.code, input.message);
    },

    /** What the row is now (null: no row), for a dead letter's run told its row changed. */
    async readRowStatus(key: string): Promise<OutboxStatus | null> {
      return (await store.findRow(key))?.status ?? null;
    },

    /** An operator's retry reopened the dead letter in its open run: the row is back in flight. */
    async markReopened(key: string): Promise<void> {
      await store.markRowReopened(key);
    },
  };

  /** One v1 attempt: wait for the (customer, meter) lease, then pace, begin and make the call. */
  async function attemptUnderLease(input: DeliverInput, progress: Progress): Promise<DeliveryResult> {
    const ctx = Context.current();
    const info = activityInfo();
    const holder = leaseHolder({
      workflowId: info.workflowExecution?.workflowId ?? input.key,
      runId: info.workflowExecution?.runId ?? '',
      attempt: info.attempt,
    });
    const after: AfterCall = { handedOff: false, unanswered: false };
    // In the workflow task the lease is waited for a moment only, and its wait cannot heartbeat.
    const inTask = info.isLocal;
    const waitCtx: WaitContext = inTask ? { cancellationSignal: ctx.cancellationSignal, sleep: (ms) => ctx.sleep(ms), heartbeat: () => undefined } : ctx;
    try {
      for (;;) {
        const got = await lease.wait(input.key, holder, waitCtx, inTask ? t.inTaskLeaseWaitMs : t.leaseWaitMs);
        if (got === 'gave_up') return deferred('lease_busy', t.leaseBusyRetryMs, 0, progress.begun);
        const result = await callUnderLease(input, holder, got === 'acquired', after, ctx, progress);
        // The lease lapsed before the call could begin (a hand-off not taken up in time), or it is
        // the pair of the customer the tenant was mapped to before a remap: back in the queue (of
        // the pair the call is made with now), nothing sent, nothing counted. What the holder still
        // has goes to the next delivery waiting for it first, not left to lapse.
        if (result !== 'lease_lost') return result;
        await lease.handOff(holder);
      }
    } finally {
      // Unless the row's update already did: hands the lease (or our place in its queue) to the
      // next waiting delivery, in this process at once, elsewhere by NOTIFY. If this fails
      // (PostgreSQL away), the lease lapses by itself; the outcome stands. After a call that got no
      // answer, nobody gets it until `unansweredHoldMs` have passed: Stripe may still be on it.
      if (after.unanswered) {
        await lease.hold(holder).catch(() => undefined);
      } else if (!after.handedOff) {
        await lease.handOff(holder).catch((err: unknown) => {
          log.warn('could not hand the lease off; it will lapse', { idempotencyKey: input.key, error: String(err) });
        });
      }
    }
  }

  /** One v1 call under the lease (`leased`: held; not held only when the event has no target). */
  async function callUnderLease(
    { key, force = false }: DeliverInput,
    holder: string,
    leased: boolean,
    after: AfterCall,
    ctx: WaitContext,
    progress: Progress,
  ): Promise<DeliveryResult | 'lease_lost'> {
    const workflowId = activityInfo().workflowExecution?.workflowId ?? key;
    // Our place in the account-wide pace, reserved while the attempt begins: both are on the path
    // between one call of a (customer, meter) and the next.
    // Intervals on the monotonic clock: a wall clock stepped back would hide a lapsed lease.
    const leaseFrom = performance.now();
    progress.begun = true;
    const [slot, begun] = await Promise.all([
      // When its slot falls, counted from the pace's answer: time the attempt's statement takes after it is lateness.
      pacer.take().then((s) => ({ ...s, at: performance.now() + s.waitMs })),
      store.beginAttempt(key, {
        workflowId,
        safeWindowMs: SAFE_RESEND_WINDOW_MS,
        force,
        // Extended to cover the call, and checked still ours: only then is the attempt begun.
        ...(leased ? { lease: { holder, leaseMs: t.leaseMs } } : {}),
      }),
    ]);
    if (!begun.leaseHeld) {
      // Its statement changed nothing on the row without the lease: not begun after all.
      progress.begun = false;
      return 'lease_lost';
    }
    const row = begun.row;
    if (!slot.granted) {
      // The account-wide queue is over `maxPacingWaitMs` long (rare: relays dispatch at the same
      // pace): the workflow waits it out on a timer. Begun but no call made: not counted.
      await undoIfCounted(key, row);
      return deferred('paced', Math.max(100, slot.waitMs - t.maxPacingWaitMs / 2) + Math.floor(Math.random() * t.rateLimitJitterMs), 0);
    }
    const untilSlot = slot.at - performance.now();
    if (untilSlot > 0) await ctx.sleep(untilSlot);
    const ready = await readyToSend(key, row, progress);
    if ('outcome' in ready) return ready;
    // The lease must outlast the call (and the pace's wait before it). If this process stalled since
    // it was extended (a long GC pause, a starved CPU) it is renewed, checked still ours; a lapsed
    // one is never called on: the attempt is undone and the delivery queues again.
    if (leased && performance.now() + t.callTimeoutMs > leaseFrom + t.leaseMs - t.leaseRenewSlackMs && !(await lease.renew(holder))) {
      await undoIfCounted(key, row);
      return 'lease_lost';
    }
    /** Marks the row sent and hands the lease off, in one statement. */
    const sent = async () => {
      const { handOffs, ...marked } = await store.markSentAndHandOff(key, holder, t.handOffMs, ready.row.identifier_revision);
      after.handedOff = true;
      lease.handedOff(handOffs);
      return marked;
    };
    try {
      await pacer.keepPace(slot.at, t.lateToleranceMs, (ms) => ctx.sleep(ms));
      await sender.send(meterEvent(key, ready));
    } catch (err) {
      // The pace statement failed on our own PostgreSQL: nothing was sent. Not the event's
      // failure: deferred without spending an attempt (deliverUsage), as on v2.
      if (ourDatabaseFailed(err)) throw err;
      // No answer: Stripe may still be on it, unless the connection never existed (refused, host
      // not found), when nothing was sent and the next delivery of the lease may go at once.
      if (err instanceof Stripe.errors.StripeConnectionError && !neverReachedStripe(err)) after.unanswered = true;
      return failed(key, ready.row, err, sent, { progress, sentToMeter: ready.keys.meterId });
    }
    return acknowledged(key, 'sent', await sent(), ready.row);
  }

  /**
   * One attempt through the v2 meter event stream: no (customer, meter) lease (the stream has no
   * such rule) and no per-event pace (the stream paces its requests); the event goes out in the
   * worker's next batch, and the row becomes `accepted`: Stripe validates it later.
   */
  async function attemptByStream({ key, force = false }: DeliverInput, progress: Progress): Promise<DeliveryResult> {
    const workflowId = activityInfo().workflowExecution?.workflowId ?? key;
    progress.begun = true;
    const begun = await store.beginAttempt(key, { workflowId, safeWindowMs: SAFE_RESEND_WINDOW_MS, force });
    const ready = await readyToSend(key, begun.row, progress);
    if ('outcome' in ready) return ready;
    const accepted = () => store.markDelivered(key, 'accepted', ready.row.identifier_revision);
    try {
      await sender.send(meterEvent(key, ready));
    } catch (err) {
      // The batch's request never left: our own PostgreSQL failed its pace statement. Not the
      // event's failure: deferred without spending an attempt (deliverUsage), as on v1.
      if (ourDatabaseFailed(err)) throw err;
      // Nor for want of a session: the attempt is taken back (no 23 h window started by a call
      // never made), and Temporal tries again, or the key's refusal holds it.
      if (err instanceof StreamSessionError) {
        await undoIfCounted(key, ready.row);
        return failed(key, ready.row, err, accepted, { takenBack: true, progress });
      }
      return failed(key, ready.row, err, accepted, { progress });
    }
    return acknowledged(key, 'accepted', await accepted(), ready.row);
  }

  /** A failure of our own PostgreSQL around a call (its pace statement), not Stripe's answer. */
  function ourDatabaseFailed(err: unknown): boolean {
    return !(err instanceof Stripe.errors.StripeError) && isDatabaseUnavailable(err);
  }

  /**
   * The event as Stripe gets it, built once for either API. Its identifier is the row's, read by
   * the attempt's own statement (src/outbox/keys.ts `stripeIdentifierFor`: the key, unless a
   * namespace or a rebill makes it another).
   */
  function meterEvent(_key: string, { row, customer, keys }: Ready): MeterEvent {
    return { eventName: row.event_name, keys, stripeCustomerId: customer, quantity: row.quantity, identifier: row.identifier, occurredAt: row.occurred_at };
  }

  /** An attempt begun but no call made (the pace put it off, the lease lapsed): not counted. */
  async function undoIfCounted(key: string, row: AttemptRow | undefined): Promise<void> {
    if (row && !isAtStripe(row.status)) await store.undoAttempt(key, { wasFirst: row.attempt_count === 1 });
  }

  /**
   * What stands between a begun attempt and the call (maySendNow), then the meter's payload keys
   * (read from Stripe). Each refusal is recorded on the row and thrown as a non-retryable failure;
   * an event Stripe already has ends the attempt as `already_sent`.
   */
  async function readyToSend(key: string, row: AttemptRow | undefined, progress: Progress): Promise<DeliveryResult | Ready> {
    let found: AttemptFound;
    if (row) {
      found = { begun: true, status: row.status, stripeCustomerId: row.stripe_customer_id, occurredAt: row.occurred_at };
    } else {
      const existing = await store.findRow(key);
      found = existing
        ? { begun: false, exists: true, firstAttemptedAt: existing.first_attempted_at, lastError: existing.last_error_code ? `${existing.last_error_code}: ${existing.last_error_message ?? ''}` : null }
        : { begun: false, exists: false, key };
    }
    // By Stripe's clock where the sender measures it (v2), else by ours (v1: Stripe's refusal says
    // so, and is retried). Not measurable now (no stream session to be had): failed as the call
    // would have, the attempt taken back; never judged on an unmeasured clock.
    let skewMs = 0;
    // Only where the time is judged: a row already at Stripe, or without its customer, is decided without it.
    if (row && sender.clockSkewMs && !isAtStripe(row.status) && row.stripe_customer_id) {
      try {
        skewMs = await sender.clockSkewMs();
      } catch (err) {
        return failedBeforeTheCall(key, row, err, progress);
      }
    }
    const check = maySendNow(found, Date.now() + skewMs, sender.api === 'v2' ? PAST_SEND_MARGIN_MS : SEND_MARGIN_MS);
    if (check.verdict === 'refuse' || check.verdict === 'wait') {
      // No call is made: the attempt is taken back, so a refusal for a missing customer or meter,
      // or a wait for the clock, neither counts nor starts the 23 h resend window.
      await undoIfCounted(key, row);
      if (check.verdict === 'wait') return deferred('stamped_ahead', check.waitMs + 1_000, row?.attempt_count ?? 0);
      return refuse(key, check.refusal);
    }
    if (check.verdict === 'already_at_stripe' || !row) {
      return { outcome: 'already_sent', attempts: row?.attempt_count ?? 0, ...(row && isAtStripe(row.status) ? { status: row.status } : {}) };
    }
    // Reading the meter list can fail like any call to Stripe: classified as one. No meter event
    // was sent, so the attempt is taken back (a 23 h resend window is not started by a call that
    // never happened).
    let keys: MeterKeys | undefined;
    try {
      keys = await meters.keysFor(row.event_name);
    } catch (err) {
      return failedBeforeTheCall(key, row, err, progress);
    }
    if (!keys) {
      await undoIfCounted(key, row);
      // Deactivated a moment ago with no active meter since: an operator replacing it. Waited for
      // (METER_SWAP_MS at most), not dead at once for want of a meter about to exist.
      const swapLeftMs = meters.swapLeftMs?.(row.event_name) ?? 0;
      if (swapLeftMs > 0) return waitForMeterSwap(key, row, swapLeftMs);
      return refuse(key, noMeterRefusal(row.event_name));
    }
    return { row, customer: check.stripeCustomerId, keys };
  }

  /**
   * The event's meter is being replaced (deactivated, none active yet: MeterCatalog.swapLeftMs), or
   * was a moment ago: waited for, the reason on the row, no attempt spent (the caller took it back).
   */
  async function waitForMeterSwap(key: string, row: AttemptRow, swapLeftMs: number): Promise<DeliveryResult> {
    await store.recordAttemptError(
      key,
      'meter_replacing',
      `Stripe has no active meter for event name ${JSON.stringify(row.event_name)} since it deactivated one moments ago: waiting for its replacement (15 minutes at most), no attempt spent`,
    );
    return deferred('meter_replacing', Math.min(METER_SWAP_RETRY_MS, swapLeftMs) + Math.floor(Math.random() * 1_000), row.attempt_count);
  }

  /**
   * v1: Stripe refused the event for want of an active meter although this worker's meter list
   * (up to a minute old) had one: read again. A meter being replaced is waited for; one replaced
   * already (another meter for the name) is sent to on the next try. Undefined: refused for good.
   */
  async function meterChangedSince(key: string, row: AttemptRow, failure: { code: string; message: string }, sentTo: string | undefined, takenBack: boolean): Promise<DeliveryResult | undefined> {
    if (sentTo === undefined || !meters.refresh || !meters.lastRead) return undefined;
    try {
      await meters.refresh();
    } catch (err) {
      // Not known whether the meter is gone or being replaced: another attempt will tell, within
      // the event's budget (this one stays counted).
      const message = `${failure.message} (and the meter list could not be read again to tell a meter being replaced: ${String(err)})`;
      await store.recordAttemptError(key, failure.code, message);
      throw ApplicationFailure.create({ type: ErrorTypes.retryable, message, details: [failure.code] });
    }
    const now = meters.lastRead(row.event_name);
    const swapLeftMs = now ? (now.meterId === sentTo ? 0 : 1_000) : (meters.swapLeftMs?.(row.event_name) ?? 0);
    if (swapLeftMs === 0) return undefined;
    if (!takenBack) await undoIfCounted(key, row);
    return waitForMeterSwap(key, row, swapLeftMs);
  }

  /** A call to Stripe made before the meter event's (the meter list, a stream session) failed: classified as one, the attempt taken back. */
  async function failedBeforeTheCall(key: string, row: AttemptRow, err: unknown, progress: Progress): Promise<DeliveryResult> {
    await undoIfCounted(key, row);
    return failed(key, row, err, async () => ({ attempts: row.attempt_count, first: false }), { takenBack: true, progress });
  }

  async function refuse(key: string, r: Refusal): Promise<never> {
    if (r.record) await store.recordAttemptError(key, r.code, r.message);
    if (r.metricClass) metrics?.stripeErrors.inc({ class: r.metricClass });
    throw fail(ErrorTypes[r.errorType], r.code, r.message);
  }

  /**
   * A call that did not simply succeed, classified where it was made: Stripe already had it
   * (delivered), a refusal for good, a 429 to wait out, or a failure another attempt may pass.
   */
  async function failed(
    key: string,
    row: AttemptRow,
    err: unknown,
    delivered: () => Promise<Marked>,
    opts: { takenBack?: boolean; progress?: Progress; sentToMeter?: string } = {},
  ): Promise<DeliveryResult> {
    if (err instanceof ApplicationFailure) throw err;
    const failure = classifyStripeError(err);
    // Any answer from Stripe ends an outage; an error of ours (not Stripe's) says nothing either way.
    const down = looksDown(err);
    const judged = down ? outage.failed(row.stripe_customer_id) : null;
    // A held delivery comes back on any worker: one that has not judged Stripe down itself takes
    // the judgement that held it, unless Stripe has answered it since, for up to outageQuietMs
    // after a worker last judged so by its own calls.
    const held = opts.progress?.heldByOutage;
    const carried = down && held && !outage.answeredSince(held.judgedAt) && Date.now() - held.judgedAt <= t.outageQuietMs ? held : undefined;
    const hold: OutageHold | null = judged !== null ? { since: judged, judgedAt: Date.now() } : (carried ?? null);
    if (!down && err instanceof Stripe.errors.StripeError) outage.answered();
    const waitsOutOutage = failure.kind === 'retryable' && hold !== null && mayWaitOutOutage(row);
    if (failure.kind === 'delivered') {
      const marked = await delivered();
      metrics?.stripeErrors.inc({ class: 'delivered_duplicate' });
      return acknowledged(key, 'duplicate', marked, row);
    }
    if (failure.kind === 'credentials') {
      // The deployment's key, not the event: Stripe did nothing with the call, so it is taken back
      // (no attempt spent, no 23 h window started) and the delivery waits on a timer until the key
      // works again. Loud meanwhile: an error line, the metric, `billing-outbox status`, the row.
      if (!opts.takenBack) await undoIfCounted(key, row);
      await store.recordAttemptError(key, CREDENTIALS_REFUSED, `Stripe refused the API key (${failure.code}): ${failure.message}`);
      metrics?.stripeErrors.inc({ class: failure.kind });
      log.error('Stripe refused the API key: delivery holds until STRIPE_API_KEY works again', { idempotencyKey: key, code: failure.code, message: failure.message });
      return deferred('stripe_credentials', t.credentialsRetryMs + Math.floor(Math.random() * t.rateLimitJitterMs), row.attempt_count);
    }
    if (failure.kind === 'rejected' && METER_GONE_CODES.includes(failure.code)) {
      const waiting = await meterChangedSince(key, row, failure, opts.sentToMeter, opts.takenBack ?? false);
      if (waiting) return waiting;
    }
    // Refused for good: nothing of the event is at Stripe (unless no meter event was sent at all,
    // as when the meter list was refused: an earlier call's customer is still the one to name).
    const message = waitsOutOutage ? `${failure.message} (Stripe down since ${new Date(hold.since).toISOString()}: waiting, no attempt spent)` : failure.message;
    await store.recordAttemptError(key, failure.code, message, { refused: failure.kind === 'rejected' && !opts.takenBack });
    metrics?.stripeErrors.inc({ class: failure.kind });
    log.warn('meter event call failed', { idempotencyKey: key, class: failure.kind, code: failure.code, message: failure.message });
    switch (failure.kind) {
      case 'rejected':
        throw fail(ErrorTypes.rejected, failure.code, failure.message);
      case 'rate_limited':
        // Stripe's Retry-After, plus jitter so that the refused calls do not come back as one burst.
        return deferred('rate_limited', (failure.retryAfterMs ?? t.rateLimitedWaitMs) + Math.floor(Math.random() * t.rateLimitJitterMs), row.attempt_count);
      case 'retryable':
        if (waitsOutOutage) return waitOutOutage(row, hold, judged !== null);
        throw ApplicationFailure.create({ type: ErrorTypes.retryable, message: failure.message, details: [failure.code] });
    }
  }

  /**
   * Whether this event may still wait out an outage: up to RETRY_MAX_OUTAGE_MS after its first
   * attempt, or after it was put in flight if that is earlier (a try that made no meter-event call,
   * the meter list or a stream session failing, is taken back and leaves no first attempt).
   */
  function mayWaitOutOutage(row: AttemptRow): boolean {
    const from = Math.min(row.first_attempted_at.getTime(), row.dispatched_at?.getTime() ?? Infinity);
    return t.maxOutageMs > 0 && Date.now() - from < t.maxOutageMs;
  }

  /**
   * Stripe is down (src/stripe/outage.ts): the delivery tries again after the outage's age so far
   * (15 s to 5 min, plus up to a quarter so the held deliveries do not come back as one burst),
   * without spending an attempt. The call was made, so the row keeps it counted: its 23 h window
   * stands, and Stripe's identifier dedup takes a copy of what it did receive.
   */
  function waitOutOutage(row: AttemptRow, hold: OutageHold, judgedHere: boolean): DeliveryResult {
    const { since } = hold;
    // Logged where it was judged: a hold passed on is another worker's judgement.
    if (judgedHere && announcedDown !== since) {
      announcedDown = since;
      log.error('Stripe looks down: calls for several customers fail with 5xx or no answer, with no other answer between. Deliveries wait without spending attempts (RETRY_MAX_OUTAGE_MS)', {
        since: new Date(since).toISOString(),
      });
    }
    const waitMs = Math.min(t.outageRetryMaxMs, Math.max(t.outageRetryMinMs, Date.now() - since));
    return { ...deferred('stripe_down', waitMs + Math.floor((Math.random() * waitMs) / 4), row.attempt_count), outageHold: hold };
  }
}

export type DeliveryActivities = ReturnType<typeof createDeliveryActivities>;
