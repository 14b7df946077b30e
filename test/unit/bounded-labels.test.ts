/**
 * A metric label taken from a payload (Stripe's error codes) stays a bounded set, whatever the
 * payloads say.
 */
import { expect, it } from 'vitest';
import { BoundedLabels } from '../../src/metrics.js';

it("keeps codes as their own labels up to the bound, then counts new ones and odd shapes as 'other'", () => {
  const labels = new BoundedLabels(3);
  expect(['no_meter', 'archived_meter', 'no_meter'].map((c) => labels.of(c))).toEqual(['no_meter', 'archived_meter', 'no_meter']);
  expect(labels.of('Customer cus_123 not found')).toBe('other');
  expect(labels.of('x'.repeat(65))).toBe('other');
  expect(labels.of('meter_event_invalid_value')).toBe('meter_event_invalid_value');
  expect(labels.of('timestamp_in_future')).toBe('other');
  // Those already in use stay themselves.
  expect(labels.of('archived_meter')).toBe('archived_meter');
});
