/** `billing-outbox prune`: delete delivered rows past the retention age now (workers do it on a timer). */
import { countPrunableRows, PRUNABLE, pruneDelivered } from '../../ops/prune.js';
import { intOption, noPositionals, parse } from '../args.js';
import { actorOf, CommandLineError, EXIT_OK, writeJson, type CliContext } from '../context.js';
import { recordOperatorAction } from '../../outbox/sql/operator.js';
import { schemaFor } from '../../outbox/sql/schema.js';

export const PRUNE_HELP = `Usage: billing-outbox prune [--older-than-days N] [--dry-run] [--by NAME] [--json]

Deletes outbox rows that are ${PRUNABLE.join(', ')} and were sent more than N days ago (default
OUTBOX_RETENTION_DAYS, 45; at least 36: Stripe's 35-day window and cancels read them; reconcile
compares only hours younger than the retention), in batches that never block the relay. Dead, rejected and unfinished rows are never pruned,
nor is the application's usage_logs table. Workers do this every OUTBOX_PRUNE_INTERVAL_MS.
--dry-run counts what would go; --json prints {olderThanDays, pruned | wouldPrune}. A run (not a
dry run) is recorded in operator_actions, by --by NAME (default: the OS user).
`;

export async function pruneCommand(args: string[], ctx: CliContext): Promise<number> {
  const { values, positionals } = parse(args, { 'older-than-days': { type: 'string' }, 'dry-run': { type: 'boolean' }, by: { type: 'string' }, json: { type: 'boolean' } }, PRUNE_HELP);
  if (values.help) {
    ctx.out.write(PRUNE_HELP);
    return EXIT_OK;
  }
  noPositionals(positionals, PRUNE_HELP);
  const actor = actorOf(values.by, ctx, PRUNE_HELP);
  const configuredDays = ctx.config.retention.olderThanMs / 86_400_000;
  const days = intOption(values['older-than-days'], 'older-than-days', 36, 36_500, Math.ceil(configuredDays), PRUNE_HELP);
  if (values['older-than-days'] === undefined && !Number.isInteger(configuredDays)) {
    throw new CommandLineError('OUTBOX_RETENTION_DAYS is fractional; pass --older-than-days', PRUNE_HELP);
  }
  const olderThanMs = days * 86_400_000;
  const db = await ctx.db();
  if (values['dry-run']) {
    const wouldPrune = await countPrunableRows(db, schemaFor(ctx.config.databaseSchema), olderThanMs);
    if (values.json) writeJson(ctx.out, { olderThanDays: days, wouldPrune });
    else ctx.out.write(`${wouldPrune} delivered row(s) sent more than ${days} days ago would be pruned\n`);
    return EXIT_OK;
  }
  const schema = schemaFor(ctx.config.databaseSchema);
  const pruned = await pruneDelivered(db, schema, { olderThanMs });
  await recordOperatorAction(db, schema, {
    actor,
    action: 'prune',
    key: null,
    tenantId: null,
    forced: false,
    outcome: 'pruned',
    detail: `${pruned} delivered row(s) sent more than ${days} days ago`,
  });
  if (values.json) writeJson(ctx.out, { olderThanDays: days, pruned });
  else ctx.out.write(`pruned ${pruned} delivered row(s) sent more than ${days} days ago\n`);
  return EXIT_OK;
}
