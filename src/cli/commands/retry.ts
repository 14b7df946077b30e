/** `billing-outbox retry`: send dead letters again, one by key or all that match. */
import { countDead, type DeadLetterFilter } from '../../ops/dead-letters.js';
import { inHours, SAFE_RESEND_WINDOW_MS } from '../../stripe/rules.js';
import { warnIfRelaysPaused } from './relays.js';
import { parse } from '../args.js';
import { scrub } from '../../log.js';
import { actorOf, EXIT_FAILED, EXIT_OK, CommandLineError, writeJson, type CliContext, type Output } from '../context.js';
import { formatDuration, formatTable, ProgressBar } from '../format.js';
import { DEFAULT_WAIT_MS, DeadLetterRetrier, isProblem, type RetryOptions, type RetryOutcome, type RetryResult } from '../../ops/retry.js';
import { schemaFor } from '../../outbox/sql/schema.js';
import { shellWord } from '../../../workflows/shared.js';

export const RETRY_HELP = `Usage: billing-outbox retry <key> [--wait] [--force] [--by NAME] [--json]
       billing-outbox retry --all-dead [--tenant T] [--code C] [--wait] [--force] [--yes] [--by NAME] [--json]

Sends dead letters to Stripe again, with the same identifier. An event whose workflow is still open
is signalled; one whose workflow has closed (terminated, timed out, past retention) is reopened with
a new run under the same workflow id. A delivered (sent or accepted) event is never resent: it is
skipped, with nothing to retry. Every retry is recorded in operator_actions (who, when, which event,
forced or not, outcome).

Events first attempted more than ${inHours(SAFE_RESEND_WINDOW_MS)} h ago are refused without --force: Stripe deduplicates
identifiers for only 24 h, so a resend could bill twice. Check \`billing-outbox reconcile\` or Stripe's
meter event summaries for the customer and hour of the event first.

Options:
  --wait       wait for the new attempt's outcome and print it: sent (or accepted), or dead again
               with Stripe's answer. An open workflow gets the \`retry\` Update, whose validator
               refuses in the workflow (recording nothing) what cannot be retried; a reopened run is
               followed until it settles. At most ${formatDuration(DEFAULT_WAIT_MS)} per event, then it is
               reported still on its way (the retry stands). With --all-dead: a progress bar on a
               terminal, then a table of the outcomes
  --all-dead   every dead letter (optionally only --tenant T and/or last error code --code C),
               processed in pages; asks for confirmation unless --yes
  --force      resend even past the ${inHours(SAFE_RESEND_WINDOW_MS)} h safe window (after reconciling!)
  --yes        do not ask before a bulk retry (required when stdin is not a terminal)
  --by NAME    who is asking, for the audit log (default: the OS user)
  --json       one key: print {key, outcome, forced, message} (with --wait also answer:
               {status, attempts, lastError});
               --all-dead: print {summary: {matched, signalled, retried, reopened, skipped, refused,
               failed}, problems: [{key, outcome, message}], problemsOmitted} (with --wait also
               outcomes: [{result, code, events, example}], the final table's rows)
               outcome is one of signalled, retried (--wait, open workflow), reopened, skipped,
               refused, failed

Exit code 0 when every event was signalled, retried, reopened or skipped (and, with --wait, none is
dead again); 1 otherwise.
`;

/** Problems kept for the --json report; the rest are counted, not listed (a bulk run can be huge). */
const MAX_REPORTED_PROBLEMS = 10_000;

type Summary = { matched: number } & Record<RetryOutcome, number>;

function describe(r: RetryResult): string {
  return `${r.outcome} ${r.key}${r.forced ? ' (forced)' : ''}: ${r.message}`;
}

/**
 * The final table of `retry --all-dead --wait`: one row per result (and per error code of the
 * events dead again), with how many events and one of their keys to inspect.
 */
export class OutcomeTable {
  private readonly groups = new Map<string, { result: string; code: string; events: number; example: string }>();

  add(r: RetryResult): void {
    const result = r.answer && r.answer.status !== 'dispatched' ? (r.answer.status === 'dead' ? 'dead again' : r.answer.status) : r.answer ? 'still on its way' : r.outcome;
    const code = r.answer?.status === 'dead' ? (r.answer.lastError?.code ?? '') : '';
    const id = `${result}\u0000${code}`;
    const group = this.groups.get(id) ?? { result, code, events: 0, example: r.key };
    group.events++;
    this.groups.set(id, group);
  }

  rows(): { result: string; code: string; events: number; example: string }[] {
    return [...this.groups.values()].sort((a, b) => b.events - a.events || a.result.localeCompare(b.result) || a.code.localeCompare(b.code));
  }

  format(): string {
    return formatTable(
      [{ header: 'RESULT' }, { header: 'CODE' }, { header: 'EVENTS', align: 'right' }, { header: 'FOR EXAMPLE', max: 80 }],
      this.rows().map((g) => [g.result, g.code, String(g.events), g.example]),
    );
  }
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
      wait: { type: 'boolean' },
    },
    RETRY_HELP,
  );
  if (values.help) {
    ctx.out.write(RETRY_HELP);
    return EXIT_OK;
  }
  const force = values.force === true;
  const requestedBy = actorOf(values.by, ctx, RETRY_HELP);
  const wait = values.wait === true ? { timeoutMs: DEFAULT_WAIT_MS } : undefined;

  if (!values['all-dead']) {
    if (values.tenant !== undefined || values.code !== undefined) throw new CommandLineError('--tenant and --code go with --all-dead', RETRY_HELP);
    if (positionals.length !== 1) {
      throw new CommandLineError(positionals.length === 0 ? 'retry needs an event key, or --all-dead' : 'retry takes one key', RETRY_HELP);
    }
    await warnIfRelaysPaused(ctx, 'retry');
    return retryOne(positionals[0]!, { force, requestedBy, wait, json: values.json === true }, ctx);
  }
  if (positionals.length > 0) throw new CommandLineError('give either a key or --all-dead, not both', RETRY_HELP);
  await warnIfRelaysPaused(ctx, 'retry');
  return retryAll({ tenantId: values.tenant, errorCode: values.code }, { force, requestedBy, wait, yes: values.yes === true, json: values.json === true }, ctx);
}

async function retrier(ctx: CliContext): Promise<DeadLetterRetrier> {
  const [db, client] = await Promise.all([ctx.db(), ctx.temporal()]);
  return new DeadLetterRetrier({ db, schema: schemaFor(ctx.config.databaseSchema), client, config: ctx.config, now: ctx.now ?? Date.now });
}

async function retryOne(key: string, opts: RetryOptions & { json: boolean }, ctx: CliContext): Promise<number> {
  const result = await (await retrier(ctx)).retryKey(key, opts);
  if (opts.json) writeJson(ctx.out, result);
  else if (isProblem(result)) ctx.err.write(`billing-outbox: ${describe(result)}\n`);
  else if (result.answer && result.answer.status !== 'dispatched') ctx.out.write(`${describe(result)}\n`);
  else ctx.out.write(`${describe(result)}\nfollow it: billing-outbox inspect ${shellWord(key)}\n`);
  return isProblem(result) ? EXIT_FAILED : EXIT_OK;
}

function filterText(filter: DeadLetterFilter): string {
  const parts = [filter.tenantId !== undefined && `tenant ${filter.tenantId}`, filter.errorCode !== undefined && `error code ${filter.errorCode}`];
  const text = parts.filter(Boolean).join(', ');
  return text ? ` (${text})` : '';
}

async function retryAll(
  filter: DeadLetterFilter,
  opts: RetryOptions & { yes: boolean; json: boolean },
  ctx: CliContext,
): Promise<number> {
  const db = await ctx.db();
  const total = await countDead(db, schemaFor(ctx.config.databaseSchema), filter);
  const summary: Summary = { matched: 0, signalled: 0, retried: 0, reopened: 0, skipped: 0, refused: 0, failed: 0 };
  const problems: Pick<RetryResult, 'key' | 'outcome' | 'message'>[] = [];
  let problemCount = 0;
  const table = opts.wait ? new OutcomeTable() : undefined;
  let stoppedEarly: string | undefined;
  const report = (): number => {
    if (opts.json) {
      writeJson(ctx.out, { summary, problems, problemsOmitted: problemCount - problems.length, ...(table ? { outcomes: table.rows() } : {}), ...(stoppedEarly ? { stoppedEarly } : {}) });
    } else {
      if (table && summary.matched > 0) ctx.out.write(table.format());
      ctx.out.write(
        `retry --all-dead${filterText(filter)}: ${summary.matched} matched; ${summary.signalled} signalled, ${opts.wait ? `${summary.retried} retried, ` : ''}${summary.reopened} reopened, ` +
          `${summary.skipped} skipped, ${summary.refused} refused, ${summary.failed} failed\n`,
      );
    }
    return problemCount > 0 || stoppedEarly !== undefined ? EXIT_FAILED : EXIT_OK;
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
  let delivered = 0;
  let deadAgain = 0;
  const label = () =>
    opts.wait
      ? `sent ${delivered}  dead again ${deadAgain}  skipped ${summary.skipped}  refused ${summary.refused}  failed ${summary.failed}`
      : `ok ${summary.signalled + summary.reopened}  skipped ${summary.skipped}  refused ${summary.refused}  failed ${summary.failed}`;
  // Stopped early (Temporal away, PostgreSQL away): what was done is still summed up, and said.
  const ended = await retry.retryAllDead(filter, { ...opts, pageSize: ctx.pageSize }, (result) => {
    summary.matched++;
    summary[result.outcome]++;
    table?.add(result);
    if (result.answer?.status === 'dead') deadAgain++;
    else if (result.answer && result.answer.status !== 'dispatched') delivered++;
    if (isProblem(result)) {
      problemCount++;
      if (problems.length < MAX_REPORTED_PROBLEMS) problems.push({ key: result.key, outcome: result.outcome, message: result.message });
      if (!opts.json) say(ctx.err, `billing-outbox: ${describe(result)}`);
    }
    bar?.update(summary.matched, label());
  }).catch((err: unknown) => ({ stopped: `listing the dead letters failed: ${scrub((err as Error).message)}` }));
  bar?.finish(summary.matched, label());
  if (ended.stopped) {
    stoppedEarly = ended.stopped;
    ctx.err.write(`billing-outbox: retry --all-dead stopped early: ${ended.stopped}; the same command goes on with the dead letters left\n`);
  }
  return report();
}
