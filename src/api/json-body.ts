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
import { JsonTextError, parseJsonText } from './strict-json.js';

const strictUtf8 = new TextDecoder('utf-8', { fatal: true });

function charsetOf(contentType: string | undefined): string | undefined {
  const match = /;\s*charset\s*=\s*"?([^";\s]+)"?/i.exec(contentType ?? '');
  return match?.[1]?.toLowerCase();
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
  try {
    return parseJsonText(text, 'the body');
  } catch (err) {
    if (err instanceof JsonTextError) throw new ApiError(400, err.code, err.message);
    throw err;
  }
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
