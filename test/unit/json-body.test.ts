import { describe, expect, it } from 'vitest';
import { parseStrictJson } from '../../src/api/json-body.js';
import { ApiError } from '../../src/api/errors.js';

const json = { headers: { 'content-type': 'application/json' } };
const parse = (text: string) => parseStrictJson(json, Buffer.from(text, 'utf8'));
const refusal = (text: string) => {
  try {
    parse(text);
  } catch (err) {
    expect(err).toBeInstanceOf(ApiError);
    const e = err as ApiError;
    return { status: e.statusCode, code: e.code, message: e.message };
  }
  throw new Error(`${text} was accepted`);
};

describe('parseStrictJson: numbers are judged by their text', () => {
  it.each([
    ['1.00000000000000001', 1],
    ['0.99999999999999999', 1],
    ['1.0', 1],
    ['1e0', 1],
    ['1E+3', 1000],
    ['-0', 0],
  ])('refuses %s, which would be read as %d', (written, readAs) => {
    expect(refusal(`{"quantity": ${written}}`)).toEqual({
      status: 400,
      code: 'inexact_number',
      message: `the number ${written} would be read as ${readAs}: write whole numbers as plain digits`,
    });
  });

  it('refuses plain digits past 2^53 − 1 as too large, not as badly written', () => {
    expect(refusal('{"quantity": 9007199254740993}')).toEqual({
      status: 400,
      code: 'inexact_number',
      message: 'the number 9007199254740993 would be read as 9007199254740992: it is past 9007199254740991, the largest whole number read exactly',
    });
  });

  it('refuses an inexact number nested anywhere in the body', () => {
    expect(refusal('{"a": [1, {"b": 2.000000000000000001}]}').code).toBe('inexact_number');
  });

  it('keeps numbers written as what they are', () => {
    expect(parse('{"quantity": 7, "big": 999999999999999, "neg": -3, "frac": 1.5, "tiny": 0.1}')).toEqual({
      quantity: 7,
      big: 999_999_999_999_999,
      neg: -3,
      frac: 1.5,
      tiny: 0.1,
    });
  });

  it('still says invalid JSON first', () => {
    expect(refusal('{"quantity": 1.0').code).toBe('invalid_json');
  });
});
