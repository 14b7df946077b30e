/**
 * Links into the Temporal Web UI: an event's page (its workflow id is its idempotency key) and the
 * list views operators use, as ready-made queries on the `OutboxStatus` and `TenantId` search
 * attributes (docs/operations.md shows them).
 */
export interface WebUiLinks {
  workflow(workflowId: string): string;
  /** Dead letters waiting for a retry signal. */
  dead: string;
  /** Events between dispatch and Stripe's answer. */
  inFlight: string;
  /** Every event of one tenant. */
  tenant(tenantId: string): string;
}

export const LIST_QUERIES = {
  dead: 'WorkflowType="usageWorkflow" AND OutboxStatus="dead" AND ExecutionStatus="Running"',
  inFlight: 'WorkflowType="usageWorkflow" AND ExecutionStatus="Running" AND OutboxStatus!="dead"',
  tenant: (tenantId: string) => `WorkflowType="usageWorkflow" AND TenantId=${JSON.stringify(tenantId)}`,
} as const;

export function webUiLinks(uiBase: string, namespace: string): WebUiLinks {
  const base = `${uiBase.replace(/\/+$/, '')}/namespaces/${encodeURIComponent(namespace)}/workflows`;
  const list = (query: string) => `${base}?query=${encodeURIComponent(query)}`;
  return {
    workflow: (workflowId) => `${base}/${encodeURIComponent(workflowId)}`,
    dead: list(LIST_QUERIES.dead),
    inFlight: list(LIST_QUERIES.inFlight),
    tenant: (tenantId) => list(LIST_QUERIES.tenant(tenantId)),
  };
}
