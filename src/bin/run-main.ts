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

/**
 * Resolves on the first SIGTERM or SIGINT. Later ones are noted and ignored while the shutdown
 * runs: Ctrl-C reaches the process twice (from the terminal's process group and relayed by tsx or
 * npm), and a process with no handler left would die at the second one, halfway through stopping.
 */
export function untilSignal(): Promise<NodeJS.Signals> {
  return new Promise((resolve) => {
    let first: NodeJS.Signals | undefined;
    let firstAt = 0;
    const on = (sig: NodeJS.Signals) => {
      if (first) {
        if (Date.now() - firstAt > 1_000) console.error(`billing-outbox: ${sig} again, still stopping (pid ${process.pid}); SIGKILL ends it at once`);
        return;
      }
      first = sig;
      firstAt = Date.now();
      resolve(sig);
    };
    process.on('SIGTERM', on);
    process.on('SIGINT', on);
  });
}
