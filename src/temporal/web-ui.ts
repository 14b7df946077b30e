/**
 * Links into the Temporal Web UI: an event's page (its workflow id is its idempotency key) and the
 * list views operators use, as ready-made queries on the `OutboxStatus`, `OutboxError` and
 * `TenantId` search attributes (docs/operations.md shows them).
 *
 * Why the dead-letter link filters and does not just list: a dead letter's run stays open for its
 * retry, so the Web UI's default list badges it Running, like every event in flight and the relays.
 * Only the search attributes tell them apart, and which columns the list shows is each browser's
 * own setting (README, "Inspect stuck events"), so the link itself must carry the distinction.
 */
export interface WebUiLinks {
  workflow(workflowId: string): string;
  /** Dead letters waiting for a retry. */
  dead: string;
  /** Dead letters that died of one error code (the row's `last_error_code`, the OutboxError attribute). */
  deadWithError(code: string): string;
  /** Events between dispatch and Stripe's answer. */
  inFlight: string;
  /** Every event of one tenant. */
  tenant(tenantId: string): string;
}

export const LIST_QUERIES = {
  dead: 'WorkflowType="usageWorkflow" AND OutboxStatus="dead" AND ExecutionStatus="Running"',
  deadWithError: (code: string) => `WorkflowType="usageWorkflow" AND OutboxStatus="dead" AND ExecutionStatus="Running" AND OutboxError=${JSON.stringify(code)}`,
  inFlight: 'WorkflowType="usageWorkflow" AND ExecutionStatus="Running" AND OutboxStatus!="dead"',
  tenant: (tenantId: string) => `WorkflowType="usageWorkflow" AND TenantId=${JSON.stringify(tenantId)}`,
} as const;

export function webUiLinks(uiBase: string, namespace: string): WebUiLinks {
  const base = `${uiBase.replace(/\/+$/, '')}/namespaces/${encodeURIComponent(namespace)}/workflows`;
  const list = (query: string) => `${base}?query=${encodeURIComponent(query)}`;
  return {
    workflow: (workflowId) => `${base}/${encodeURIComponent(workflowId)}`,
    dead: list(LIST_QUERIES.dead),
    deadWithError: (code) => list(LIST_QUERIES.deadWithError(code)),
    inFlight: list(LIST_QUERIES.inFlight),
    tenant: (tenantId) => list(LIST_QUERIES.tenant(tenantId)),
  };
}
