/**
 * Input validation, pure: every field's limits at their edges, every kind of hidden text, the time
 * window with an injected clock. (The same refusals through PostgreSQL, with nothing written: test/enqueue.test.ts.)
 */
import { describe, expect, it } from 'vitest';
import { InvalidUsageError } from '../../src/outbox/errors.js';
import { MAX_QUANTITY, MAX_TENANT_ID_LENGTH, MAX_USAGE_ID_LENGTH, parseDateTime, tenantProblem, textProblem, tooOldProblem, validateUsage } from '../../src/outbox/validate.js';
import { MAX_EVENT_NAME_LENGTH } from '../../src/stripe/rules.js';
import { mappingProblem } from '../../src/outbox/customers.js';

const NOW = Date.parse('2026-12-02T12:00:00Z');
const MIN = 60_000;
const DAY = 86_400_000;
const ok = { usageId: 'u-1', tenantId: 'acme', quantity: 3 };

function refusal(input: unknown, now = NOW): InvalidUsageError {
  try {
    validateUsage(input as never, 'api_requests', now);
  } catch (err) {
    expect(err).toBeInstanceOf(InvalidUsageError);
    return err as InvalidUsageError;
  }
  throw new Error(`accepted: ${JSON.stringify(input)}`);
}

describe('validateUsage', () => {
  it('accepts a plain usage, the default meter and no time', () => {
    expect(validateUsage(ok, 'api_requests', NOW)).toEqual({ usageId: 'u-1', tenantId: 'acme', quantity: 3, eventName: 'api_requests', occurredAt: null });
    expect(validateUsage({ ...ok, eventName: 'tokens' }, 'api_requests', NOW).eventName).toBe('tokens');
  });

  it('refuses what is not an object', () => {
    for (const input of [null, undefined, 'usage', 3]) {
      const e = refusal(input);
      expect([e.field, e.reason, e.code]).toEqual(['input', 'must be an object', 'invalid_usage']);
      expect(e.message).toBe('input: must be an object');
    }
  });

  it('names the field at fault, first bad field first', () => {
    expect(refusal({ ...ok, usageId: '' }).field).toBe('usageId');
    expect(refusal({ ...ok, tenantId: 7 }).field).toBe('tenantId');
    expect(refusal({ ...ok, eventName: ' x' }).field).toBe('eventName');
    // null is not "absent": an export's empty column must not bill the default meter.
    expect(refusal({ ...ok, eventName: null })).toMatchObject({ field: 'eventName', reason: 'must be a string' });
    expect(refusal({ ...ok, occurredAt: null }).field).toBe('occurredAt');
    expect(refusal({ usageId: '', tenantId: '', quantity: 0 }).field).toBe('usageId');
  });

  it('refuses "*" as a tenant (the all-tenants wildcard of API_TOKENS), and nothing else like it', () => {
    const e = refusal({ ...ok, tenantId: '*' });
    expect([e.field, e.message]).toEqual(['tenantId', 'tenantId: must not be "*" (in API_TOKENS it stands for every tenant)']);
    expect(tenantProblem('*')).toBe('must not be "*" (in API_TOKENS it stands for every tenant)');
    for (const t of ['**', 'a*', '*b']) expect(tenantProblem(t), t).toBeUndefined();
    // The same rule for `customers set` (tried from outside: `customers set '*' cus_…` was stored).
    expect(mappingProblem('*', 'cus_123')).toBe('tenant must not be "*" (in API_TOKENS it stands for every tenant)');
    expect(tenantProblem('a'.repeat(MAX_TENANT_ID_LENGTH + 1))).toBe(`must be at most ${MAX_TENANT_ID_LENGTH} characters`);
  });

  it('quantity: a positive integer up to 15 digits', () => {
    expect(validateUsage({ ...ok, quantity: 1 }, 'm', NOW).quantity).toBe(1);
    expect(validateUsage({ ...ok, quantity: MAX_QUANTITY }, 'm', NOW).quantity).toBe(999_999_999_999_999);
    for (const quantity of [0, -1, 1.5, Number.NaN, Infinity]) {
      const e = refusal({ ...ok, quantity });
      expect([e.field, e.reason], String(quantity)).toEqual(['quantity', 'must be a positive integer']);
    }
    // Another type (a bigint from Prisma, numeric text from node-postgres, a Decimal) is named, not taken for a bad value.
    const given: [unknown, string][] = [['3', 'a string'], [3n, 'a bigint'], [null, 'null'], [undefined, 'undefined'], [true, 'a boolean'], [new (class Decimal {})(), 'an object (Decimal)']];
    for (const [quantity, type] of given) {
      const e = refusal({ ...ok, quantity });
      expect([e.field, e.reason], type).toEqual(['quantity', `must be a positive integer, as a number (given ${type}): convert it with Number() first`]);
    }
    const big = refusal({ ...ok, quantity: MAX_QUANTITY + 1 });
    expect([big.field, big.message]).toEqual(['quantity', 'quantity: must be at most 999999999999999 (Stripe accepts 15 digits)']);
  });

  it('lengths: usage id 90, tenant 200, event name 100, counted in characters', () => {
    expect(validateUsage({ ...ok, usageId: 'x'.repeat(MAX_USAGE_ID_LENGTH) }, 'm', NOW).usageId).toHaveLength(90);
    expect(refusal({ ...ok, usageId: 'x'.repeat(91) }).reason).toBe('must be at most 90 characters');
    expect(validateUsage({ ...ok, tenantId: 't'.repeat(MAX_TENANT_ID_LENGTH) }, 'm', NOW).tenantId).toHaveLength(200);
    expect(refusal({ ...ok, tenantId: 't'.repeat(201) }).reason).toBe('must be at most 200 characters');
    expect(validateUsage({ ...ok, eventName: 'e'.repeat(MAX_EVENT_NAME_LENGTH) }, 'm', NOW).eventName).toHaveLength(100);
    expect(refusal({ ...ok, eventName: 'e'.repeat(101) }).reason).toBe('must be at most 100 characters');
    // As PostgreSQL and the API's JSON Schema count: an emoji is one character (two UTF-16 units).
    expect(validateUsage({ ...ok, usageId: '🧾'.repeat(90) }, 'm', NOW).usageId).toBe('🧾'.repeat(90));
    expect(refusal({ ...ok, usageId: '🧾'.repeat(91) }).reason).toBe('must be at most 90 characters');
  });

  it('refuses a field it does not know (a misspelling would bill the default meter, or now), naming it', () => {
    for (const field of ['event_name', 'occuredAt', 'timestamp', 'usage_id']) {
      const e = refusal({ ...ok, [field]: 'x' });
      expect([e.field, e.reason], field).toEqual([field, 'is not a field of a usage (they are usageId, tenantId, quantity, eventName, occurredAt)']);
    }
    expect(refusal({ ...ok, extra: undefined }).field).toBe('extra');
  });

  it('a bad defaultEventName (an empty environment variable passed on) is named as the option, not as eventName', () => {
    for (const name of ['', 'api_requests\r', ' tokens']) {
      try {
        validateUsage(ok, name, NOW);
        throw new Error(`accepted ${JSON.stringify(name)}`);
      } catch (err) {
        expect((err as InvalidUsageError).field, JSON.stringify(name)).toBe('defaultEventName');
      }
    }
    expect(validateUsage({ ...ok, eventName: 'tokens' }, '', NOW).eventName).toBe('tokens');
  });

  it('occurredAt: a valid Date, at most 64 minutes ahead, as far as delivery waits for a clock that runs fast (how old it may be is tooOldProblem\'s)', () => {
    const at = (ms: number) => validateUsage({ ...ok, occurredAt: new Date(NOW + ms) }, 'm', NOW).occurredAt?.getTime();
    expect(at(64 * MIN)).toBe(NOW + 64 * MIN);
    expect(at(-400 * DAY)).toBe(NOW - 400 * DAY);
    const ahead = refusal({ ...ok, occurredAt: new Date(NOW + 64 * MIN + 1) });
    expect([ahead.field, ahead.message]).toEqual([
      'occurredAt',
      "occurredAt: must not be more than 64 minutes in the future by this machine's clock (2026-12-02T12:00:00.000Z): Stripe takes usage at most 5 minutes ahead, and delivery waits out at most an hour of clock skew",
    ]);
    const invalidDate = refusal({ ...ok, occurredAt: new Date(Number.NaN) });
    expect([invalidDate.field, invalidDate.reason]).toEqual(['occurredAt', 'must be a valid Date']);
    expect(refusal({ ...ok, occurredAt: '2026-12-02T12:00:00Z' }).reason).toBe('must be a valid Date');
  });
});

describe('tooOldProblem', () => {
  it('back to 35 days less the hour the pipeline needs; no time is the transaction\'s', () => {
    const problem = (ms: number) => tooOldProblem(new Date(NOW + ms), NOW);
    expect(tooOldProblem(null, NOW)).toBeUndefined();
    expect(problem(0)).toBeUndefined();
    expect(problem(5 * MIN)).toBeUndefined();
    expect(problem(-(34 * DAY + 23 * 60 * MIN))).toBeUndefined();
    expect(problem(-(34 * DAY + 23 * 60 * MIN) - 1)).toBe(
      'must be less than 34 days 23 hours old (Stripe refuses usage older than 35 days; the last hour is kept for delivery): this is 34 days 23 hours old',
    );
    expect(problem(-40 * DAY)).toContain('this is 40 days 0 hours old');
    expect(problem(-(36 * DAY + 5 * 60 * MIN + 1))).toContain('this is 36 days 5 hours old');
  });
});

describe('textProblem', () => {
  it('accepts ordinary text, accents, emoji and CJK', () => {
    for (const s of ['acme', 'Zürich-1', 'user 42', 'ε', '東京', 'ok 😀', 'a:b%c']) expect(textProblem(s, 100), s).toBeUndefined();
  });

  it('refuses non-strings, empty text and outer spaces', () => {
    expect(textProblem(3, 10)).toBe('must be a string');
    expect(textProblem(undefined, 10)).toBe('must be a string');
    for (const s of ['', ' a', 'a ', '\ta', ' ']) expect(textProblem(s, 10), JSON.stringify(s)).toBe('must be non-empty, without leading or trailing spaces');
  });

  it('refuses a lone surrogate (half a UTF-16 pair)', () => {
    expect(textProblem('a\uD800b', 10)).toBe('must be valid Unicode text (it contains half of a UTF-16 surrogate pair)');
    expect(textProblem('a\uDC00', 10)).toMatch(/surrogate/);
  });

  it('refuses hidden characters and names the code point', () => {
    const cases: [string, string][] = [
      ['a\u0000b', 'U+0000'],
      ['a\nb', 'U+000A'],
      ['a\u001Bb', 'U+001B'],
      ['a\u007Fb', 'U+007F'],
      ['a\u200Bb', 'U+200B'],
      ['a\u202Eb', 'U+202E'],
      ['a\u2066b', 'U+2066'],
      ['a\uFEFFb', 'U+FEFF'],
      ['a\u00ADb', 'U+00AD'],
      ['a\u2028b', 'U+2028'],
      ['a\u2029b', 'U+2029'],
      ['a\uFDD0b', 'U+FDD0'],
      ['a\uFDEFb', 'U+FDEF'],
      ['a\uFFFDb', 'U+FFFD'],
      ['a\uFFFEb', 'U+FFFE'],
      ['a\uFFFFb', 'U+FFFF'],
      ['a\u{1FFFE}b', 'U+1FFFE'],
      ['a\u{10FFFF}b', 'U+10FFFF'],
      // Default_Ignorable_Code_Point outside Cc/Cf: look-alike ids that would be billed apart.
      ['a\u3164b', 'U+3164'],
      ['a\u115Fb', 'U+115F'],
      ['a\uFFA0b', 'U+FFA0'],
      ['a\u034Fb', 'U+034F'],
      ['a\uFE0Fb', 'U+FE0F'],
      ['a\u{E0100}b', 'U+E0100'],
      ['a\u2800b', 'U+2800'],
      // White space that is not the plain space.
      ['a\u00A0b', 'U+00A0'],
      ['a\u3000b', 'U+3000'],
      ['a\u2003b', 'U+2003'],
    ];
    for (const [s, cp] of cases) {
      expect(textProblem(s, 10), cp).toBe(`must not contain control, invisible or bidirectional-formatting characters (found ${cp})`);
    }
  });

  it('keeps visible text and the plain space', () => {
    for (const ok of ['a b', 'café', '東京-42', 'ﾃｽﾄ', 'Ω', '👍🏽', 'e\u0301x'.normalize('NFC')]) expect(textProblem(ok, 20), ok).toBeUndefined();
  });

  it('refuses text not in NFC, so café written two ways cannot be two usages', () => {
    const nfd = 'cafe\u0301';
    expect(nfd.normalize('NFC')).toBe('café');
    expect(textProblem(nfd, 10)).toBe('must be in Unicode normalization form C (NFC): normalize it with .normalize("NFC") before recording');
    expect(textProblem('\u212B', 10)).toMatch(/NFC/); // ANGSTROM SIGN: NFC is U+00C5
    expect(textProblem('café', 10)).toBeUndefined();
  });

  it('checks the length before the characters, at the exact limit', () => {
    expect(textProblem('abc', 3)).toBeUndefined();
    expect(textProblem('abcd', 3)).toBe('must be at most 3 characters');
  });
});

describe('parseDateTime: RFC 3339 as the API\'s format check takes it', () => {
  const at = (text: string) => parseDateTime(text)?.toISOString();
  it('reads every offset the format check lets through, with or without the colon or the minutes', () => {
    expect(at('2026-05-01T12:00:00Z')).toBe('2026-05-01T12:00:00.000Z');
    expect(at('2026-05-01t12:00:00z')).toBe('2026-05-01T12:00:00.000Z');
    expect(at('2026-05-01 12:00:00+02:00')).toBe('2026-05-01T10:00:00.000Z');
    expect(at('2026-05-01T12:00:00+0230')).toBe('2026-05-01T09:30:00.000Z');
    expect(at('2026-05-01T12:00:00-02')).toBe('2026-05-01T14:00:00.000Z');
    expect(at('2026-05-01T12:00:00.123456-00:30')).toBe('2026-05-01T12:30:00.123Z');
    expect(at('2024-02-29T23:59:59+23:59')).toBe('2024-02-29T00:00:59.000Z');
    expect(at('2026-12-31T00:00:00Z')).toBe('2026-12-31T00:00:00.000Z');
    expect(at('2026-01-01T00:00:00Z')).toBe('2026-01-01T00:00:00.000Z');
  });
  it('refuses what is not an instant: no zone, a day or an hour that does not exist, a leap second, a bad offset', () => {
    for (const text of [
      '2026-05-01T12:00:00', '2026-05-01', '2026-02-29T12:00:00Z', '2026-04-31T12:00:00Z', '2026-00-10T12:00:00Z',
      '2026-13-10T12:00:00Z', '2026-05-00T12:00:00Z', '2026-05-01T24:00:00Z', '2026-05-01T12:60:00Z',
      '2016-12-31T23:59:60Z', '2026-05-01T12:00:00+24:00', '2026-05-01T12:00:00+02:60', '2026-05-01T12:00:00+2',
      '2026-05-01T12:00:00.Z', ' 2026-05-01T12:00:00Z', '2026-05-01T12:00:00Z ', '2026-05-01T12:00:00+02:00:00',
    ]) {
      expect(parseDateTime(text), text).toBeUndefined();
    }
  });
});
