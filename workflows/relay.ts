/**
 * A long-lived relay: loops over the relay activity and continues-as-new to keep its history short.
 * Several run at once (RELAY_COUNT), each with a fixed id, started idempotently by every worker (at
 * boot, and again whenever one is found closed: src/temporal/worker.ts).
 */
import { makeContinueAsNewFunc, proxyActivities, workflowInfo } from '@temporalio/workflow';
import type { RelayActivities } from '../activities/relay.js';
import { RELAY_CALLS_PER_RUN, type RelayWorkflowInput } from './shared.js';

const { relayOutbox } = proxyActivities<RelayActivities>({
  // An activity call runs for about a minute; the heartbeat timeout is what notices a dead worker.
  startToCloseTimeout: '5 minutes',
  heartbeatTimeout: '15 seconds',
  retry: { initialInterval: '1 second', backoffCoefficient: 2, maximumInterval: '30 seconds' },
});

export async function relayWorkflow(input: RelayWorkflowInput): Promise<never> {
  const callsPerRun = input.callsPerRun ?? RELAY_CALLS_PER_RUN;
  for (let i = 0; i < callsPerRun && !workflowInfo().continueAsNewSuggested; i++) {
    await relayOutbox(input.relayId);
  }
  // The next run takes this release's figure, and keeps the memo saying whose relay it is.
  return makeContinueAsNewFunc<typeof relayWorkflow>({ memo: workflowInfo().memo ?? {} })({ ...input, callsPerRun: RELAY_CALLS_PER_RUN });
}
