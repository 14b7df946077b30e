/** `billing-outbox cancel <key>`: cancel a sent event at Stripe (src/ops/cancel.ts decides). */
import { cancelEvent } from '../../ops/cancel.js';
import { createStripeClient, requireStripeKey } from '../../stripe/client.js';
import { parse } from '../args.js';
import { actorOf, EXIT_FAILED, EXIT_OK, CommandLineError, writeJson, type CliContext } from '../context.js';
import { schemaFor } from '../../outbox/sql/schema.js';

export const CANCEL_HELP = `Usage: billing-outbox cancel <key> [--by NAME] [--json]

Cancels a sent event at Stripe (a meter event adjustment of type cancel, by its identifier), so that
Stripe stops counting it, and marks the row cancelled. Stripe allows this only within 24 hours of
receiving the event: an event sent (sent_at) 24 h ago or more is refused without calling Stripe,
and Stripe's own refusal is reported as it comes. Only sent rows can be cancelled. Every attempt is
recorded in operator_actions.

Find what to cancel with \`billing-outbox reconcile\` (events Stripe counts that it should not).
A cancelled event's identifier stays taken at Stripe for 24 hours: usage that should be billed after
all must be recorded again as a new usage, not retried.

Options:
  --by NAME   who is asking, for the audit log (default: the OS user)
  --json      print {key, outcome, message, row: {status, eventName, quantity, tenantId, sentAt,
              cancelledAt}}; outcome is one of cancelled, refused, failed

Exit code 0 when the event was cancelled; 1 when it was refused or failed; 2 on bad arguments.
`;

export async function cancelCommand(args: string[], ctx: CliContext): Promise<number> {
  const { values, positionals } = parse(args, { by: { type: 'string' }, json: { type: 'boolean' } }, CANCEL_HELP);
  if (values.help) {
    ctx.out.write(CANCEL_HELP);
    return EXIT_OK;
  }
  if (positionals.length !== 1) throw new CommandLineError(positionals.length === 0 ? 'cancel needs an event key (e.g. u:acme:req-42)' : 'cancel takes one key', CANCEL_HELP);
  const key = positionals[0]!;
  const actor = actorOf(values.by, ctx, CANCEL_HELP);
  const { stripe: stripeConfig } = ctx.config;
  requireStripeKey(stripeConfig, '`cancel`');

  const db = await ctx.db();
  const result = await cancelEvent(db, schemaFor(ctx.config.databaseSchema), key, { actor, stripe: () => createStripeClient(stripeConfig) });
  if (values.json) writeJson(ctx.out, result);
  else if (result.outcome === 'cancelled') ctx.out.write(`cancelled ${key}: ${result.message}\n`);
  else ctx.err.write(`billing-outbox: ${result.outcome} ${key}: ${result.message}\n`);
  return result.outcome === 'cancelled' ? EXIT_OK : EXIT_FAILED;
}

