/**
 * Every activity the worker registers, built from its dependencies (real clients are made in one
 * place: src/temporal/worker.ts). Workflows import only the types.
 */
import { createDeliveryActivities, type DeliveryDeps } from './delivery.js';
import { createRelayActivities, type RelayDeps } from './relay.js';

export type ActivityDeps = DeliveryDeps & RelayDeps;

export function createActivities(deps: ActivityDeps) {
  return { ...createDeliveryActivities(deps), ...createRelayActivities(deps) };
}

export type Activities = ReturnType<typeof createActivities>;
