import { ConfigError } from '../config.js';
import { scrub } from '../log.js';

/**
 * Runs an entry point: a configuration problem prints its list and exits 2, any other failure
 * prints one scrubbed line and exits 1.
 */
export async function runMain(fn: () => Promise<void>): Promise<void> {
  try {
    await fn();
  } catch (err) {
    if (err instanceof ConfigError) {
      console.error(err.message);
      process.exit(2);
    }
    console.error(`billing-outbox: ${scrub(err instanceof Error ? err.message : String(err))}`);
    process.exit(1);
  }
}

/** Resolves on the first SIGTERM or SIGINT. */
export function untilSignal(): Promise<NodeJS.Signals> {
  return new Promise((resolve) => {
    const on = (sig: NodeJS.Signals) => {
      process.off('SIGTERM', on);
      process.off('SIGINT', on);
      resolve(sig);
    };
    process.on('SIGTERM', on);
    process.on('SIGINT', on);
  });
}
