/**
 * /health's shared probe (src/api/health.ts `oneProbeAtATime`): one probe at a time, its answer
 * shared for a while, timed by the monotonic clock.
 */
import { afterEach, expect, it, vi } from 'vitest';
import { oneProbeAtATime } from '../../src/api/health.js';

afterEach(() => vi.restoreAllMocks());

it('runs one probe for callers who ask together, and again once its answer has aged', async () => {
  let probes = 0;
  let release!: () => void;
  const probe = oneProbeAtATime(async () => {
    probes++;
    await new Promise<void>((resolve) => (release = resolve));
    return probes;
  }, 20);
  const asked = [probe(), probe(), probe()];
  release();
  expect(await Promise.all(asked)).toEqual([1, 1, 1]);
  expect(await probe()).toBe(1);
  await new Promise((resolve) => setTimeout(resolve, 30));
  const again = probe();
  release();
  expect(await again).toBe(2);
});

it('a wall clock stepped back (NTP, a VM resumed) does not freeze the last answer', async () => {
  let probes = 0;
  const probe = oneProbeAtATime(async () => ++probes, 20);
  expect(await probe()).toBe(1);
  const now = Date.now();
  vi.spyOn(Date, 'now').mockReturnValue(now - 3_600_000);
  await new Promise((resolve) => setTimeout(resolve, 30));
  expect(await probe()).toBe(2);
});
