/**
 * Structured JSON logs. Secrets never reach them: known secret fields are redacted by path, and
 * every string is scrubbed of Stripe keys and URL passwords before it is written.
 */
import pino from 'pino';

const REDACT_PATHS = [
  'apiKey', '*.apiKey', 'STRIPE_API_KEY', '*.STRIPE_API_KEY', 'password', '*.password', 'token', '*.token',
  'authorization', '*.authorization', 'headers.authorization', 'req.headers.authorization', 'secret', '*.secret',
];

const STRIPE_KEY = /\b(sk|rk|pk|whsec)_(test|live)?_?[A-Za-z0-9]{6,}/g;
const URL_PASSWORD = /(\b[a-z][a-z0-9+.-]*:\/\/[^:@/\s]+:)[^@/\s]+@/gi;

/** Removes anything that looks like a Stripe key or a password inside a URL. */
export function scrub(text: string): string {
  return text.replace(STRIPE_KEY, '$1_***').replace(URL_PASSWORD, '$1***@');
}

export type Logger = pino.Logger;

/**
 * Scrubs each finished line on its way out, after pino's serializers and redaction have run, so
 * every field of every line is covered (a serializer's output included).
 */
class ScrubbingStream implements pino.DestinationStream {
  constructor(private readonly inner: pino.DestinationStream) {}
  write(line: string): void {
    this.inner.write(scrub(line));
  }
}

export function createLogger(level: string, destination?: pino.DestinationStream): Logger {
  return pino(
    {
      level,
      base: { service: 'billing-outbox' },
      redact: { paths: REDACT_PATHS, censor: '***' },
    },
    new ScrubbingStream(destination ?? pino.destination({ fd: 1, sync: true })),
  );
}
