/**
 * The usage workflow's static summary, pure: Temporal refuses a start whose summary payload is over
 * `limit.userMetadataSummarySize` (400 bytes of the serialized payload by default), so it is bounded
 * in UTF-8 bytes, whatever the tenant and event name validation lets through.
 */
import { defaultPayloadConverter } from '@temporalio/common';
import { temporal } from '@temporalio/proto';
import { describe, expect, it } from 'vitest';
import { boundedSummary, SUMMARY_MAX_DATA_BYTES, usageSummary } from '../../src/temporal/start-usage.js';

/** What Temporal measures: the summary as the client sends it, a Payload message. */
const serializedBytes = (summary: string) => temporal.api.common.v1.Payload.encode(defaultPayloadConverter.toPayload(summary)!).finish().length;
const dataBytes = (summary: string) => Buffer.byteLength(JSON.stringify(summary), 'utf8');

const occurredAt = new Date('2026-12-03T10:00:00.000Z');

describe('usageSummary', () => {
  it('is left whole when it fits', () => {
    expect(usageSummary({ idempotency_key: 'k', tenant_id: 'acme', quantity: '3', event_name: 'api_requests', occurred_at: occurredAt })).toBe(
      'acme: 3 × api_requests at 2026-12-03T10:00:00.000Z',
    );
  });

  it('keeps a 120-CJK-character tenant with a 100-character event name under 400 serialized bytes, valid UTF-8, with an ellipsis', () => {
    const tenant = '租'.repeat(120);
    const unbounded = `${tenant}: 999999999999999 × ${'e'.repeat(100)} at ${occurredAt.toISOString()}`;
    expect(serializedBytes(unbounded)).toBeGreaterThan(400);
    const summary = usageSummary({ idempotency_key: 'k', tenant_id: tenant, quantity: '999999999999999', event_name: 'e'.repeat(100), occurred_at: occurredAt });
    expect(serializedBytes(summary)).toBeLessThanOrEqual(400);
    expect(dataBytes(summary)).toBeLessThanOrEqual(SUMMARY_MAX_DATA_BYTES);
    expect(summary.endsWith('…')).toBe(true);
    expect(summary.startsWith('租'.repeat(100))).toBe(true);
    // Round-trips through UTF-8 unchanged: no character was cut in half.
    expect(Buffer.from(summary, 'utf8').toString('utf8')).toBe(summary);
    expect(summary.isWellFormed()).toBe(true);
  });

  it('never splits a surrogate pair (4-byte characters) and uses the whole budget it can', () => {
    for (let max = 10; max <= 60; max++) {
      const summary = boundedSummary('😀'.repeat(40), max);
      expect(summary.isWellFormed()).toBe(true);
      expect(dataBytes(summary)).toBeLessThanOrEqual(max);
      // One more emoji would not have fit.
      expect(dataBytes(`😀${summary}`)).toBeGreaterThan(max);
    }
  });

  it('counts JSON escapes, as the payload carries them', () => {
    const summary = boundedSummary('"\u0001'.repeat(50), 40);
    expect(dataBytes(summary)).toBeLessThanOrEqual(40);
    expect(summary.endsWith('…')).toBe(true);
  });

  it('a text exactly at the limit is not cut', () => {
    const text = 'a'.repeat(SUMMARY_MAX_DATA_BYTES - 2);
    expect(boundedSummary(text)).toBe(text);
    expect(boundedSummary(`${text}b`)).toMatch(/…$/);
  });
});
