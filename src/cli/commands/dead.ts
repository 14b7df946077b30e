/** `billing-outbox dead`: the dead letters, oldest first. */
import { countDeadLetters, listDeadLetters, type OperatorRow } from '../../outbox-sql.js';
import { SAFE_RESEND_WINDOW_MS } from '../../../workflows/shared.js';
import { intOption, noPositionals, parse } from '../args.js';
import { EXIT_OK, writeJson, type CliContext } from '../context.js';
import { ageSeconds, formatDuration, formatTable, iso } from '../format.js';
import { withinResendWindow } from '../retrier.js';

export const DEAD_HELP = `Usage: billing-outbox dead [--tenant T] [--limit N] [--json]

Lists dead letters (events whose attempts ran out or that Stripe refused), oldest first: key,
tenant, attempts, last error, age since the event was queued and since its first attempt.
Events marked "!" were first attempted more than ${SAFE_RESEND_WINDOW_MS / 3_600_000} h ago: Stripe may no longer
recognise a resend as a duplicate, so they need reconciling before a forced retry.

Options:
  --tenant T   only this tenant's dead letters
  --limit N    show at most N (default 50, at most 10000)
  --json       print {total, items: [{key, tenantId, attempts, lastErrorCode, lastErrorMessage,
               createdAt, firstAttemptedAt, deadAt, ageSeconds, sinceFirstAttemptSeconds,
               safeToResend}]}
`;

export interface DeadLetterItem {
  key: string;
  tenantId: string;
  attempts: number;
  lastErrorCode: string | null;
  lastErrorMessage: string | null;
  createdAt: string;
  firstAttemptedAt: string | null;
  deadAt: string | null;
  ageSeconds: number;
  sinceFirstAttemptSeconds: number | null;
  /** False once the first attempt is older than the safe resend window: retrying needs --force. */
  safeToResend: boolean;
}

function toItem(row: OperatorRow, now: number): DeadLetterItem {
  return {
    key: row.idempotency_key,
    tenantId: row.tenant_id,
    attempts: row.attempt_count,
    lastErrorCode: row.last_error_code,
    lastErrorMessage: row.last_error_message,
    createdAt: row.created_at.toISOString(),
    firstAttemptedAt: iso(row.first_attempted_at),
    deadAt: iso(row.dead_at),
    ageSeconds: ageSeconds(row.created_at, now)!,
    sinceFirstAttemptSeconds: ageSeconds(row.first_attempted_at, now),
    safeToResend: withinResendWindow(row, now),
  };
}

export async function deadCommand(args: string[], ctx: CliContext): Promise<number> {
  const { values, positionals } = parse(
    args,
    { tenant: { type: 'string' }, limit: { type: 'string' }, json: { type: 'boolean' } },
    DEAD_HELP,
  );
  if (values.help) {
    ctx.out.write(DEAD_HELP);
    return EXIT_OK;
  }
  noPositionals(positionals, DEAD_HELP);
  const limit = intOption(values.limit, 'limit', 1, 10_000, 50, DEAD_HELP);
  const db = await ctx.db();
  const now = ctx.now?.() ?? Date.now();
  const filter = { tenantId: values.tenant };
  const [total, rows] = await Promise.all([countDeadLetters(db, filter), listDeadLetters(db, { ...filter, afterId: 0, limit })]);
  const items = rows.map((r) => toItem(r, now));
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
    ctx.out.write(`! first attempted over ${SAFE_RESEND_WINDOW_MS / 3_600_000} h ago: reconcile before retrying with --force\n`);
  }
  return EXIT_OK;
}
