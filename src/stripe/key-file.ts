/**
 * A Stripe secret key given as a file (STRIPE_API_KEY_FILE), read again while the process runs, so
 * a rolled key reaches running workers and APIs without a restart. Kubernetes rewrites a mounted
 * secret's file in place when the secret changes; Stripe's "roll key" can expire the old key at
 * once. Without this, every worker would keep sending the old key (each event held, with the
 * credentials alarm) until someone restarted it.
 *
 * The file is read again at most once per `KEY_FILE_RECHECK_MS`, on the first call after that: a
 * rolled key is in use within that long of its file changing. A file that cannot be read, is empty,
 * holds no key or a key of the other mode (live, test) keeps the key in use (a secret being
 * rewritten must not stop delivery), and says so once. The key itself is never logged.
 */
import { readFileSync } from 'node:fs';
import { SECRET_KEY_PATTERN } from './rules.js';

/** How often, at most, the key file is read again. */
export const KEY_FILE_RECHECK_MS = 10_000;

/** What a key file's reader reports: a new key is in use, or the file could not give one. */
export type KeyFileNews = { kind: 'changed' } | { kind: 'unreadable'; reason: string };

/** The key to send now: `firstKey` (what the configuration read) until the file holds another. */
export function keyFromFile(
  path: string,
  firstKey: string,
  opts: { recheckMs?: number; now?: () => number; onNews?: (news: KeyFileNews) => void } = {},
): () => string {
  const recheckMs = opts.recheckMs ?? KEY_FILE_RECHECK_MS;
  const now = opts.now ?? Date.now;
  let key = firstKey;
  let checkedAt = now();
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
    if (!SECRET_KEY_PATTERN.test(read)) return keep('does not hold a Stripe secret or restricted key (sk_test_…, sk_live_…, rk_…)');
    // A roll keeps the mode. A live key where a test key was (or the reverse) would change what the
    // configuration checked at start (where a live key may be sent, the default pace): a restart's job.
    if (isLive(read) !== isLive(firstKey)) return keep(`holds a ${isLive(read) ? 'live' : 'test'} key where this process started with a ${isLive(firstKey) ? 'live' : 'test'} one: restart to change modes`);
    reported = undefined;
    if (read !== key) {
      key = read;
      opts.onNews?.({ kind: 'changed' });
    }
    return key;
  };
}

const isLive = (key: string) => key.includes('_live_');
