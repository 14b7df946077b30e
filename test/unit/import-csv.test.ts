/** The bulk import's CSV rows (RFC 4180 on one line): what a spreadsheet writes, read back field by field. */
import { expect, it } from 'vitest';
import { csvFields } from '../../src/ops/import.js';

it('splits on commas; quoted fields keep commas and doubled quotes; empty fields stay empty', () => {
  expect(csvFields('a,b,c')).toEqual(['a', 'b', 'c']);
  expect(csvFields('"a, b","say ""hi""",c')).toEqual(['a, b', 'say "hi"', 'c']);
  expect(csvFields(',x,')).toEqual(['', 'x', '']);
  expect(csvFields('""')).toEqual(['']);
  expect(csvFields('a,""')).toEqual(['a', '']);
  // Spaces are data: an id with one is refused by validation, not quietly trimmed here.
  expect(csvFields(' a , b')).toEqual([' a ', ' b']);
});

it('refuses a row it cannot read as written rather than guessing', () => {
  expect(() => csvFields('"open,b')).toThrow('a quoted field is not closed on its line');
  expect(() => csvFields('"a"b,c')).toThrow('a closing quote must end its field (column 1)');
  expect(() => csvFields('a,b"c')).toThrow('a quote inside an unquoted field (column 2)');
});
