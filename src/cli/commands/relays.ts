/** `billing-outbox relays pause|resume`: stop and start handing new events to Temporal, for the whole deployment. */
import { pauseRelays, relaysPaused, resumeRelays } from '../../outbox/sql/relay.js';
import { schemaFor } from '../../outbox/sql/schema.js';
import { parse } from '../args.js';
import { actorOf, CommandLineError, EXIT_OK, writeJson, type CliContext } from '../context.js';

export const RELAYS_HELP = `Usage: billing-outbox relays pause --reason TEXT [--by NAME] [--json]
       billing-outbox relays resume [--by NAME] [--json]
       billing-outbox relays [--json]

pause: every relay of this deployment (its database schema) stops claiming, from its next claim
(milliseconds): new events wait as pending, those already handed to Temporal go on to Stripe, and
\`billing-outbox status\` says so first (an alarm) with the reason. It needs no Temporal feature and
holds across worker restarts, until resumed. Use it to let the events in flight finish before a
change that must not meet them (switching STRIPE_METER_API: docs/operations.md), or to hold
dispatch during an incident. resume: the relays claim again at once. Both are recorded in
operator_actions. Without a subcommand: whether the relays are paused.

Options:
  --reason TEXT  why (pause only; shown by status)
  --by NAME      who is asking, for the audit log (default: the OS user)
  --json         print {paused: {at, by, reason} or null}
`;

export async function relaysCommand(args: string[], ctx: CliContext): Promise<number> {
  const { values, positionals } = parse(args, { reason: { type: 'string' }, by: { type: 'string' }, json: { type: 'boolean' } }, RELAYS_HELP);
  if (values.help) {
    ctx.out.write(RELAYS_HELP);
    return EXIT_OK;
  }
  const [action, ...rest] = positionals;
  if (rest.length > 0 || (action !== undefined && action !== 'pause' && action !== 'resume')) {
    throw new CommandLineError(`relays takes pause, resume or nothing, got ${JSON.stringify(positionals.join(' '))}`, RELAYS_HELP);
  }
  if (action !== 'pause' && values.reason !== undefined) throw new CommandLineError('--reason goes with pause', RELAYS_HELP);
  const schema = schemaFor(ctx.config.databaseSchema);
  const db = await ctx.db();
  if (action === 'pause') {
    const reason = values.reason?.trim();
    if (!reason) throw new CommandLineError('relays pause needs --reason: status shows it to whoever finds the events waiting', RELAYS_HELP);
    await pauseRelays(db, schema, actorOf(values.by, ctx, RELAYS_HELP), reason);
  } else if (action === 'resume') {
    const was = await resumeRelays(db, schema, actorOf(values.by, ctx, RELAYS_HELP));
    if (!values.json) ctx.out.write(was ? 'relays resumed: they claim again now\n' : 'relays were not paused\n');
  }
  const paused = await relaysPaused(db, schema);
  if (values.json) writeJson(ctx.out, { paused });
  else if (action !== 'resume') {
    ctx.out.write(
      paused
        ? `relays paused since ${paused.at.toISOString()} by ${paused.by} (${paused.reason}): new events wait as pending, those in flight go on; \`billing-outbox relays resume\` to resume\n`
        : 'relays running\n',
    );
  }
  return EXIT_OK;
}

/** Said on standard error by the commands that send events without a relay (retry, rebill) while the relays are paused. */
export async function warnIfRelaysPaused(ctx: CliContext, command: string): Promise<void> {
  const paused = await relaysPaused(await ctx.db(), schemaFor(ctx.config.databaseSchema));
  if (paused) {
    ctx.err.write(
      `billing-outbox: note: the relays are paused (since ${paused.at.toISOString()} by ${paused.by}: ${paused.reason}); ` +
        `${command} does not go through them: what it reopens goes to Stripe now\n`,
    );
  }
}
