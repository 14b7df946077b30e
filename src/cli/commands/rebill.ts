/** `billing-outbox rebill <key>`: deliver again, under a new identifier, an event Stripe rejected (src/ops/rebill.ts decides). */
import { rebillEvent } from '../../ops/rebill.js';
import { warnIfRelaysPaused } from './relays.js';
import { parse } from '../args.js';
import { actorOf, EXIT_FAILED, EXIT_OK, CommandLineError, writeJson, type CliContext } from '../context.js';
import { schemaFor } from '../../outbox/sql/schema.js';
import { shellWord } from '../../../workflows/shared.js';

export const REBILL_HELP = `Usage: billing-outbox rebill <key> [--by NAME] [--json]

Bills again an event Stripe rejected after accepting it (status rejected_async: Stripe's error
report named it, with a code such as meter_event_customer_not_found), once the cause is fixed.
Stripe keeps the rejected identifier taken, so a retry cannot deliver it: rebill gives the event a
new identifier (revision n + 1: \`r<n>:<key>\`, after STRIPE_IDENTIFIER_NAMESPACE if set) and
delivers it like a retry (signals its waiting workflow, or starts a new run).

It cannot bill twice: only a rejected_async row is rebilled (Stripe said it does not count it),
under one guarded update (two operators at once make one new revision), and not while its
workflow is still running an attempt. A sent, accepted or dead row is refused (retry a dead one).
Every rebill is recorded in operator_actions with the old and new identifier.

Options:
  --by NAME   who is asking, for the audit log (default: the OS user)
  --json      print {key, outcome, message, previousIdentifier, identifier, revision};
              outcome is one of rebilled, skipped, refused, failed

Exit code 0 when rebilled or skipped (another operator rebilled it first); 1 when refused or
failed; 2 on bad arguments.
`;

export async function rebillCommand(args: string[], ctx: CliContext): Promise<number> {
  const { values, positionals } = parse(args, { by: { type: 'string' }, json: { type: 'boolean' } }, REBILL_HELP);
  if (values.help) {
    ctx.out.write(REBILL_HELP);
    return EXIT_OK;
  }
  if (positionals.length !== 1) throw new CommandLineError(positionals.length === 0 ? 'rebill needs an event key (e.g. u:acme:req-42)' : 'rebill takes one key', REBILL_HELP);
  const key = positionals[0]!;
  const actor = actorOf(values.by, ctx, REBILL_HELP);
  const [db, client] = await Promise.all([ctx.db(), ctx.temporal()]);
  await warnIfRelaysPaused(ctx, 'rebill');
  const result = await rebillEvent({ db, schema: schemaFor(ctx.config.databaseSchema), client, config: ctx.config, now: ctx.now ?? Date.now }, key, { actor });
  const ok = result.outcome === 'rebilled' || result.outcome === 'skipped';
  if (values.json) writeJson(ctx.out, result);
  else if (ok) ctx.out.write(`${result.outcome} ${key}: ${result.message}\nfollow it: billing-outbox inspect ${shellWord(key)}\n`);
  else ctx.err.write(`billing-outbox: ${result.outcome} ${key}: ${result.message}\n`);
  return ok ? EXIT_OK : EXIT_FAILED;
}
