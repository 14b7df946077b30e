/** `billing-outbox retry`: send dead letters again, one by key or all that match. */
import { countDead, type DeadLetterFilter } from '../../ops/dead-letters.js';
import { inHours, SAFE_RESEND_WINDOW_MS } from '../../stripe/rules.js';
import { parse } from '../args.js';
import { EXIT_FAILED, EXIT_OK, CommandLineError, writeJson, type CliContext, type Output } from '../context.js';
import { ProgressBar } from '../format.js';
import { DeadLetterRetrier, isProblem, type RetryOutcome, type RetryResult } from '../../ops/retry.js';
import { schemaFor } from '../../outbox/sql/schema.js';

export const RETRY_HELP = `Usage: billing-outbox retry <key> [--force] [--by NAME] [--json]
       billing-outbox retry --all-dead [--tenant T] [--code C] [--force] [--yes] [--by NAME] [--json]

Sends dead letters to Stripe again, with the same identifier. An event whose workflow is still open
is signalled; one whose workflow has closed (terminated, timed out, past retention) is reopened with
a new run under the same workflow id. A delivered (sent or accepted) event is never resent: it is
skipped, with nothing to retry. Every retry is recorded in operator_actions (who, when, which event,
forced or not, outcome).

Events first attempted more than ${inHours(SAFE_RESEND_WINDOW_MS)} h ago are refused without --force: Stripe deduplicates
identifiers for only 24 h, so a resend could bill twice. Check \`billing-outbox reconcile\` or Stripe's
meter event summaries for the customer and hour of the event first.

Options:
  --all-dead   every dead letter (optionally only --tenant T and/or last error code --code C),
               processed in pages; asks for confirmation unless --yes
  --force      resend even past the ${inHours(SAFE_RESEND_WINDOW_MS)} h safe window (after reconciling!)
  --yes        do not ask before a bulk retry (required when stdin is not a terminal)
  --by NAME    who is asking, for the audit log (default: the OS user)
  --json       one key: print {key, outcome, forced, message};
               --all-dead: print {summary: {matched, signalled, reopened, skipped, refused, failed},
               problems: [{key, outcome, message}], problemsOmitted}
               outcome is one of signalled, reopened, skipped, refused, failed

Exit code 0 when every event was signalled, reopened or skipped; 1 when any was refused or failed.
`;

/** Problems kept for the --json report; the rest are counted, not listed (a bulk run can be huge). */
const MAX_REPORTED_PROBLEMS = 10_000;

type Summary = { matched: number } & Record<RetryOutcome, number>;

function describe(r: RetryResult): string {
  return `${r.outcome} ${r.key}${r.forced ? ' (forced)' : ''}: ${r.message}`;
}

export async function retryCommand(args: string[], ctx: CliContext): Promise<number> {
  const { values, positionals } = parse(
    args,
    {
      'all-dead': { type: 'boolean' },
      tenant: { type: 'string' },
      code: { type: 'string' },
      force: { type: 'boolean' },
      yes: { type: 'boolean' },
      by: { type: 'string' },
      json: { type: 'boolean' },
    },
    RETRY_HELP,
  );
  if (values.help) {
    ctx.out.write(RETRY_HELP);
    return EXIT_OK;
  }
  const force = values.force === true;
  const requestedBy = values.by ?? ctx.user ?? 'unknown';
  if (requestedBy.trim() === '' || requestedBy.length > 200) throw new CommandLineError('--by must be 1 to 200 characters', RETRY_HELP);

  if (!values['all-dead']) {
    if (values.tenant !== undefined || values.code !== undefined) throw new CommandLineError('--tenant and --code go with --all-dead', RETRY_HELP);
    if (positionals.length !== 1) {
      throw new CommandLineError(positionals.length === 0 ? 'retry needs an event key, or --all-dead' : 'retry takes one key', RETRY_HELP);
    }
    return retryOne(positionals[0]!, { force, requestedBy, json: values.json === true }, ctx);
  }
  if (positionals.length > 0) throw new CommandLineError('give either a key or --all-dead, not both', RETRY_HELP);
  return retryAll({ tenantId: values.tenant, errorCode: values.code }, { force, requestedBy, yes: values.yes === true, json: values.json === true }, ctx);
}

async function retrier(ctx: CliContext): Promise<DeadLetterRetrier> {
  const [db, client] = await Promise.all([ctx.db(), ctx.temporal()]);
  return new DeadLetterRetrier({ db, schema: schemaFor(ctx.config.databaseSchema), client, config: ctx.config, now: ctx.now ?? Date.now });
}

async function retryOne(key: string, opts: { force: boolean; requestedBy: string; json: boolean }, ctx: CliContext): Promise<number> {
  const result = await (await retrier(ctx)).retryKey(key, opts);
  if (opts.json) writeJson(ctx.out, result);
  else if (isProblem(result)) ctx.err.write(`billing-outbox: ${describe(result)}\n`);
  else ctx.out.write(`${describe(result)}\nfollow it: billing-outbox inspect ${key}\n`);
  return isProblem(result) ? EXIT_FAILED : EXIT_OK;
}

function filterText(filter: DeadLetterFilter): string {
  const parts = [filter.tenantId !== undefined && `tenant ${filter.tenantId}`, filter.errorCode !== undefined && `error code ${filter.errorCode}`];
  const text = parts.filter(Boolean).join(', ');
  return text ? ` (${text})` : '';
}

async function retryAll(
  filter: DeadLetterFilter,
  opts: { force: boolean; requestedBy: string; yes: boolean; json: boolean },
  ctx: CliContext,
): Promise<number> {
  const db = await ctx.db();
  const total = await countDead(db, schemaFor(ctx.config.databaseSchema), filter);
  const summary: Summary = { matched: 0, signalled: 0, reopened: 0, skipped: 0, refused: 0, failed: 0 };
  const problems: Pick<RetryResult, 'key' | 'outcome' | 'message'>[] = [];
  const report = (): number => {
    const problemCount = summary.refused + summary.failed;
    if (opts.json) writeJson(ctx.out, { summary, problems, problemsOmitted: problemCount - problems.length });
    else {
      ctx.out.write(
        `retry --all-dead${filterText(filter)}: ${summary.matched} matched; ${summary.signalled} signalled, ${summary.reopened} reopened, ` +
          `${summary.skipped} skipped, ${summary.refused} refused, ${summary.failed} failed\n`,
      );
    }
    return problemCount > 0 ? EXIT_FAILED : EXIT_OK;
  };
  if (total === 0) return report();

  if (!opts.yes) {
    if (!ctx.confirm) throw new CommandLineError('retry --all-dead asks for confirmation; pass --yes when not running in a terminal', RETRY_HELP);
    const warning = opts.force ? ` WITH --force (no ${inHours(SAFE_RESEND_WINDOW_MS)} h duplicate guard)` : '';
    if (!(await ctx.confirm(`Retry ${total} dead letter${total === 1 ? '' : 's'}${filterText(filter)}${warning}? [y/N] `))) {
      ctx.err.write('billing-outbox: nothing retried\n');
      return EXIT_FAILED;
    }
  }

  const retry = await retrier(ctx);
  const bar = ctx.err.isTTY ? new ProgressBar(ctx.err, total) : undefined;
  const say = (out: Output, line: string) => (bar ? bar.printAbove(line) : out.write(`${line}\n`));
  const label = () => `ok ${summary.signalled + summary.reopened}  skipped ${summary.skipped}  refused ${summary.refused}  failed ${summary.failed}`;
  await retry.retryAllDead(filter, { ...opts, pageSize: ctx.pageSize }, (result) => {
    summary.matched++;
    summary[result.outcome]++;
    if (isProblem(result)) {
      if (problems.length < MAX_REPORTED_PROBLEMS) problems.push({ key: result.key, outcome: result.outcome, message: result.message });
      if (!opts.json) say(ctx.err, `billing-outbox: ${describe(result)}`);
    }
    bar?.update(summary.matched, label());
  });
  bar?.finish(summary.matched, label());
  return report();
}
