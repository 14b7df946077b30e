/**
 * The shapes billing-outbox is measured against, on the same server in the same run: the bare ones
 * (the fastest any per-event workflow can go here, with nothing of ours in it), and one local
 * activity started with billing-outbox's start and input (`usageStartShape`).
 */
import { proxyActivities, proxyLocalActivities } from '@temporalio/workflow';
import type { DeliveryActivities } from '../../activities/delivery.js';
import type { UsageWorkflowInput } from '../../workflows/shared.js';
import type { ShapeActivities } from './activities.js';

const { work } = proxyActivities<ShapeActivities>({ startToCloseTimeout: '1 minute' });
const { work: workLocally } = proxyLocalActivities<ShapeActivities>({ startToCloseTimeout: '1 minute' });

export async function emptyShape(): Promise<void> {}

export async function oneActivityShape(): Promise<void> {
  await work();
}

export async function oneLocalActivityShape(): Promise<void> {
  await workLocally();
}

/**
 * One local activity, started as billing-outbox starts its workflow (its input, search attributes,
 * summary and fairness key) and calling the delivery (stubbed) with its argument: what the start and
 * the payloads cost, without billing-outbox's workflow code around the call.
 */
export async function usageStartShape(input: UsageWorkflowInput): Promise<number> {
  const { deliverUsage } = proxyLocalActivities<Pick<DeliveryActivities, 'deliverUsage'>>({
    startToCloseTimeout: input.retry.attemptTimeoutMs,
    retry: { maximumAttempts: 1 },
  });
  return (await deliverUsage({ key: input.key })).attempts;
}
