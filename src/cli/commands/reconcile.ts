/** `billing-outbox reconcile`: our sent usage against Stripe's meter event summaries, hour by hour. */
import { isMapped } from '../../ops/customers.js';
import { alignRange, MAX_EVENTS_PER_WINDOW, MAX_RANGE_MS, reconcile, type ReconcileGroup, type ReconcileReport } from '../../ops/reconcile.js';
import { createStripeClient, requireStripeKey } from '../../stripe/client.js';
import { noPositionals, parse } from '../args.js';
import { EXIT_FAILED, EXIT_OK, CommandLineError, writeJson, type CliContext, type Output } from '../context.js';
import { formatTable } from '../format.js';
import { schemaFor } from '../../outbox/sql/schema.js';

export const RECONCILE_HELP = `Usage: billing-outbox reconcile --from T1 --to T2 [--tenant T] [--json]

Compares, hour by hour, the usage the outbox sent to Stripe with what Stripe counted (the meter's
event summaries), for every Stripe customer and meter event name that has outbox rows whose
occurred_at (the meter event's timestamp) is in the range. Prints every window with ours, Stripe's
and the delta (Stripe - ours), and for each differing window the events in it (key, quantity,
status), so you can tell which to resend or cancel.

Ours = the quantities of rows that are delivered (sent; v2: accepted). Rows rejected_async (Stripe rejected them after a 200)
or cancelled are expected not to be counted by Stripe. Rows pending, claimed, dispatched or dead
may or may not have reached Stripe: they are not counted, but listed with their window, which is
how to decide whether a dead letter past the 24 h window may be retried with --force.

Only hours the outbox still keeps whole can be compared: --from no older than
OUTBOX_RETENTION_DAYS (45) ago, since workers prune delivered rows after that.

Stripe's summaries are eventually consistent: usage from the last few minutes may not be counted
yet, so a difference in the newest window can go away on a later run.

Options:
  --from T     start, ISO 8601 with a time zone (2026-03-10T09:00:00Z) or a date (2026-03-10,
               midnight UTC); rounded down to the hour
  --to T       end (exclusive), same format; rounded up to the hour; at most 31 days after --from
  --tenant T   only the Stripe customer this tenant is billed as (with every tenant billed as it)
  --json       print {from, to, tenantId, match, summary: {pairs, windows, matching, differing,
               ours, stripe}, groups: [{stripeCustomerId, eventName, tenantIds, meterId, problem,
               ours, stripe, match, windows: [{start, end, ours, stripe, delta, match,
               rows: {sent, unsettled, excluded}, events: [{key, tenantId, quantity, status,
               occurredAt, sentAt, lastErrorCode}], eventsOmitted, hint}]}], notes: [...]}

Exit code 0 when every window matches, 1 when any differs or could not be compared, 2 on bad
arguments.
`;

// A date, or a date and time with seconds optional and a time zone required: a time without a
// zone would be read in the local zone of whoever runs the command.
const ISO_INSTANT = /^\d{4}-\d{2}-\d{2}(T\d{2}:\d{2}(:\d{2}(\.\d{1,9})?)?(Z|[+-]\d{2}:\d{2}))?$/;

/** Whether the calendar date written at the start of `value` is the one `ms` falls on in `value`'s zone. */
function sameCalendarDate(value: string, ms: number): boolean {
  const zone = /(Z|[+-]\d{2}:\d{2})$/.exec(value)?.[1];
  const offsetMin = !zone || zone === 'Z' ? 0 : (zone[0] === '-' ? -1 : 1) * (Number(zone.slice(1, 3)) * 60 + Number(zone.slice(4, 6)));
  return new Date(ms + offsetMin * 60_000).toISOString().slice(0, 10) === value.slice(0, 10);
}

function instant(value: string | undefined, name: string): Date {
  if (value === undefined) throw new CommandLineError(`--${name} is required`, RECONCILE_HELP);
  const ms = ISO_INSTANT.test(value) ? Date.parse(value) : NaN;
  // Date.parse rolls an impossible day over (2026-11-31 is December 1): the date written must be
  // the date read back.
  if (Number.isNaN(ms) || !sameCalendarDate(value, ms)) {
    throw new CommandLineError(`--${name} must be an ISO 8601 time with a time zone (e.g. 2026-03-10T09:00:00Z) or a date (2026-03-10)`, RECONCILE_HELP);
  }
  return new Date(ms);
}

export async function reconcileCommand(args: string[], ctx: CliContext): Promise<number> {
  const { values, positionals } = parse(
    args,
    { from: { type: 'string' }, to: { type: 'string' }, tenant: { type: 'string' }, json: { type: 'boolean' } },
    RECONCILE_HELP,
  );
  if (values.help) {
    ctx.out.write(RECONCILE_HELP);
    return EXIT_OK;
  }
  noPositionals(positionals, RECONCILE_HELP);
  const asked = { from: instant(values.from, 'from'), to: instant(values.to, 'to') };
  if (asked.from.getTime() > asked.to.getTime()) throw new CommandLineError('--from is after --to', RECONCILE_HELP);
  const range = alignRange(asked.from, asked.to);
  if (range.to.getTime() === range.from.getTime()) throw new CommandLineError('the range is empty: --to must be after --from', RECONCILE_HELP);
  if (range.to.getTime() - range.from.getTime() > MAX_RANGE_MS) {
    throw new CommandLineError(
      `the range ${range.from.toISOString()} to ${range.to.toISOString()} (whole hours) is longer than 31 days; reconcile it in parts`,
      RECONCILE_HELP,
    );
  }
  // Workers prune delivered rows by their sent_at: an hour older than the retention may have lost
  // some of its rows, and ours would come out short of what Stripe counted, as if billed twice.
  const retentionMs = ctx.config.retention.olderThanMs;
  const keptSince = Math.ceil(((ctx.now?.() ?? Date.now()) - retentionMs) / 3_600_000) * 3_600_000;
  if (range.from.getTime() < keptSince) {
    throw new CommandLineError(
      `--from ${range.from.toISOString()} is older than the outbox keeps delivered rows (OUTBOX_RETENTION_DAYS, ${retentionMs / 86_400_000} days): ` +
        `workers have pruned some of its rows, so ours would be short; reconcile from ${new Date(keptSince).toISOString()} on`,
      RECONCILE_HELP,
    );
  }
  const tenantId = values.tenant;
  if (tenantId !== undefined && tenantId.trim() === '') throw new CommandLineError('--tenant must not be empty', RECONCILE_HELP);

  const { stripe: stripeConfig } = ctx.config;
  requireStripeKey(stripeConfig, '`reconcile` (it reads the meter event summaries)');
  const db = await ctx.db();
  if (tenantId !== undefined && !(await isMapped(db, schemaFor(ctx.config.databaseSchema), tenantId))) {
    throw new CommandLineError(`tenant ${tenantId} has no Stripe customer in billing_customers`, RECONCILE_HELP);
  }
  const report = await reconcile({ db, schema: schemaFor(ctx.config.databaseSchema), stripe: createStripeClient(stripeConfig) }, { ...range, tenantId });
  if (values.json) writeJson(ctx.out, report);
  else printReport(ctx.out, report);
  return report.match ? EXIT_OK : EXIT_FAILED;
}

const hourLabel = (isoTime: string) => isoTime.replace(/:00\.000Z$/, 'Z');
const signed = (n: number) => (n > 0 ? `+${n}` : String(n));

function printReport(out: Output, report: ReconcileReport): void {
  const hours = (Date.parse(report.to) - Date.parse(report.from)) / 3_600_000;
  out.write(
    `reconcile ${hourLabel(report.from)} to ${hourLabel(report.to)} (${hours} h, whole hours, UTC)` +
      `${report.tenantId === null ? '' : `, tenant ${report.tenantId}`}\n`,
  );
  out.write(`note: ${report.notes[0]}\n`);
  if (report.groups.length === 0) {
    out.write('\nno outbox rows in this range: nothing to compare\n');
    return;
  }
  for (const group of report.groups) printGroup(out, group);
  const s = report.summary;
  out.write(
    `\n${s.windows} window(s) in ${s.pairs} customer/meter pair(s): ${s.matching} match, ${s.differing} differ; ` +
      `ours ${s.ours}, Stripe ${s.stripe}\n`,
  );
  out.write(report.match ? 'result: everything matches\n' : 'result: DIFFERENCES (see the events listed under each differing window)\n');
  for (const note of report.notes.slice(1)) out.write(`note: ${note}\n`);
}

function printGroup(out: Output, g: ReconcileGroup): void {
  out.write(
    `\ncustomer ${g.stripeCustomerId} (tenant${g.tenantIds.length === 1 ? '' : 's'} ${g.tenantIds.join(', ')}), ` +
      `event ${g.eventName}, meter ${g.meterId ?? '(none)'}: ours ${g.ours}, Stripe ${g.stripe}${g.match ? ', match' : ', DIFFERS'}\n`,
  );
  if (g.problem) out.write(`  problem: ${g.problem}\n`);
  out.write(
    formatTable(
      [
        { header: 'WINDOW (UTC)' },
        { header: 'OURS', align: 'right' },
        { header: 'STRIPE', align: 'right' },
        { header: 'DELTA', align: 'right' },
        { header: 'RESULT' },
        { header: 'NOT COUNTED' },
      ],
      g.windows.map((w) => [
        hourLabel(w.start),
        String(w.ours),
        String(w.stripe),
        signed(w.delta),
        w.match ? 'ok' : 'DIFFERS',
        [w.rows.unsettled && `${w.rows.unsettled} unsettled`, w.rows.excluded && `${w.rows.excluded} rejected/cancelled`].filter(Boolean).join(', '),
      ]),
    )
      .split('\n')
      .map((line) => (line ? `  ${line}` : line))
      .join('\n'),
  );
  for (const w of g.windows) {
    if (w.events.length === 0) continue;
    out.write(`\n  events in ${hourLabel(w.start)} (${w.match ? 'matches' : `ours ${w.ours}, Stripe ${w.stripe}, delta ${signed(w.delta)}`}):\n`);
    out.write(
      formatTable(
        [
          { header: 'KEY' },
          { header: 'TENANT', max: 30 },
          { header: 'QUANTITY', align: 'right' },
          { header: 'STATUS' },
          { header: 'OCCURRED AT' },
          { header: 'SENT AT' },
          { header: 'LAST ERROR', max: 40 },
        ],
        w.events.map((e) => [e.identifier === e.key ? e.key : `${e.key} (as ${e.identifier})`, e.tenantId, String(e.quantity), e.status, e.occurredAt, e.sentAt ?? '-', e.lastErrorCode ?? '']),
      )
        .split('\n')
        .map((line) => (line ? `    ${line}` : line))
        .join('\n'),
    );
    if (w.eventsOmitted > 0) out.write(`    … and ${w.eventsOmitted} more (at most ${MAX_EVENTS_PER_WINDOW} listed per window; --json has the same limit)\n`);
    if (w.hint) out.write(`    → ${w.hint}\n`);
  }
}
