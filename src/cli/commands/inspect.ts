/** `billing-outbox inspect <key>`: one event, as the database and as its workflow see it. */
import { WorkflowNotFoundError, type Client, type WorkflowExecutionStatusName } from '@temporalio/client';
import { findRowByKey, type OutboxRow } from '../../outbox/sql/delivery.js';
import { listOperatorActions } from '../../outbox/sql/operator.js';
import { scrub } from '../../log.js';
import { stateQuery, type UsageState } from '../../../workflows/shared.js';
import { parse } from '../args.js';
import { EXIT_FAILED, EXIT_OK, CommandLineError, workflowUiUrl, writeJson, type CliContext } from '../context.js';
import { formatTable, iso } from '../format.js';

export const INSPECT_HELP = `Usage: billing-outbox inspect <key> [--json]

Shows one event's outbox row beside its usage workflow: the workflow's status (from describe) and,
while it runs, its own state (attempts, last error); plus a Temporal Web UI link and the operator
actions recorded for it. Exit code 1 when neither the row nor the workflow exists.

Options:
  --json   print {key, row, workflow: {found, status, runId, startTime, closeTime, state,
           stateError}, webUi: {url}, operatorActions}
`;

/** How long to wait for a query answer: a query needs a worker, and none may be running. */
const QUERY_TIMEOUT_MS = 5_000;

export interface WorkflowView {
  found: boolean;
  status: WorkflowExecutionStatusName | null;
  runId: string | null;
  startTime: string | null;
  closeTime: string | null;
  /** The workflow's answer to the state query; only asked while it runs. */
  state: UsageState | null;
  stateError: string | null;
}

/** describe() and, for an open run, the state query. A missing workflow is an answer, not an error. */
export async function viewWorkflow(client: Client, key: string): Promise<WorkflowView> {
  const handle = client.workflow.getHandle(key);
  let description;
  try {
    description = await handle.describe();
  } catch (err) {
    if (err instanceof WorkflowNotFoundError) {
      return { found: false, status: null, runId: null, startTime: null, closeTime: null, state: null, stateError: null };
    }
    throw err;
  }
  const view: WorkflowView = {
    found: true,
    status: description.status.name,
    runId: description.runId,
    startTime: iso(description.startTime),
    closeTime: iso(description.closeTime),
    state: null,
    stateError: null,
  };
  if (view.status === 'RUNNING') {
    try {
      view.state = await client.withDeadline(Date.now() + QUERY_TIMEOUT_MS, () => handle.query(stateQuery));
    } catch (err) {
      view.stateError = `state query failed (is a worker running?): ${scrub((err as Error).message)}`;
    }
  }
  return view;
}

function rowJson(row: OutboxRow) {
  return {
    id: row.id,
    key: row.idempotency_key,
    tenantId: row.tenant_id,
    eventName: row.event_name,
    quantity: row.quantity,
    occurredAt: iso(row.occurred_at),
    status: row.status,
    attempts: row.attempt_count,
    lastErrorCode: row.last_error_code,
    lastErrorMessage: row.last_error_message,
    workflowId: row.workflow_id,
    createdAt: iso(row.created_at),
    firstAttemptedAt: iso(row.first_attempted_at),
    dispatchedAt: iso(row.dispatched_at),
    sentAt: iso(row.sent_at),
    deadAt: iso(row.dead_at),
  };
}

export async function inspectCommand(args: string[], ctx: CliContext): Promise<number> {
  const { values, positionals } = parse(args, { json: { type: 'boolean' } }, INSPECT_HELP);
  if (values.help) {
    ctx.out.write(INSPECT_HELP);
    return EXIT_OK;
  }
  const [key, ...extra] = positionals;
  if (!key) throw new CommandLineError('inspect needs the event key (e.g. u:acme:req-42)', INSPECT_HELP);
  if (extra.length > 0) throw new CommandLineError(`unexpected argument: ${extra[0]}`, INSPECT_HELP);

  const db = await ctx.db();
  const client = await ctx.temporal();
  const [row, workflow, actions] = await Promise.all([findRowByKey(db, key), viewWorkflow(client, key), listOperatorActions(db, key, 20)]);
  const report = {
    key,
    row: row ? rowJson(row) : null,
    workflow,
    webUi: { url: workflowUiUrl(ctx.config.temporalUiUrl, ctx.config.temporal.namespace, key) },
    operatorActions: actions.map((a) => ({ at: iso(a.at), actor: a.actor, action: a.action, forced: a.forced, outcome: a.outcome, detail: a.detail })),
  };
  const found = row !== undefined || workflow.found;

  if (values.json) {
    writeJson(ctx.out, report);
  } else {
    const out = ctx.out;
    out.write(`event ${key}\n\n`);
    if (report.row) {
      const r = report.row;
      out.write('outbox row\n');
      out.write(
        formatTable(
          [{ header: 'FIELD' }, { header: 'VALUE', max: 120 }],
          Object.entries(r).map(([k, v]) => [k, v === null ? '-' : String(v)]),
        ),
      );
    } else {
      out.write('outbox row: none with this key\n');
    }
    out.write('\nworkflow\n');
    if (!workflow.found) {
      out.write('  not found (never started, or closed longer ago than the namespace retention)\n');
    } else {
      out.write(`  status:   ${workflow.status}   run ${workflow.runId}\n`);
      out.write(`  started:  ${workflow.startTime ?? '-'}   closed: ${workflow.closeTime ?? '-'}\n`);
      if (workflow.state) {
        const s = workflow.state;
        out.write(`  state:    ${s.status}, ${s.attempts} attempt(s)`);
        out.write(s.lastError ? `, last error ${s.lastError.code}: ${s.lastError.message}\n` : '\n');
        if (report.row && report.row.status !== s.status) {
          out.write(`  note:     the row says ${report.row.status}; they agree again once the workflow's current step is recorded\n`);
        }
      } else if (workflow.stateError) {
        out.write(`  state:    ${workflow.stateError}\n`);
      } else {
        out.write('  state:    (closed: no live state; the status above is final for this run)\n');
      }
    }
    out.write(`\nweb ui: ${report.webUi.url}\n`);
    if (actions.length > 0) {
      out.write('\noperator actions (newest first)\n');
      out.write(
        formatTable(
          [{ header: 'AT' }, { header: 'BY' }, { header: 'ACTION' }, { header: 'FORCED' }, { header: 'OUTCOME' }, { header: 'DETAIL', max: 80 }],
          report.operatorActions.map((a) => [a.at ?? '', a.actor, a.action, a.forced ? 'yes' : 'no', a.outcome, a.detail ?? '']),
        ),
      );
    }
  }
  if (!found) {
    ctx.err.write(`billing-outbox: no outbox row and no workflow with key ${key}\n`);
    return EXIT_FAILED;
  }
  return EXIT_OK;
}
