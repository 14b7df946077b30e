/**
 * A secret key given as a file (STRIPE_API_KEY_FILE, STRIPE_WEBHOOK_SECRET_FILE,
 * TEMPORAL_API_KEY_FILE), read again while the process runs, so a rolled key reaches running workers and APIs without a restart. Kubernetes
 * rewrites a mounted secret's file in place when the secret changes; Stripe's "roll key" can expire
 * the old key at once, and a Temporal Cloud API key expires on its date. Without this, every worker
 * would keep sending the old key until someone restarted it.
 *
 * The file is read again at most once per `KEY_FILE_RECHECK_MS`, when the key is next asked for: a
 * rolled key is in use within that long of its file changing. A file that cannot be read, is empty
 * or holds a key its user refuses (`refuse`) keeps the key in use (a secret being rewritten must
 * not stop anything), and says so once. The key itself is never said.
 */
import { readFileSync } from 'node:fs';

/** How often, at most, a key file is read again. */
export const KEY_FILE_RECHECK_MS = 10_000;

/** What a key file's reader reports: a new key is in use, or the file could not give one. */
export type KeyFileNews = { kind: 'changed' } | { kind: 'unreadable'; reason: string };

/** Where the news of a key file is said (a pino logger is one). */
export interface KeyLog {
  info(fields: object, msg: string): void;
  warn(fields: object, msg: string): void;
}

export interface KeyFileOptions {
  /** Why a key read from the file is not to be used (undefined: use it). */
  refuse?: (key: string) => string | undefined;
  onNews?: (news: KeyFileNews) => void;
  recheckMs?: number;
  now?: () => number;
  /**
   * Read the file at the first ask, not only after `recheckMs`: for a reader made long after the
   * configuration read `firstKey` (a reconnection), whose key may since have been rolled and revoked.
   */
  readFirst?: boolean;
}

/**
 * News of a key file said on `log`: `<what>: a new <noun> read from <variable> is in use`, or why
 * the one in use stays. The key itself is never in it.
 */
export function newsOn(log: KeyLog | undefined, file: string, names: { what: string; noun: string; variable: string }): (news: KeyFileNews) => void {
  return (news) =>
    news.kind === 'changed'
      ? log?.info({ file }, `${names.what}: a new ${names.noun} read from ${names.variable} is in use`)
      : log?.warn({ file }, `${names.what}: ${names.variable} ${news.reason}; the ${names.noun} in use stays`);
}

/** The key to use now: `firstKey` (what the configuration read) until the file holds another. */
export function keyFromFile(path: string, firstKey: string, opts: KeyFileOptions = {}): () => string {
  const recheckMs = opts.recheckMs ?? KEY_FILE_RECHECK_MS;
  const now = opts.now ?? Date.now;
  let key = firstKey;
  let checkedAt = opts.readFirst ? Number.NEGATIVE_INFINITY : now();
  // The last problem reported, so a file that stays unreadable is reported once, not every recheck.
  let reported: string | undefined;
  const keep = (reason: string) => {
    if (reported !== reason) opts.onNews?.({ kind: 'unreadable', reason: (reported = reason) });
    return key;
  };
  return () => {
    if (now() - checkedAt < recheckMs) return key;
    checkedAt = now();
    let read: string;
    try {
      read = readFileSync(path, 'utf8').trim();
    } catch (err) {
      return keep(`cannot be read (${(err as NodeJS.ErrnoException).code ?? (err as Error).message})`);
    }
    if (read === '') return keep('is empty');
    const refused = opts.refuse?.(read);
    if (refused !== undefined) return keep(refused);
    reported = undefined;
    if (read !== key) {
      key = read;
      opts.onNews?.({ kind: 'changed' });
    }
    return key;
  };
}
