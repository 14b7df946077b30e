import { expect, it } from 'vitest';
import { formatTable } from '../../src/cli/format.js';

it('aligns columns to their widest cell, header included', () => {
  const out = formatTable([{ header: 'tenant' }, { header: 'n', align: 'right' }], [['a', '10'], ['bbbbbbbb', '2']]);
  expect(out).toBe('tenant     n\na         10\nbbbbbbbb   2\n');
});

it('lays out 200,000 rows (a platform with that many tenants mapped): no argument-count limit', () => {
  const rows = Array.from({ length: 200_000 }, (_, i) => [`tenant-${i}`, `cus_${i}`]);
  const out = formatTable([{ header: 'tenant' }, { header: 'customer' }], rows);
  const lines = out.trimEnd().split('\n');
  expect(lines).toHaveLength(200_001);
  expect(lines[200_000]).toBe('tenant-199999  cus_199999');
});
