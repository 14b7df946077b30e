/**
 * Starting a usage workflow, from the client side: the relay activity and an operator's reopen
 * (src/ops/retry.ts) both start runs here, so the id, the policies, the input and the search
 * attributes are decided in one place.
 */
import { WorkflowExecutionAlreadyStartedError, type Client } from '@temporalio/client';
import type { Config } from '../config.js';
import { OutboxStatusKey, TenantIdKey, type UsageWorkflowInput } from '../../workflows/shared.js';

/** What identifies the event to start: its outbox row's key and tenant (and what it is, for the Web UI). */
export interface UsageEventRef {
  idempotency_key: string;
  tenant_id: string;
  event_name?: string;
  quantity?: string | number;
  occurred_at?: Date;
}

/**
 * The run's static summary in the Web UI's list and page: tenant, quantity, meter, time. Set once at
 * start (the run's current details tell what is happening now).
 */
export function usageSummary(row: UsageEventRef): string {
  const what = row.quantity !== undefined && row.event_name ? `${row.quantity} × ${row.event_name}` : 'usage';
  const when = row.occurred_at ? ` at ${row.occurred_at.toISOString()}` : '';
  return `${row.tenant_id}: ${what}${when}`;
}

/**
 * How a usage workflow is started, by the relay and by an operator's reopen alike: workflow id =
 * idempotency key, conflict policy FAIL (never a second run beside a running one). The relay uses
 * reuse policy REJECT_DUPLICATE (never a second run after one ever ran); only the CLI's guarded
 * reopen of a dead letter whose workflow has closed passes ALLOW_DUPLICATE.
 */
export function usageWorkflowStartOptions(
  row: UsageEventRef,
  config: Pick<Config, 'retry' | 'temporal'>,
  opts: { reusePolicy: 'REJECT_DUPLICATE' | 'ALLOW_DUPLICATE'; force?: boolean },
) {
  const input: UsageWorkflowInput = {
    key: row.idempotency_key,
    tenantId: row.tenant_id,
    retry: config.retry,
    ...(opts.force ? { force: true } : {}),
  };
  return {
    workflowId: row.idempotency_key,
    taskQueue: config.temporal.taskQueue,
    args: [input] as [UsageWorkflowInput],
    workflowIdConflictPolicy: 'FAIL' as const,
    workflowIdReusePolicy: opts.reusePolicy,
    typedSearchAttributes: [
      { key: OutboxStatusKey, value: 'dispatched' },
      { key: TenantIdKey, value: row.tenant_id },
    ],
    staticSummary: usageSummary(row),
  };
}

/**
 * Starts the usage workflow of one event for the relay. Workflow id = idempotency key, and the
 * policies make a second run impossible: FAIL if one is running, REJECT_DUPLICATE if one ever ran
 * (within the namespace's retention). Either refusal means the event is already in Temporal's
 * hands: returns false then.
 */
export async function startUsageWorkflow(
  client: Client,
  row: UsageEventRef,
  config: Pick<Config, 'retry' | 'temporal'>,
  opts: { eager?: boolean } = {},
): Promise<boolean> {
  try {
    await client.workflow.start('usageWorkflow', {
      ...usageWorkflowStartOptions(row, config, { reusePolicy: 'REJECT_DUPLICATE' }),
      // Eager start (`eager`: only for a client on a worker's own NativeConnection, as the relay's
      // is): the server hands the run's first workflow task straight back in the start's answer,
      // to that worker, saving a round trip through matching. The server may decline; then it is
      // an ordinary start.
      ...(opts.eager ? { requestEagerStart: true } : {}),
    });
    return true;
  } catch (err) {
    if (err instanceof WorkflowExecutionAlreadyStartedError) return false;
    throw err;
  }
}

