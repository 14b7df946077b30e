/**
 * JSON text read strictly, for the API's bodies (json-body.ts) and the bulk import's lines
 * (src/ops/import.ts): no Fastify here, so the import, which the package index exports, loads none.
 */

export class JsonTextError extends Error {
  readonly code: 'invalid_json' | 'inexact_number' | 'duplicate_key';
  constructor(code: JsonTextError['code'], message: string) {
    super(message);
    this.code = code;
    this.name = 'JsonTextError';
  }
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

/** `text` parsed, or a JsonTextError: not JSON, a number that is not what was written, a key twice in one object. `what` names the text in the message. */
export function parseJsonText(text: string, what: string): unknown {
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
    throw new JsonTextError('invalid_json', `${what} is not valid JSON`);
  }
  if (inexact) {
    // Past 2^53 − 1, no way of writing the number helps: say so rather than ask for plain digits.
    const advice = Number.isSafeInteger(inexact.value) ? 'write whole numbers as plain digits' : `it is past ${Number.MAX_SAFE_INTEGER}, the largest whole number read exactly`;
    throw new JsonTextError('inexact_number', `the number ${inexact.source} would be read as ${inexact.value}: ${advice}`);
  }
  const repeated = duplicateKey(text);
  if (repeated !== undefined) {
    throw new JsonTextError('duplicate_key', `the key ${JSON.stringify(repeated)} appears more than once in one object`);
  }
  return value;
}
