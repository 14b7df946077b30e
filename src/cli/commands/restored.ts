/** `billing-outbox restored --backup-taken-at T`: after restoring the outbox from a backup, before the workers start. */
import { storedIdentifier } from '../../outbox/sql/delivery.js';
import { identifierNamespaceOf, lastOperatorAction, stampRestored } from '../../outbox/sql/operator.js';
import { schemaFor } from '../../outbox/sql/schema.js';
import { SAFE_RESEND_WINDOW_MS } from '../../stripe/rules.js';
import { noPositionals, parse } from '../args.js';
import { actorOf, CommandLineError, EXIT_FAILED, EXIT_OK, writeJson, type CliContext } from '../context.js';

export const RESTORED_HELP = `Usage: billing-outbox restored --backup-taken-at TIME [--by NAME] [--json]

Run after restoring the outbox's database from a backup, before starting any worker. Events that
were not yet at Stripe in the backup may have been delivered after it was taken, and Stripe
recognises a resend of an identifier for 24 hours only. Each unsettled row never attempted
(pending, claimed, dispatched or dead) is stamped as first attempted at TIME, or at its creation if
that is later, under the identifier it would have been sent with (the STRIPE_IDENTIFIER_NAMESPACE
the deployment's workers last started with), so that the resend guard applies to it: sent normally until 23 hours after its stamp
(a copy Stripe already has is recognised), and past that refused, dead as
identifier_window_expired, to be reconciled (\`billing-outbox reconcile\` over its hour) and retried
with --force only if Stripe does not have it. Rows attempted before keep their own first attempt.
Each stamped row counts one attempt. Recorded in operator_actions. Once run, it is refused without
--again: later, it would stamp whatever waits then as if it had been in the backup (only for a
database restored once more).

Options:
  --backup-taken-at TIME  when the backup began, with its time zone (2026-12-07T03:00:00Z); when
                          unsure, an earlier time (more rows refused for reconcile, none billed twice)
  --again                 run it although it ran before (the database was restored again)
  --by NAME               who is asking, for the audit log (default: the OS user)
  --json                  print {backupTakenAt, stamped}

Exit code 0 when done; 1 when it ran before and --again is not given; 2 on bad arguments (a time
without its zone, or in the future).
`;

export async function restoredCommand(args: string[], ctx: CliContext): Promise<number> {
  const { values, positionals } = parse(
    args,
    { 'backup-taken-at': { type: 'string' }, again: { type: 'boolean' }, by: { type: 'string' }, json: { type: 'boolean' } },
    RESTORED_HELP,
  );
  if (values.help) {
    ctx.out.write(RESTORED_HELP);
    return EXIT_OK;
  }
  noPositionals(positionals, RESTORED_HELP);
  const actor = actorOf(values.by, ctx, RESTORED_HELP);
  const given = values['backup-taken-at'];
  if (given === undefined) throw new CommandLineError('restored needs --backup-taken-at: when the restored backup began', RESTORED_HELP);
  // A time without its zone would be read in this machine's: hours off, and rows delivered in them billed twice.
  const at = /(Z|[+-]\d\d:?\d\d)$/i.test(given) ? new Date(given) : new Date(Number.NaN);
  if (Number.isNaN(at.getTime())) throw new CommandLineError(`--backup-taken-at ${JSON.stringify(given)} is not an ISO 8601 time with its zone (e.g. 2026-12-07T03:00:00Z)`, RESTORED_HELP);
  if (at.getTime() > (ctx.now ?? Date.now)()) throw new CommandLineError(`--backup-taken-at ${at.toISOString()} is in the future`, RESTORED_HELP);
  const db = await ctx.db();
  const schema = schemaFor(ctx.config.databaseSchema);
  const before = await lastOperatorAction(db, schema, 'restored');
  if (before && !values.again) {
    ctx.err.write(
      `billing-outbox: restored ran already (${before.at.toISOString()}, by ${before.actor}): run again, it would stamp the events waiting now as if they ` +
        'had been in a backup, and those still unsent 23 h on would need reconcile. Only for a database restored once more: --again\n',
    );
    return EXIT_FAILED;
  }
  const namespace = await identifierNamespaceOf(db, schema, ctx.config.stripe.identifierNamespace);
  const stamped = await stampRestored(db, schema, {
    backupTakenAt: at,
    actor,
    identifierOf: (key) => storedIdentifier(key, 0, namespace),
  });
  if (values.json) writeJson(ctx.out, { backupTakenAt: at.toISOString(), stamped });
  else
    ctx.out.write(
      `stamped ${stamped} unsettled row(s) never attempted as first attempted at ${at.toISOString()} (or at their creation, if later): ` +
        `those created before it are sent until ${new Date(at.getTime() + SAFE_RESEND_WINDOW_MS).toISOString()}, and past it refused as identifier_window_expired for reconcile\n`,
    );
  return EXIT_OK;
}
