/**
 * The worker, the HTTP API and the `billing-outbox` command need packages that billing-outbox lists
 * as optional peer dependencies (the Temporal SDK, stripe, fastify, pino, prom-client, zod), so that
 * an application that only records usage does not install them; billing-outbox-worker brings them.
 * Without them, loading one of those parts fails in Node's module resolution, naming a package the
 * application never asked for. These say what to install instead.
 */
import { createRequire } from 'node:module';

/** The package whose absence made an import fail (Node's ERR_MODULE_NOT_FOUND for a bare name), or undefined. */
export function missingPackage(err: unknown): string | undefined {
  const e = err as { code?: unknown; message?: unknown } | null;
  if (e?.code !== 'ERR_MODULE_NOT_FOUND' || typeof e.message !== 'string') return undefined;
  return /Cannot find package '([^']+)'/.exec(e.message)?.[1];
}

/** Whether billing-outbox-worker is installed where billing-outbox finds its packages. */
function workerPackageInstalled(): boolean {
  try {
    createRequire(import.meta.url).resolve('billing-outbox-worker/package.json');
    return true;
  } catch {
    return false;
  }
}

/** What to do about `packageName` missing; `workerInstalled`: billing-outbox-worker is there, its peers left out. */
export function missingPeerMessage(part: string, packageName: string, workerInstalled: boolean): string {
  if (!workerInstalled) {
    return (
      `${part} needs the package ${packageName}, which is not installed: npm install billing-outbox-worker ` +
      "(it brings the dependencies of billing-outbox's worker, HTTP API and command)"
    );
  }
  return (
    `${part} needs the package ${packageName}, which is not installed although billing-outbox-worker is: its peer dependencies ` +
    "were left out (npm's --legacy-peer-deps or legacy-peer-deps=true in .npmrc, or a package manager that does not install peers). " +
    `Install billing-outbox-worker without that option; if npm then refuses (ERESOLVE), the application has another major of the package it names, ` +
    `and the worker runs from a folder of its own (README, "Install it in your application"); otherwise npm install ${packageName} and the other peers billing-outbox-worker lists`
  );
}

export class MissingPeerError extends Error {
  /** The package that is not installed. */
  readonly packageName: string;
  constructor(part: string, packageName: string, cause: unknown) {
    super(missingPeerMessage(part, packageName, workerPackageInstalled()), { cause });
    this.name = 'MissingPeerError';
    this.packageName = packageName;
  }
}

/** `load()`, with a missing optional peer dependency turned into a MissingPeerError naming `part`. */
export async function loadPart<T>(part: string, load: () => Promise<T>): Promise<T> {
  try {
    return await load();
  } catch (err) {
    const name = missingPackage(err);
    throw name === undefined ? err : new MissingPeerError(part, name, err);
  }
}

/** loadPart for `require()`: the CommonJS entries of `billing-outbox/worker` and `/fastify`. */
export function loadPartSync<T>(part: string, load: () => T): T {
  try {
    return load();
  } catch (err) {
    const name = missingPackage(err);
    throw name === undefined ? err : new MissingPeerError(part, name, err);
  }
}
