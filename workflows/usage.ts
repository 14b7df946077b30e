/**
 * One usage event's journey to Stripe. Workflow id = the event's idempotency key.
 *
 * Temporal's retry policy does the backoff between attempts. When the attempts run out (or Stripe
 * refuses the event for good) the row becomes a dead letter, and this workflow stays open waiting
 * for an operator's `retry` signal, so the dead letter is visible in the Web UI and can be resent
 * with the same identifier.
 */
import {
  ActivityFailure,
  ApplicationFailure,
  condition,
  proxyActivities,
  setHandler,
  upsertSearchAttributes,
} from '@temporalio/workflow';
import type { DeliveryActivities } from '../activities/delivery.js';
import {
  ErrorTypes,
  OutboxStatusKey,
  retrySignal,
  stateQuery,
  type OutboxStatus,
  type RetryRequest,
  type UsageState,
  type UsageWorkflowInput,
} from './shared.js';

export async function usageWorkflow(input: UsageWorkflowInput): Promise<UsageState> {
  const { deliverUsage } = proxyActivities<DeliveryActivities>({
    startToCloseTimeout: input.retry.attemptTimeoutMs ?? '2 minutes',
    retry: {
      initialInterval: input.retry.initialIntervalMs,
      backoffCoefficient: input.retry.backoffCoefficient,
      maximumInterval: input.retry.maximumIntervalMs,
      maximumAttempts: input.retry.maximumAttempts,
      nonRetryableErrorTypes: [ErrorTypes.rejected, ErrorTypes.missing, ErrorTypes.unsafeToSend],
    },
  });
  // Bookkeeping on our own database: retried until it works, whatever the delivery policy says.
  const { markDead, markRetrying } = proxyActivities<DeliveryActivities>({
    startToCloseTimeout: '30 seconds',
    retry: { initialInterval: '1 second', maximumInterval: '1 minute' },
  });

  const state: UsageState = { status: 'dispatched', attempts: 0, lastError: null };
  let requested: RetryRequest | undefined;
  let force = input.force === true;
  setHandler(stateQuery, () => state);
  setHandler(retrySignal, (request: RetryRequest = {}) => {
    // Only a dead letter can be retried; a retry sent while the event is in flight means nothing.
    if (state.status === 'dead') requested = request;
  });

  /** Waits for an operator's retry signal (one sent before the event was dead does not count). */
  const nextRetry = async (): Promise<RetryRequest> => {
    requested = undefined;
    await condition(() => requested !== undefined);
    return requested ?? {};
  };

  const setStatus = (status: OutboxStatus) => {
    state.status = status;
    upsertSearchAttributes([{ key: OutboxStatusKey, value: status }]);
  };

  for (;;) {
    try {
      const result = await deliverUsage({ key: input.key, force });
      state.attempts = result.attempts;
      state.lastError = null;
      setStatus('sent');
      return state;
    } catch (err) {
      if (!(err instanceof ActivityFailure)) throw err;
      state.lastError = describeFailure(err);
      state.attempts = await markDead({ key: input.key, ...state.lastError });
      setStatus('dead');
    }
    force = (await nextRetry()).force === true;
    await markRetrying(input.key);
    setStatus('dispatched');
  }
}

/** The code and message the delivery activity attached to its last failure. */
function describeFailure(err: ActivityFailure): { code: string; message: string } {
  const cause = err.cause;
  if (cause instanceof ApplicationFailure) {
    const code = typeof cause.details?.[0] === 'string' ? cause.details[0] : (cause.type ?? 'error');
    return { code, message: cause.message };
  }
  // Timeouts and cancellations carry no ApplicationFailure.
  return { code: cause?.name ?? 'activity_failure', message: cause?.message ?? err.message };
}
