/** `billing-outbox inspect <key>`: one event, as the database and as its workflow see it. */
import { inspectEvent } from '../../ops/inspect.js';
import { parse } from '../args.js';
import { EXIT_FAILED, EXIT_OK, CommandLineError, workflowUiUrl, writeJson, type CliContext } from '../context.js';
import { formatTable } from '../format.js';
import { schemaFor } from '../../outbox/sql/schema.js';

export const INSPECT_HELP = `Usage: billing-outbox inspect <key> [--json]

Shows one event's outbox row beside its usage workflow: the workflow's status (from describe) and,
while it runs, its own state (attempts, last error); plus a Temporal Web UI link and the operator
actions recorded for it. Temporal unreachable: the row and the actions, and why the workflow is
unknown. Exit code 1 when neither the row nor the workflow exists (or could be asked).

Options:
  --json   print {key, row, workflow: {found, status, runId, startTime, closeTime, state,
           stateError, unavailable}, webUi: {url}, operatorActions}
`;

export async function inspectCommand(args: string[], ctx: CliContext): Promise<number> {
  const { values, positionals } = parse(args, { json: { type: 'boolean' } }, INSPECT_HELP);
  if (values.help) {
    ctx.out.write(INSPECT_HELP);
    return EXIT_OK;
  }
  const [key, ...extra] = positionals;
  if (!key) throw new CommandLineError('inspect needs the event key (e.g. u:acme:req-42)', INSPECT_HELP);
  if (extra.length > 0) throw new CommandLineError(`unexpected argument: ${extra[0]}`, INSPECT_HELP);

  const view = await inspectEvent({ db: await ctx.db(), schema: schemaFor(ctx.config.databaseSchema), client: ctx.temporal() }, key);
  const { workflow } = view;
  const report = {
    key,
    row: view.row,
    workflow,
    webUi: { url: workflowUiUrl(ctx.config.temporalUiUrl, ctx.config.temporal.namespace, key) },
    operatorActions: view.operatorActions,
  };
  const found = view.row !== null || workflow.found;

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
    if (workflow.unavailable) {
      out.write(`  unknown: ${workflow.unavailable}\n  (the row above is as the database has it; a failed start's error is in its last error)\n`);
    } else if (!workflow.found) {
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
    if (report.operatorActions.length > 0) {
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
