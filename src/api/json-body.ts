/**
 * The API's JSON body parser. Fastify's own decodes bytes leniently (an invalid UTF-8 sequence
 * becomes U+FFFD), ignores the declared charset and the Content-Encoding, and lets a repeated key
 * silently win. For usage ids that is data loss: two different ids can arrive as the same string,
 * and the second usage is dropped as a duplicate. So every body is refused unless it is exactly what
 * it claims: UTF-8 (the only charset JSON allows on the wire, RFC 8259 §8.1), not compressed, and
 * valid JSON with each key once per object.
 */
import type { FastifyInstance, FastifyRequest } from 'fastify';
import { ApiError } from './errors.js';

const strictUtf8 = new TextDecoder('utf-8', { fatal: true });

function charsetOf(contentType: string | undefined): string | undefined {
  const match = /;\s*charset\s*=\s*"?([^";\s]+)"?/i.exec(contentType ?? '');
  return match?.[1]?.toLowerCase();
}

/** The first key that occurs twice in one object of `text` (which JSON.parse has already accepted). */
export function duplicateKey(text: string): string | undefined {
  // One entry per open container: the keys seen so far in an object, null for an array.
  const open: (Set<string> | null)[] = [];
  let expectingKey = false;
  for (let i = 0; i < text.length; i++) {
    const ch = text[i];
    if (ch === '"') {
      let end = i + 1;
      while (text[end] !== '"') end += text[end] === '\\' ? 2 : 1;
      const keys = open.at(-1);
      if (keys && expectingKey) {
        const key = JSON.parse(text.slice(i, end + 1)) as string;
        if (keys.has(key)) return key;
        keys.add(key);
        expectingKey = false;
      }
      i = end;
    } else if (ch === '{') {
      open.push(new Set());
      expectingKey = true;
    } else if (ch === '[') {
      open.push(null);
    } else if (ch === '}' || ch === ']') {
      open.pop();
      expectingKey = false;
    } else if (ch === ',') {
      expectingKey = open.at(-1) != null;
    }
  }
  return undefined;
}

export function parseStrictJson(request: Pick<FastifyRequest, 'headers'>, body: Buffer): unknown {
  const encoding = request.headers['content-encoding']?.trim().toLowerCase();
  if (encoding && encoding !== 'identity') {
    throw new ApiError(415, 'unsupported_content_encoding', `Content-Encoding ${JSON.stringify(encoding)} is not accepted: send the body uncompressed`);
  }
  const charset = charsetOf(request.headers['content-type']);
  if (charset !== undefined && charset !== 'utf-8' && charset !== 'utf8') {
    throw new ApiError(415, 'unsupported_charset', `charset ${JSON.stringify(charset)} is not accepted: JSON bodies must be UTF-8`);
  }
  let text: string;
  try {
    text = strictUtf8.decode(body);
  } catch {
    throw new ApiError(400, 'invalid_encoding', 'the body is not valid UTF-8');
  }
  if (text.trim() === '') throw new ApiError(400, 'invalid_json', 'the body is empty; send a JSON object');
  let value: unknown;
  let inexact: { source: string; value: number } | undefined;
  try {
    // A number is judged by its text, not by the double it parses to: `1.00000000000000001`,
    // `0.99999999999999999`, `1e0` and `9007199254740993` all parse to a whole number that is not
    // what was written. Refused rather than repaired, like every other input.
    value = JSON.parse(text, (_key, v: unknown, context?: { source?: string }) => {
      if (typeof v === 'number' && Number.isInteger(v) && context?.source !== undefined && context.source !== String(v)) {
        inexact ??= { source: context.source, value: v };
      }
      return v;
    });
  } catch {
    throw new ApiError(400, 'invalid_json', 'the body is not valid JSON');
  }
  if (inexact) {
    throw new ApiError(400, 'inexact_number', `the number ${inexact.source} would be read as ${inexact.value}: write whole numbers as plain digits`);
  }
  const repeated = duplicateKey(text);
  if (repeated !== undefined) {
    throw new ApiError(400, 'duplicate_key', `the key ${JSON.stringify(repeated)} appears more than once in one object`);
  }
  return value;
}

/** Replaces Fastify's JSON parser on `app` (and the routes it encapsulates) with the strict one. */
export function useStrictJson(app: FastifyInstance): void {
  app.removeContentTypeParser('application/json');
  app.addContentTypeParser('application/json', { parseAs: 'buffer' }, (request, body, done) => {
    try {
      done(null, parseStrictJson(request, body as Buffer));
    } catch (err) {
      done(err as Error, undefined);
    }
  });
}
