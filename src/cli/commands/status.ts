/** `billing-outbox status`: how the outbox is doing, at a glance. */
import { countDeadByErrorCode, countRecentlySent, statusSummary } from '../../outbox-sql.js';
import { noPositionals, parse } from '../args.js';
import { EXIT_OK, writeJson, type CliContext } from '../context.js';
import { formatDuration, formatTable } from '../format.js';

export const STATUS_HELP = `Usage: billing-outbox status [--json]

Counts of outbox rows by status, the age of the oldest event not yet handed to Temporal, events
sent in the last minute and hour, and dead letters grouped by their last error code.

Options:
  --json   print {counts, sentEstimated, oldestPendingAgeSeconds, sentLastMinute, sentLastHour,
           deadByErrorCode: [{code, count}]}
`;

export interface StatusReport {
  counts: { pending: number; claimed: number; dispatched: number; sent: number; dead: number };
  /** True when `counts.sent` is PostgreSQL's estimate (large tables) rather than a count. */
  sentEstimated: boolean;
  /** Null when nothing is waiting for a relay. */
  oldestPendingAgeSeconds: number | null;
  sentLastMinute: number;
  sentLastHour: number;
  deadByErrorCode: { code: string | null; count: number }[];
}

export async function statusCommand(args: string[], ctx: CliContext): Promise<number> {
  const { values, positionals } = parse(args, { json: { type: 'boolean' } }, STATUS_HELP);
  if (values.help) {
    ctx.out.write(STATUS_HELP);
    return EXIT_OK;
  }
  noPositionals(positionals, STATUS_HELP);
  const db = await ctx.db();
  const now = new Date(ctx.now?.() ?? Date.now());
  const [summary, recent, dead] = await Promise.all([statusSummary(db), countRecentlySent(db, now), countDeadByErrorCode(db)]);
  const waiting = summary.pending + summary.claimed;
  const report: StatusReport = {
    counts: { pending: summary.pending, claimed: summary.claimed, dispatched: summary.dispatched, sent: summary.sent, dead: summary.dead },
    sentEstimated: summary.sent_estimated,
    oldestPendingAgeSeconds: waiting > 0 ? Math.floor(summary.oldest_pending_age_seconds) : null,
    sentLastMinute: recent.last_minute,
    sentLastHour: recent.last_hour,
    deadByErrorCode: dead,
  };
  if (values.json) {
    writeJson(ctx.out, report);
    return EXIT_OK;
  }
  const { counts } = report;
  ctx.out.write(
    formatTable(
      [{ header: 'STATUS' }, { header: 'COUNT', align: 'right' }],
      (['pending', 'claimed', 'dispatched', 'sent', 'dead'] as const).map((s) => [
        s,
        s === 'sent' && report.sentEstimated ? `~${counts[s]}` : String(counts[s]),
      ]),
    ),
  );
  const oldest = report.oldestPendingAgeSeconds === null ? 'none waiting' : formatDuration(report.oldestPendingAgeSeconds * 1000);
  ctx.out.write(`\noldest pending: ${oldest}\n`);
  ctx.out.write(`sent: ${report.sentLastMinute} in the last minute, ${report.sentLastHour} in the last hour\n`);
  if (report.deadByErrorCode.length > 0) {
    ctx.out.write('\n');
    ctx.out.write(
      formatTable(
        [{ header: 'DEAD BY ERROR CODE' }, { header: 'COUNT', align: 'right' }],
        report.deadByErrorCode.map((d) => [d.code ?? '(none)', String(d.count)]),
      ),
    );
    ctx.out.write('list them: billing-outbox dead\n');
  }
  return EXIT_OK;
}
