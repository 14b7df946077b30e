import { ConfigError } from '../config.js';
import { scrub } from '../log.js';

/**
 * Runs an entry point: a configuration problem prints its list and exits 2, any other failure
 * prints one scrubbed line and exits 1.
 */
export async function runMain(fn: () => Promise<void>): Promise<void> {
  const code = await exitCodeOf(fn);
  if (code !== 0) process.exit(code);
}

/** The same, as an exit code (0, 1 or 2) for a caller that exits itself (src/bin/cli.ts). */
export async function exitCodeOf(fn: () => Promise<void>): Promise<number> {
  try {
    await fn();
    return 0;
  } catch (err) {
    if (err instanceof ConfigError) {
      console.error(err.message);
      return 2;
    }
    console.error(`billing-outbox: ${scrub(err instanceof Error ? err.message : String(err))}`);
    return 1;
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
