/**
 * What a usage must look like before anything is written. Shared by `recordUsage` and the HTTP API
 * (which reaches it through recordUsage), so a bad value is refused the same way from both sides.
 *
 * Text is refused, not repaired: repairing (U+FFFD for a bad byte, dropping an invisible character,
 * normalising) can make two different usage ids equal, and the second usage would then be lost as a
 * "duplicate"; or leave the application's id and the outbox's different.
 */
import { MAX_EVENT_NAME_LENGTH, MAX_VALUE, tooOldToSend } from '../stripe/rules.js';
import { MAX_RECORDED_AHEAD_MS } from '../stripe/send-check.js';
import { InvalidUsageError } from './errors.js';

/**
 * Usage ids: a request's or a job's id fits, and with a short tenant the key stays readable
 * (`u:<tenant>:<usage id>` within Stripe's 100 characters; longer ones are hashed, keys.ts).
 * usage_logs.id's CHECK holds the same limit.
 */
export const MAX_USAGE_ID_LENGTH = 90;
export const MAX_TENANT_ID_LENGTH = 200;
export { MAX_EVENT_NAME_LENGTH, MAX_VALUE as MAX_QUANTITY };

/**
 * Characters that do not show as what they are, by Unicode's own properties rather than a hand list:
 * - Cc: control characters (NUL, newlines, escape sequences that repaint a terminal);
 * - Cf: format characters, among them the bidirectional controls (U+202A–U+202E, U+2066–U+2069)
 *   that reorder what the CLI and the Web UI display;
 * - Default_Ignorable_Code_Point: what a renderer shows as nothing at all: zero-width space and
 *   joiners, U+FEFF, soft hyphen, the Hangul fillers (U+115F, U+3164, U+FFA0), the combining
 *   grapheme joiner (U+034F), variation selectors (U+FE00–U+FE0F, U+E0100–U+E01EF), tags;
 * - White_Space other than the plain space: NBSP, the ideographic space, en/em spaces look like a
 *   space and are not one; Zl and Zp (line and paragraph separators) are among them;
 * - U+2800 (Braille pattern blank): a symbol by its category, blank by its glyph, and the one
 *   commonly used as an "invisible" name that no property above catches;
 * - noncharacters (U+FDD0–U+FDEF, U+xFFFE, U+xFFFF) and U+FFFD: text that was already not valid
 *   where it came from.
 * Lone surrogates (half a UTF-16 pair, not a character at all) are checked with isWellFormed().
 */
const HIDDEN = /[\p{Cc}\p{Cf}\p{Default_Ignorable_Code_Point}\p{Zl}\p{Zp}\u2800\u{FDD0}-\u{FDEF}\u{FFFD}\u{FFFE}\u{FFFF}\u{1FFFE}\u{1FFFF}\u{2FFFE}\u{2FFFF}\u{3FFFE}\u{3FFFF}\u{4FFFE}\u{4FFFF}\u{5FFFE}\u{5FFFF}\u{6FFFE}\u{6FFFF}\u{7FFFE}\u{7FFFF}\u{8FFFE}\u{8FFFF}\u{9FFFE}\u{9FFFF}\u{AFFFE}\u{AFFFF}\u{BFFFE}\u{BFFFF}\u{CFFFE}\u{CFFFF}\u{DFFFE}\u{DFFFF}\u{EFFFE}\u{EFFFF}\u{FFFFE}\u{FFFFF}\u{10FFFE}\u{10FFFF}]|(?! )\p{White_Space}/u;

/** Why `value` is not acceptable text for an id or a name, if it is not. */
export function textProblem(value: unknown, max: number): string | undefined {
  if (typeof value !== 'string') return 'must be a string';
  if (value.length === 0 || value.trim() !== value) return 'must be non-empty, without leading or trailing spaces';
  // Characters as PostgreSQL and the API's JSON Schema count them (an emoji is one), not UTF-16 units.
  if ([...value].length > max) return `must be at most ${max} characters`;
  if (!value.isWellFormed()) return 'must be valid Unicode text (it contains half of a UTF-16 surrogate pair)';
  const hidden = HIDDEN.exec(value);
  if (hidden) {
    const cp = hidden[0].codePointAt(0)!.toString(16).toUpperCase().padStart(4, '0');
    return `must not contain control, invisible or bidirectional-formatting characters (found U+${cp})`;
  }
  // `café` written as e + U+0301 and as é are one id to a reader and two to a database: two usages
  // billed. Refused (not normalised) for the reason above: the application's own copy of the id
  // would then differ from the one in the outbox.
  if (value.normalize('NFC') !== value) return 'must be in Unicode normalization form C (NFC): normalize it with .normalize("NFC") before recording';
  return undefined;
}

/**
 * RFC 3339's date-time as the API's JSON Schema `format: date-time` takes it: T, t or a space
 * between date and time, any fraction of a second, and a time zone: Z, or an offset of hours with
 * or without minutes (`+02:00`, `+0200`, `+02`).
 */
const DATE_TIME = /^(\d{4})-(\d{2})-(\d{2})[Tt ](\d{2}):(\d{2}):(\d{2})(\.\d+)?(?:[Zz]|([+-])(\d{2})(?::?(\d{2}))?)$/;

export const DATE_TIME_PROBLEM = 'must be an RFC 3339 date-time with a time zone, e.g. 2025-01-31T12:00:00Z';

/**
 * The instant a date-time names, or undefined when it is not one. Stricter than `Date`, which rolls
 * 2026-02-30 over into March and reads a time without a zone as local time; and it reads every
 * offset the API's format check lets through (`Date` alone reads `+02` as no date at all).
 */
export function parseDateTime(text: string): Date | undefined {
  const m = DATE_TIME.exec(text);
  if (!m) return undefined;
  const [y, mo, d, h, mi, s] = m.slice(1, 7).map(Number) as [number, number, number, number, number, number];
  const offsetHours = Number(m[9] ?? 0);
  const offsetMinutes = Number(m[10] ?? 0);
  const daysInMonth = new Date(Date.UTC(y, mo, 0)).getUTCDate();
  if (mo < 1 || mo > 12 || d < 1 || d > daysInMonth || h > 23 || mi > 59 || s > 59 || offsetHours > 23 || offsetMinutes > 59) return undefined;
  const zone = m[8] === undefined ? 'Z' : `${m[8]}${m[9]}:${m[10] ?? '00'}`;
  return new Date(`${m[1]}-${m[2]}-${m[3]}T${m[4]}:${m[5]}:${m[6]}${m[7] ?? ''}${zone}`);
}

/** In an API token's tenant list: every tenant. Never a tenant's own id, so it can mean nothing else. */
export const ALL_TENANTS = '*';

/** Why `value` is not acceptable as a tenant id, if it is not. */
export function tenantProblem(value: unknown): string | undefined {
  if (value === ALL_TENANTS) return `must not be ${JSON.stringify(ALL_TENANTS)} (in API_TOKENS it stands for every tenant)`;
  return textProblem(value, MAX_TENANT_ID_LENGTH);
}

function check(field: string, problem: string | undefined, value: unknown): string {
  if (problem) throw new InvalidUsageError(field, problem);
  return value as string;
}

const checkText = (field: string, value: unknown, max: number): string => check(field, textProblem(value, max), value);

export interface UsageInput {
  /** The application's id for this unit of work, unique per tenant; recording it again is a no-op. */
  usageId: string;
  tenantId: string;
  quantity: number;
  /** Defaults to the `defaultEventName` option (the library reads no environment variable). */
  eventName?: string | undefined;
  /** When the usage happened; defaults to the transaction's time. */
  occurredAt?: Date | undefined;
}

const USAGE_FIELDS: ReadonlySet<string> = new Set<keyof UsageInput>(['usageId', 'tenantId', 'quantity', 'eventName', 'occurredAt']);

export interface ValidUsage {
  usageId: string;
  tenantId: string;
  quantity: number;
  eventName: string;
  /** Null: the transaction's time. */
  occurredAt: Date | null;
}

/**
 * Checks every field; throws an InvalidUsageError for the first bad one. `occurredAt` may be at
 * most MAX_RECORDED_AHEAD_MS ahead (Stripe's 5 minutes and the hour of skew delivery waits out; the
 * time only comes closer for a retry). Whether it is still
 * new enough for Stripe is `tooOldProblem`'s, asked only of a usage not yet recorded: a retry of one
 * recorded in time is answered as recorded. `now` is for tests.
 */
export function validateUsage(input: UsageInput, defaultEventName: string, now = Date.now()): ValidUsage {
  if (typeof input !== 'object' || input === null) throw new InvalidUsageError('input', 'must be an object');
  // A misspelt field (`event_name`, `occuredAt`) would otherwise move the usage to the default
  // meter or to "now", billed there without a word, and recording it again correctly would then be
  // a conflict.
  const unknown = Object.keys(input).find((field) => !USAGE_FIELDS.has(field));
  if (unknown !== undefined) throw new InvalidUsageError(unknown, `is not a field of a usage (they are ${[...USAGE_FIELDS].join(', ')})`);
  const usageId = checkText('usageId', input.usageId, MAX_USAGE_ID_LENGTH);
  const tenantId = check('tenantId', tenantProblem(input.tenantId), input.tenantId);
  // Absent means the default; null is a value, refused (as the API and the import refuse it), not
  // a silent move to another meter.
  const eventName =
    input.eventName === undefined
      ? checkText('defaultEventName', defaultEventName, MAX_EVENT_NAME_LENGTH)
      : checkText('eventName', input.eventName, MAX_EVENT_NAME_LENGTH);
  const { quantity } = input;
  if (typeof quantity !== 'number') {
    // A bigint (Prisma's BigInt), numeric text (node-postgres's bigint and sum()), a Decimal: named, not taken for a bad value.
    const given = quantity === null || quantity === undefined ? String(quantity) : typeof quantity === 'object' ? `an object (${(quantity as object).constructor?.name ?? 'Object'})` : `a ${typeof quantity}`;
    throw new InvalidUsageError('quantity', `must be a positive integer, as a number (given ${given}): convert it with Number() first`);
  }
  if (!Number.isInteger(quantity) || quantity < 1) throw new InvalidUsageError('quantity', 'must be a positive integer');
  if (quantity > MAX_VALUE) throw new InvalidUsageError('quantity', `must be at most ${MAX_VALUE} (Stripe accepts 15 digits)`);
  let occurredAt: Date | null = null;
  if (input.occurredAt !== undefined) {
    if (!(input.occurredAt instanceof Date) || Number.isNaN(input.occurredAt.getTime())) {
      throw new InvalidUsageError('occurredAt', 'must be a valid Date');
    }
    if (input.occurredAt.getTime() > now + MAX_RECORDED_AHEAD_MS) {
      throw new InvalidUsageError(
        'occurredAt',
        `must not be more than ${MAX_RECORDED_AHEAD_MS / 60_000} minutes in the future by this machine's clock (${new Date(now).toISOString()}): Stripe takes usage at most 5 minutes ahead, and delivery waits out at most an hour of clock skew`,
      );
    }
    occurredAt = input.occurredAt;
  }
  return { usageId, tenantId, quantity, eventName, occurredAt };
}

/**
 * Why a new usage stamped `occurredAt` is refused as too old, if it is (the field is `occurredAt`).
 * Stripe takes usage stamped at most 35 days back; older, it could never be reported, so it is
 * refused now rather than kept as a dead letter. The hour of margin is the time the pipeline may
 * need to get it to Stripe. `now` is for tests.
 */
export function tooOldProblem(occurredAt: Date | null, now = Date.now()): string | undefined {
  if (occurredAt === null || !tooOldToSend(occurredAt, now)) return undefined;
  const hours = Math.floor((now - occurredAt.getTime()) / 3_600_000);
  return `must be less than 34 days 23 hours old (Stripe refuses usage older than 35 days; the last hour is kept for delivery): this is ${Math.floor(hours / 24)} days ${hours % 24} hours old`;
}
