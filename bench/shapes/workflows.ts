/**
 * The bare shapes billing-outbox is measured against, on the same server in the same run: the
 * fastest any per-event workflow can go here, with nothing of ours in it.
 */
import { proxyActivities, proxyLocalActivities } from '@temporalio/workflow';
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
