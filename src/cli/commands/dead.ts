/** `billing-outbox dead`: the dead letters, oldest first. */
import { listDead, listRejected, type Listing, type RejectedItem } from '../../ops/dead-letters.js';
import { inHours, SAFE_RESEND_WINDOW_MS } from '../../stripe/rules.js';
import { intOption, noPositionals, parse } from '../args.js';
import { EXIT_OK, writeJson, type CliContext, type Output } from '../context.js';
import { formatDuration, formatTable } from '../format.js';
import { schemaFor } from '../../outbox/sql/schema.js';

export const DEAD_HELP = `Usage: billing-outbox dead [--rejected] [--tenant T] [--limit N] [--json]

Lists dead letters (events whose attempts ran out or that Stripe refused), oldest first: key,
tenant, attempts, last error, age since the event was queued and since its first attempt.
Events marked "!" were first attempted more than ${inHours(SAFE_RESEND_WINDOW_MS)} h ago: Stripe may no longer
recognise a resend as a duplicate, so they need reconciling before a forced retry. Dead letters
with a timestamp_* error are outside the window Stripe accepts (35 days back, 5 minutes ahead):
no retry can deliver them.

With --rejected, lists instead the events Stripe answered 200 for and rejected later
(rejected_async, from Stripe's error reports), oldest rejection first, with Stripe's error code.
Stripe does not bill them, and their identifier stays taken at Stripe: fix the cause, then
\`billing-outbox rebill <key>\` bills each once under a new identifier; retry does not apply to them.

Options:
  --rejected   list rejected_async events instead of dead letters; --json prints {total, items:
               [{key, tenantId, eventName, quantity, occurredAt, sentAt, rejectedAt, errorCode,
               errorMessage}]}
  --tenant T   only this tenant's dead letters
  --limit N    show at most N (default 50, at most 10000)
  --json       print {total, items: [{key, tenantId, attempts, lastErrorCode, lastErrorMessage,
               createdAt, firstAttemptedAt, deadAt, ageSeconds, sinceFirstAttemptSeconds,
               safeToResend}]}
`;

export async function deadCommand(args: string[], ctx: CliContext): Promise<number> {
  const { values, positionals } = parse(
    args,
    { rejected: { type: 'boolean' }, tenant: { type: 'string' }, limit: { type: 'string' }, json: { type: 'boolean' } },
    DEAD_HELP,
  );
  if (values.help) {
    ctx.out.write(DEAD_HELP);
    return EXIT_OK;
  }
  noPositionals(positionals, DEAD_HELP);
  const limit = intOption(values.limit, 'limit', 1, 10_000, 50, DEAD_HELP);
  const db = await ctx.db();
  if (values.rejected) {
    const listing = await listRejected(db, schemaFor(ctx.config.databaseSchema), { tenantId: values.tenant, limit });
    return printRejected(ctx.out, listing, { tenantId: values.tenant, json: values.json === true });
  }
  const { total, items } = await listDead(db, schemaFor(ctx.config.databaseSchema), { tenantId: values.tenant, limit, now: ctx.now?.() ?? Date.now() });
  if (values.json) {
    writeJson(ctx.out, { total, items });
    return EXIT_OK;
  }
  if (items.length === 0) {
    ctx.out.write(values.tenant ? `no dead letters for tenant ${values.tenant}\n` : 'no dead letters\n');
    return EXIT_OK;
  }
  ctx.out.write(
    formatTable(
      [
        { header: 'KEY' },
        { header: 'TENANT', max: 40 },
        { header: 'ATTEMPTS', align: 'right' },
        { header: 'ERROR', max: 40 },
        { header: 'AGE', align: 'right' },
        { header: 'SINCE 1ST TRY', align: 'right' },
        { header: 'MESSAGE', max: 80 },
      ],
      items.map((i) => [
        i.key,
        i.tenantId,
        String(i.attempts),
        i.lastErrorCode ?? '',
        formatDuration(i.ageSeconds * 1000),
        i.sinceFirstAttemptSeconds === null ? '-' : `${i.safeToResend ? '' : '! '}${formatDuration(i.sinceFirstAttemptSeconds * 1000)}`,
        i.lastErrorMessage ?? '',
      ]),
    ),
  );
  ctx.out.write(`${items.length} of ${total} dead letter${total === 1 ? '' : 's'}${items.length < total ? ' (raise --limit for more)' : ''}\n`);
  if (items.some((i) => !i.safeToResend)) {
    ctx.out.write(`! first attempted over ${inHours(SAFE_RESEND_WINDOW_MS)} h ago: reconcile before retrying with --force\n`);
  }
  if (items.some((i) => i.lastErrorCode === 'timestamp_too_far_in_past')) {
    ctx.out.write("timestamp_too_far_in_past: older than Stripe's 35-day window; a retry cannot deliver it\n");
  }
  if (items.some((i) => i.lastErrorCode === 'timestamp_in_future')) {
    ctx.out.write("timestamp_in_future: stamped ahead of the worker's or Stripe's clock: a clock is wrong; fix it, then retry once the usage is within the hour\n");
  }
  return EXIT_OK;
}

function printRejected(out: Output, { total, items }: Listing<RejectedItem>, opts: { tenantId: string | undefined; json: boolean }): number {
  if (opts.json) {
    writeJson(out, { total, items });
    return EXIT_OK;
  }
  if (items.length === 0) {
    out.write(opts.tenantId ? `no rejected events for tenant ${opts.tenantId}\n` : 'no rejected events\n');
    return EXIT_OK;
  }
  out.write(
    formatTable(
      [
        { header: 'KEY' },
        { header: 'TENANT', max: 40 },
        { header: 'EVENT', max: 40 },
        { header: 'QUANTITY', align: 'right' },
        { header: 'STRIPE ERROR', max: 40 },
        { header: 'REJECTED AT' },
        { header: 'MESSAGE', max: 80 },
      ],
      items.map((i) => [i.key, i.tenantId, i.eventName, String(i.quantity), i.errorCode ?? '', i.rejectedAt ?? '-', i.errorMessage ?? '']),
    ),
  );
  out.write(`${items.length} of ${total} event${total === 1 ? '' : 's'} rejected by Stripe after a 200${items.length < total ? ' (raise --limit for more)' : ''}\n`);
  out.write(
    'Stripe does not bill these. Fix the cause, then `billing-outbox rebill <key>` each (a new identifier: the old one stays taken at Stripe). ' +
      "Stripe's reports name only a sample of failed events: billing-outbox status shows how many were not matched to a row.\n",
  );
  return EXIT_OK;
}
