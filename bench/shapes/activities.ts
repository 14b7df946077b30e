import type { DeliveryActivities } from '../../activities/delivery.js';

/** The bare shapes' activity: does nothing, so the figure is Temporal's and the worker's alone. */
export const shapeActivities = {
  async work(): Promise<void> {},
};
export type ShapeActivities = typeof shapeActivities;

/**
 * billing-outbox's own workflow with its delivery answered at once (nothing sent, no row): what the
 * workflow's code and its start options cost beside the bare local activity, without the relay,
 * PostgreSQL or Stripe.
 */
export const stubbedDeliveryActivities: Pick<DeliveryActivities, 'deliverUsage' | 'markDead' | 'markReopened'> = {
  async deliverUsage() {
    return { outcome: 'sent', attempts: 1 };
  },
  async markDead() {
    return { attempts: 1, firstAttemptedAt: null };
  },
  async markReopened() {},
};
