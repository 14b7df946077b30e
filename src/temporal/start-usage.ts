/**
 * Starting a usage workflow, from the client side: the relay activity and an operator's reopen
 * (src/ops/retry.ts) both start runs here, so the id, the policies, the input and the search
 * attributes are decided in one place.
 */
import { createHash } from 'node:crypto';
import { WorkflowExecutionAlreadyStartedError, WorkflowNotFoundError, type Client, type WorkflowExecutionStatusName } from '@temporalio/client';
import { defaultPayloadConverter } from '@temporalio/common';
import type { Config } from '../config.js';
import { inEventTrace } from '../tracing.js';
import { DEFERRALS_PER_RUN, markdownText, REOPENS_PER_RUN, OutboxErrorKey, OutboxStatusKey, TenantIdKey, type UsageWorkflowInput, shellWord } from '../../workflows/shared.js';
import { causes } from '../causes.js';

/** What identifies the event to start: its outbox row's key and tenant (and what it is, for the Web UI). */
export interface UsageEventRef {
  idempotency_key: string;
  tenant_id: string;
  event_name?: string;
  quantity?: string | number;
  occurred_at?: Date;
  /** The trace the event was recorded in (the row's W3C traceparent), for the start's span. */
  trace_parent?: string | null;
}

/**
 * Temporal's frontend refuses a start whose static summary, as a serialized payload, exceeds
 * `limit.userMetadataSummarySize` (400 bytes by default) with InvalidArgument: every start of the
 * event would be refused. The summary's JSON text is kept to this many UTF-8 bytes; the rest of the
 * 400 is the payload's framing and its `encoding: json/plain` metadata (about 30 bytes) with room
 * to spare.
 */
export const SUMMARY_MAX_DATA_BYTES = 320;

/**
 * `text` cut so that its payload data (the JSON string the default payload converter sends, quotes
 * and escapes included) fits `maxBytes` UTF-8 bytes, ending with an ellipsis when cut. Cut between
 * code points, never inside one (a surrogate pair stays whole), so the result is valid UTF-8.
 */
export function boundedSummary(text: string, maxBytes = SUMMARY_MAX_DATA_BYTES): string {
  const size = (s: string) => Buffer.byteLength(JSON.stringify(s), 'utf8');
  if (size(text) <= maxBytes) return text;
  const ellipsis = '…';
  let used = size(ellipsis);
  let out = '';
  for (const ch of text) {
    // Each code point's share of the JSON text: its escape (control characters, quotes) or itself.
    const bytes = size(ch) - 2;
    if (used + bytes > maxBytes) break;
    used += bytes;
    out += ch;
  }
  return out + ellipsis;
}

/**
 * The run's static summary in the Web UI's list and page: tenant, quantity, meter, time. Set once at
 * start (the run's current details tell what is happening now). Bounded in bytes (a tenant of 120
 * CJK characters alone is 360): a summary Temporal refuses would refuse the start itself.
 */
export function usageSummary(row: UsageEventRef): string {
  // The Web UI renders the summary as Markdown: the tenant's id and the meter's name are theirs to
  // spell, so either is escaped unless it is a plain word (a tenant id like `[Pay](https://…)` shows
  // as text, not a link), and stays so however the bound cuts it.
  const what = row.quantity !== undefined && row.event_name ? `${row.quantity} × ${markdownText(row.event_name)}` : 'usage';
  const when = row.occurred_at ? ` at ${row.occurred_at.toISOString()}` : '';
  return boundedSummary(`${markdownText(row.tenant_id)}: ${what}${when}`);
}

/** Temporal's limit on a fairness key, in bytes (longer ones are refused with the start). */
export const MAX_FAIRNESS_KEY_BYTES = 64;

/**
 * The tenant's key for Temporal's task queue fairness: matching dispatches the backlog of each key
 * in turn, so one tenant's flood of workflow and activity tasks does not queue every other tenant's
 * behind it. The tenant itself when it fits Temporal's 64 bytes (readable in `describe`); a tenant
 * id may be 200 characters, so a longer one becomes `h:<sha-256 of it, base64url>` (45 bytes): a
 * start with a longer key would be refused, and the event would be a dead letter. Should a hash
 * ever equal a real tenant's id, the two share one turn; fairness is all that is shared.
 */
export function fairnessKeyFor(tenantId: string): string {
  if (Buffer.byteLength(tenantId, 'utf8') <= MAX_FAIRNESS_KEY_BYTES) return tenantId;
  return `h:${createHash('sha256').update(tenantId, 'utf8').digest('base64url')}`;
}

/**
 * How a usage workflow is started, by the relay and by an operator's reopen alike: workflow id =
 * idempotency key, conflict policy FAIL (never a second run beside a running one). The relay uses
 * reuse policy REJECT_DUPLICATE (never a second run after one ever ran); only the CLI's guarded
 * reopen of a dead letter whose workflow has closed passes ALLOW_DUPLICATE. Each run carries its
 * tenant's fairness key (fairnessKeyFor).
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
    deferralsPerRun: DEFERRALS_PER_RUN,
    reopensPerRun: REOPENS_PER_RUN,
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
    // The run's activities inherit it (a priority field left unset on an activity means "the
    // workflow's"), so workflows/ sets none. Ignored by a server without `matching.enableFairness`.
    priority: { fairnessKey: fairnessKeyFor(row.tenant_id) },
  };
}

/** temporal.api.enums.v1.TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW. */
const WORKFLOW_TASK_QUEUE = 1;

/**
 * What an operator command that starts a usage run appends when no worker has polled the task
 * queue it starts runs on (Temporal lists the pollers of the last minutes): a CLI configured with
 * another TEMPORAL_TASK_QUEUE than the workers' starts runs nobody ever picks up, and their rows
 * wait `dispatched` with nothing to say why. Empty when a worker polls, or when Temporal cannot tell.
 */
export async function unpolledWarning(client: Client, temporal: Pick<Config['temporal'], 'namespace' | 'taskQueue'>): Promise<string> {
  const unpolled = await client.workflowService
    .describeTaskQueue({ namespace: temporal.namespace, taskQueue: { name: temporal.taskQueue }, taskQueueType: WORKFLOW_TASK_QUEUE })
    .then((r) => (r.pollers ?? []).length === 0, () => false);
  if (!unpolled) return '';
  return `; WARNING: no worker polls task queue ${JSON.stringify(temporal.taskQueue)} in namespace ${JSON.stringify(temporal.namespace)}: the new run waits until one does (is TEMPORAL_TASK_QUEUE the workers'?)`;
}

/**
 * gRPC status codes with which Temporal refuses a start for what the request itself is (an id too
 * long, a payload or search attribute over a limit): sending the same start again is refused again.
 * Anything else (UNAVAILABLE, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, INTERNAL, UNKNOWN, and
 * deployment-wide ones like PERMISSION_DENIED or an unknown namespace) may pass, and is tried again.
 * So is FAILED_PRECONDITION: Temporal answers it for a namespace not active in this cluster (a
 * multi-region namespace failing over), which would otherwise make every start of the failover a
 * dead letter.
 */
const REFUSED_FOR_GOOD: ReadonlyMap<number, string> = new Map([
  [3, 'INVALID_ARGUMENT'],
  [11, 'OUT_OF_RANGE'],
]);

/** gRPC NOT_FOUND: the workflow (or the namespace) is not there, or the run has already closed. */
export const GRPC_NOT_FOUND = 5;

/** The gRPC status code of a failed call, from the error or its causes (the SDK wraps it in ServiceError). */
export function grpcCode(err: unknown): number | undefined {
  for (const e of causes(err)) {
    const code = (e as { code?: unknown }).code;
    if (typeof code === 'number') return code;
  }
  return undefined;
}

/** What Temporal said, from the innermost error that has a message (the SDK's outer one is generic). */
function temporalAnswer(err: unknown): string {
  const parts: string[] = [];
  for (const e of causes(err)) {
    const details = (e as { details?: unknown }).details;
    const message = typeof details === 'string' && details ? details : (e as { message?: unknown }).message;
    if (typeof message === 'string' && message && !parts.includes(message)) parts.push(message);
  }
  return parts.join(': ') || String(err);
}

/**
 * A start Temporal refused for good (see REFUSED_FOR_GOOD): the event cannot be started as it is,
 * and trying again would loop. The relay makes its row a dead letter with this reason.
 */
export class StartRefusedError extends Error {
  override readonly name = 'StartRefusedError';
  readonly grpcStatus: string;
  readonly answer: string;
  constructor(
    grpcStatus: string,
    answer: string,
  ) {
    super(`Temporal refused to start the workflow (${grpcStatus}): ${answer}`);
    this.grpcStatus = grpcStatus;
    this.answer = answer;
  }
}

/** Rethrows a failed start as StartRefusedError when Temporal refused it for good; as it is otherwise. */
export function classifyStartError(err: unknown): Error {
  const code = grpcCode(err);
  const name = code === undefined ? undefined : REFUSED_FOR_GOOD.get(code);
  return name ? new StartRefusedError(name, temporalAnswer(err)) : (err as Error);
}

/**
 * Closed statuses of a run: anything but RUNNING or PAUSED (and the unknown, taken as open); and
 * OTHER_TASK_QUEUE, an open run under the key that is not this deployment's.
 */
export type ClosedRunStatus = Exclude<WorkflowExecutionStatusName, 'RUNNING' | 'PAUSED' | 'UNSPECIFIED' | 'UNKNOWN'> | 'NOT_FOUND' | 'OTHER_TASK_QUEUE';

/** What the relay's start found: a new run, an open run (in Temporal's hands), or a closed run. */
export type StartOutcome =
  | { kind: 'started' }
  /**
   * `deadLetter`: the run lists itself dead (OutboxStatus), waiting for a retry, with its error code;
   * its run id and start, for firstAttemptBound.
   */
  | { kind: 'running'; deadLetter?: { code: string; runId: string; startTime: Date } }
  /**
   * No run of ours will ever mark the row: the key's run has closed (or is gone past retention),
   * or the run under the key is open on another task queue: another deployment's. `taskQueue`: the
   * run's, when it is not this deployment's (open, or closed there).
   */
  | { kind: 'closed'; status: ClosedRunStatus; closedAt: Date | undefined; taskQueue?: string };

const CLOSED_AS: Record<ClosedRunStatus, string> = {
  COMPLETED: 'completed, yet the row was not delivered (put back by hand, or a database restored from an older backup)',
  FAILED: 'failed',
  CANCELLED: 'cancelled',
  TERMINATED: 'terminated',
  CONTINUED_AS_NEW: 'continued as new',
  TIMED_OUT: 'timed out',
  NOT_FOUND: "gone: closed past the namespace's retention (a database restored from an older backup), deleted, Temporal's state lost or reset, or TEMPORAL_NAMESPACE changed since it started",
  OTHER_TASK_QUEUE: 'is not this deployment\'s',
};

/**
 * Why a row whose run has closed is a dead letter (`workflow_closed`): how the run closed, when, and
 * what the operator does. Read on the row by `dead`, `inspect` and the Web UI's operators.
 */
export function closedRunMessage(key: string, run: Extract<StartOutcome, { kind: 'closed' }>, rowWas: string): string {
  if (run.status === 'OTHER_TASK_QUEUE') {
    return (
      `the workflow id ${key} belongs to a run on task queue ${JSON.stringify(run.taskQueue)}, not this deployment's, while the row was ${rowWas}: ` +
      'another deployment shares this Temporal namespace with the same usage ids, or TEMPORAL_TASK_QUEUE was changed while runs were open. ' +
      'No run of ours will deliver it, and no retry can start one while that run is open. Another deployment\'s queue: give each deployment a namespace of its own (docs/operations.md). ' +
      `This deployment's queue before TEMPORAL_TASK_QUEUE changed: no worker polls it, so that run never ends by itself; terminate it ` +
      `(temporal workflow terminate --workflow-id ${shellWord(key)}; a worker started on the old queue would run its relays too, and hand it new events). Then billing-outbox retry ${shellWord(key)}`
    );
  }
  const when = run.closedAt ? ` at ${run.closedAt.toISOString()}` : '';
  if (run.taskQueue !== undefined) {
    // Another deployment's run, or one of a queue since retired: how it closed says nothing of our row.
    return (
      `the workflow id ${key} was last used by a run on task queue ${JSON.stringify(run.taskQueue)}, not this deployment's, which ${run.status.toLowerCase().replace(/_/g, ' ')}${when}, while the row was ${rowWas}: ` +
      'another deployment shares this Temporal namespace with the same usage ids (give each a namespace of its own: docs/operations.md), or TEMPORAL_TASK_QUEUE was changed. ' +
      `No run of ours will deliver it: billing-outbox retry ${shellWord(key)} starts one (same identifier)`
    );
  }
  return (
    `its workflow run ${CLOSED_AS[run.status]}${when} while the row was ${rowWas}: no run will deliver it. ` +
    `Once the cause is understood: billing-outbox retry ${shellWord(key)} starts a new run (same identifier)`
  );
}

/** Whether a run in this status may still act (and so is in the way of another deployment's retry). */
export function isOpenRun(status: WorkflowExecutionStatusName): status is Exclude<WorkflowExecutionStatusName, ClosedRunStatus> {
  return status === 'RUNNING' || status === 'PAUSED' || status === 'UNSPECIFIED' || status === 'UNKNOWN';
}

/**
 * The earliest moment the key's run `runId` (closed, or an open dead letter) may have reached Stripe from: when the event was
 * first attempted as the run was told (a run continued as new, or started by an operator's retry,
 * carries it in its input), else the run's start. For a row that records no attempt (restored from
 * a backup older than them): the run's close, or its start when an earlier run began, would count
 * Stripe's 24 h dedup from too late. Reads the run's first history event only; throws when it
 * cannot be read.
 */
export async function firstAttemptBound(client: Client, key: string, runId: string, startTime: Date): Promise<Date> {
  const { history } = await client.workflowService.getWorkflowExecutionHistory({
    namespace: client.options.namespace,
    execution: { workflowId: key, runId },
    maximumPageSize: 1,
  });
  const payload = history?.events?.[0]?.workflowExecutionStartedEventAttributes?.input?.payloads?.[0];
  const input = payload ? defaultPayloadConverter.fromPayload<Partial<UsageWorkflowInput> | undefined>(payload) : undefined;
  const told = input?.firstAttemptedAt;
  return typeof told === 'number' && told < startTime.getTime() ? new Date(told) : startTime;
}

/**
 * Whether an open run on `taskQueue` (ours) has the key now (false when Temporal cannot say). An
 * operator's start that failed asks it: the answer may have been lost after the server started the
 * run, and a row put back as it was would then be called dead (or rejected) while that run delivers
 * it. Another deployment's run under the key is not ours.
 */
export async function openRunNow(client: Client, key: string, taskQueue: string): Promise<boolean> {
  const run = await describeRun(client, key, taskQueue).catch(() => undefined);
  return run?.kind === 'running';
}

/**
 * The key's latest run, as `describe` sees it: RUNNING, closed (how and when), gone, or on another
 * task queue than `taskQueue` (another deployment's: its state says nothing of our row).
 */
export async function describeRun(client: Client, key: string, taskQueue: string): Promise<Extract<StartOutcome, { kind: 'running' | 'closed' }>> {
  try {
    const d = await client.workflow.getHandle(key).describe();
    const status = d.status.name;
    const open = isOpenRun(status);
    // Only an open run on another queue is in the way; a closed one, wherever it ran, is closed:
    // `retry` starts ours beside it, and the operator is told how and where it closed.
    const elsewhere = d.taskQueue !== taskQueue ? { taskQueue: d.taskQueue } : undefined;
    if (open && elsewhere) return { kind: 'closed', status: 'OTHER_TASK_QUEUE', closedAt: undefined, ...elsewhere };
    if (open) {
      // What the run lists itself as (its search attributes, read from the server's state: no worker needed).
      if (d.typedSearchAttributes.get(OutboxStatusKey) !== 'dead') return { kind: 'running' };
      return { kind: 'running', deadLetter: { code: d.typedSearchAttributes.get(OutboxErrorKey) ?? 'dead_letter', runId: d.runId, startTime: d.startTime } };
    }
    return { kind: 'closed', status, closedAt: d.closeTime, ...elsewhere };
  } catch (err) {
    if (err instanceof WorkflowNotFoundError) return { kind: 'closed', status: 'NOT_FOUND', closedAt: undefined };
    throw err;
  }
}

/**
 * Starts the usage workflow of one event for the relay. Workflow id = idempotency key, and the
 * policies make a second run impossible: FAIL if one is running, REJECT_DUPLICATE if one ever ran
 * (within the namespace's retention). When the start meets an existing run, that run is described:
 * an open run has the event in hand (`running`); a closed one (terminated, cancelled, timed out, or
 * even completed while the row was put back, e.g. a database restored from an older backup) will
 * never mark the row (`closed`). Throws StartRefusedError when Temporal refuses the start for good.
 */
export async function startUsageWorkflow(
  client: Client,
  row: UsageEventRef,
  config: Pick<Config, 'retry' | 'temporal'>,
  opts: { eager?: boolean } = {},
): Promise<StartOutcome> {
  // The start joins the trace the row was recorded in; with tracing on, the client's OpenTelemetry
  // interceptor carries it on in the start's headers to the workflow and its activities.
  return inEventTrace('billing_outbox.start', row.idempotency_key, row.trace_parent, async (span) => {
    const outcome = await startOrDescribe(client, row, config, opts);
    span.setAttribute('billing_outbox.start_outcome', outcome.kind);
    return outcome;
  });
}

async function startOrDescribe(client: Client, row: UsageEventRef, config: Pick<Config, 'retry' | 'temporal'>, opts: { eager?: boolean }): Promise<StartOutcome> {
  try {
    await client.workflow.start('usageWorkflow', {
      ...usageWorkflowStartOptions(row, config, { reusePolicy: 'REJECT_DUPLICATE' }),
      // Eager start (`eager`: only for a client on a worker's own NativeConnection, as the relay's
      // is): the server hands the run's first workflow task straight back in the start's answer,
      // to that worker, saving a round trip through matching. The server may decline; then it is
      // an ordinary start.
      ...(opts.eager ? { requestEagerStart: true } : {}),
    });
    return { kind: 'started' };
  } catch (err) {
    if (err instanceof WorkflowExecutionAlreadyStartedError) return describeRun(client, row.idempotency_key, config.temporal.taskQueue);
    throw classifyStartError(err);
  }
}
