/**
 * Structured logs: JSON lines for a log shipper, the same lines made readable for a person when
 * standard output is a terminal. Secrets never reach them: known secret fields are redacted by
 * path, and every string is scrubbed of Stripe keys and URL passwords before it is written.
 */
import pino from 'pino';

const REDACT_PATHS = [
  'apiKey', '*.apiKey', 'STRIPE_API_KEY', '*.STRIPE_API_KEY', 'password', '*.password', 'token', '*.token',
  'authorization', '*.authorization', 'headers.authorization', 'req.headers.authorization', 'secret', '*.secret',
  // The bytes Node's HTTP parser read before it refused a request (every header, a bearer token's
  // among them), on the error Fastify logs at trace.
  'rawPacket', '*.rawPacket',
];

const STRIPE_KEY = /\b(sk|rk|pk|whsec)_(test|live)?_?[A-Za-z0-9]{6,}/g;
const URL_PASSWORD = /(\b[a-z][a-z0-9+.-]*:\/\/[^:@/\s]+:)[^@/\s]+@/gi;
/** A password given as a URL's query parameter (`postgres://u@db/x?password=…`, `sslpassword=…`). */
const QUERY_PASSWORD = /([?&](?:ssl)?password=)[^&\s"']+/gi;

/** Removes anything that looks like a Stripe key or a password inside a URL. */
export function scrub(text: string): string {
  return text.replace(STRIPE_KEY, '$1_***').replace(URL_PASSWORD, '$1***@').replace(QUERY_PASSWORD, '$1***');
}

export type Logger = pino.Logger;

/**
 * Scrubs each finished line on its way out, after pino's serializers and redaction have run, so
 * every field of every line is covered (a serializer's output included).
 */
class ScrubbingStream implements pino.DestinationStream {
  private readonly inner: pino.DestinationStream;
  constructor(inner: pino.DestinationStream) {
    this.inner = inner;
  }
  write(line: string): void {
    this.inner.write(scrub(line));
  }
}

/** Writes each JSON line as `formatForHumans` reads it. */
class HumanStream implements pino.DestinationStream {
  private readonly inner: pino.DestinationStream;
  private readonly colors: boolean;
  constructor(
    inner: pino.DestinationStream,
    colors: boolean,
  ) {
    this.inner = inner;
    this.colors = colors;
  }
  write(line: string): void {
    this.inner.write(`${formatForHumans(line, this.colors)}\n`);
  }
}

/**
 * Logs to `destination`; without one, to standard output: JSON lines, or lines for a person when
 * it is a terminal (coloured unless the terminal has none, or NO_COLOR is set).
 */
export function createLogger(level: string, destination?: pino.DestinationStream): Logger {
  let out = destination;
  if (!out) {
    const fd1 = pino.destination({ fd: 1, sync: true });
    out = process.stdout.isTTY ? new HumanStream(fd1, process.stdout.hasColors()) : fd1;
  }
  return pino(
    {
      level,
      base: { service: 'billing-outbox' },
      redact: { paths: REDACT_PATHS, censor: '***' },
    },
    new ScrubbingStream(out),
  );
}

const LEVELS: Record<number, { name: string; color: string }> = {
  10: { name: 'TRACE', color: '2' },
  20: { name: 'DEBUG', color: '2' },
  30: { name: 'INFO', color: '32' },
  40: { name: 'WARN', color: '33' },
  50: { name: 'ERROR', color: '31' },
  60: { name: 'FATAL', color: '1;31' },
};
/** Said once per process, not once per line. */
const UNSAID = new Set(['level', 'time', 'msg', 'pid', 'hostname', 'service']);

/**
 * One pino JSON line as a person reads it: `12:04:05.123 WARN  message  key=value …`, with an
 * error's stack on the lines after it. A line that is not a JSON object is returned as it is.
 */
export function formatForHumans(line: string, colors: boolean): string {
  let entry: Record<string, unknown>;
  try {
    const parsed: unknown = JSON.parse(line);
    if (typeof parsed !== 'object' || parsed === null || Array.isArray(parsed)) return visible(line.trimEnd());
    entry = parsed as Record<string, unknown>;
  } catch {
    return visible(line.trimEnd());
  }
  const paint = (code: string, text: string) => (colors ? `\x1b[${code}m${text}\x1b[0m` : text);
  const level = LEVELS[Number(entry.level)] ?? { name: String(entry.level ?? '?').toUpperCase(), color: '0' };
  const time = typeof entry.time === 'number' ? new Date(entry.time).toISOString().slice(11, 23) : '';
  const fields: string[] = [];
  const stacks: string[] = [];
  for (const [key, value] of Object.entries(entry)) {
    if (UNSAID.has(key) || value === undefined) continue;
    if (value !== null && typeof value === 'object' && typeof (value as { stack?: unknown }).stack === 'string') {
      const { stack, ...rest } = value as { stack: string };
      stacks.push(stack);
      fields.push(`${paint('2', `${key}=`)}${fieldValue((rest as { message?: unknown }).message ?? rest)}`);
      continue;
    }
    fields.push(`${paint('2', `${key}=`)}${fieldValue(value)}`);
  }
  const head = [paint('2', time), paint(level.color, level.name.padEnd(5)), visible(String(entry.msg ?? ''))].filter(Boolean).join(' ');
  const text = fields.length > 0 ? `${head}  ${fields.join(' ')}` : head;
  return [text, ...stacks.map((s) => paint('2', s.split('\n').map((l) => `    ${visible(l)}`).join('\n')))].join('\n');
}

/**
 * Control, formatting and unassigned characters as `\uXXXX`: a value a client sent (a usage id full
 * of escape sequences, bidirectional controls) must not repaint the terminal or reorder what it shows.
 */
const UNSEEN = /[\p{C}\u2028\u2029]/gu;
const visible = (text: string): string =>
  text.replace(UNSEEN, (c) => Array.from({ length: c.length }, (_, i) => `\\u${c.charCodeAt(i).toString(16).padStart(4, '0')}`).join(''));

function fieldValue(value: unknown): string {
  if (typeof value === 'string' && /^[^\s"=\p{C}]+$/u.test(value)) return value;
  return visible(typeof value === 'string' || (typeof value === 'object' && value !== null) ? JSON.stringify(value) : String(value));
}
