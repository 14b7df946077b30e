/**
 * How every process reaches Temporal: the address and namespace, and TLS (a custom CA, a client
 * certificate for mTLS, a server name) or an API key (Temporal Cloud), from TemporalConfig. The
 * worker, the API's health probe and the CLI all connect through here.
 */
import { createHash } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { createSecureContext } from 'node:tls';
import { Client, Connection, type TLSConfig } from '@temporalio/client';
import { NativeConnection } from '@temporalio/worker';
import type { TemporalConfig } from '../config.js';
import { KEY_FILE_RECHECK_MS, keyFromFile, newsOn, type KeyLog } from '../key-file.js';
import { workflowClientTracing } from '../tracing.js';

export const DEFAULT_TEMPORAL_ADDRESS = 'localhost:7233';

/** A connection that could not be made, said with what to check. */
export class TemporalConnectionError extends Error {
  override name = 'TemporalConnectionError';
}

/**
 * The API key (Temporal Cloud), asked for on each call: TEMPORAL_API_KEY as configured, or, when it
 * came from TEMPORAL_API_KEY_FILE, read again from the file while running (../key-file.ts), so a
 * rotated key reaches running workers without a restart. Each connection made reads the file
 * first: a reconnection (renewed TLS files, Temporal away) long after the start must not offer the
 * key the configuration read then, rolled and revoked since.
 */
export function temporalApiKey(temporal: TemporalConfig, log?: KeyLog): (() => string) | undefined {
  const first = temporal.apiKey;
  if (!first) return undefined;
  if (temporal.apiKeyFile === undefined) return () => first;
  const file = temporal.apiKeyFile;
  return keyFromFile(file, first, {
    readFirst: true,
    onNews: newsOn(log, file, { what: 'Temporal API key', noun: 'key', variable: 'TEMPORAL_API_KEY_FILE' }),
  });
}

/** Options shared by the client's and the worker's connections. */
function connectionOptions(temporal: TemporalConfig, apiKey = temporalApiKey(temporal)): { address: string; tls?: TLSConfig; apiKey?: () => string } {
  const address = temporal.address ?? DEFAULT_TEMPORAL_ADDRESS;
  const tls = temporal.tls;
  return {
    address,
    ...(tls
      ? {
          tls: {
            ...(tls.serverName ? { serverNameOverride: tls.serverName } : {}),
            ...(tls.caFile ? { serverRootCACertificate: readFileSync(tls.caFile) } : {}),
            ...(tls.certFile && tls.keyFile ? { clientCertPair: { crt: readFileSync(tls.certFile), key: readFileSync(tls.keyFile) } } : {}),
          },
        }
      : {}),
    ...(apiKey ? { apiKey } : {}),
  };
}

/** What went wrong, for a person: the cause, and the settings that decide it. */
function explain(temporal: TemporalConfig, err: unknown): TemporalConnectionError {
  const address = temporal.address ?? DEFAULT_TEMPORAL_ADDRESS;
  const cause = err instanceof Error ? err.message : String(err);
  const how = temporal.tls
    ? `over TLS (${[
        temporal.tls.caFile ? `CA ${temporal.tls.caFile}` : "the system's CAs",
        temporal.tls.certFile ? `client certificate ${temporal.tls.certFile}` : 'no client certificate',
        ...(temporal.tls.serverName ? [`server name ${temporal.tls.serverName}`] : []),
        ...(temporal.apiKey ? ['an API key'] : []),
      ].join(', ')})`
    : 'without TLS';
  const hint = temporal.tls
    ? 'check TEMPORAL_TLS_CA_FILE (the CA that signed the server certificate), TEMPORAL_TLS_CERT_FILE and TEMPORAL_TLS_KEY_FILE (if the server requires a client certificate), TEMPORAL_TLS_SERVER_NAME and TEMPORAL_API_KEY'
    : 'if the server speaks TLS, set TEMPORAL_TLS=true (and the TEMPORAL_TLS_* files it needs)';
  return new TemporalConnectionError(`cannot connect to Temporal at ${address} ${how}: ${cause}; ${hint}`, { cause: err });
}

/** A client connection, checked: the server answered a first call. */
export async function connectClient(temporal: TemporalConfig, apiKey = temporalApiKey(temporal)): Promise<Connection> {
  try {
    return await Connection.connect(connectionOptions(temporal, apiKey));
  } catch (err) {
    throw explain(temporal, err);
  }
}

/**
 * For health probes: lazy (the API starts while Temporal is away) and without the retry
 * interceptor. Its reconnect backoff stays short: gRPC's grows to two minutes while the server is
 * away, and a probe meanwhile fails at once, so /health would say Temporal is away for up to two
 * minutes after it came back.
 */
export function lazyHealthConnection(temporal: TemporalConfig): Connection {
  return Connection.lazy({
    ...connectionOptions(temporal),
    interceptors: [],
    channelArgs: { 'grpc.initial_reconnect_backoff_ms': 500, 'grpc.max_reconnect_backoff_ms': 2_000 },
  });
}

/** The connections of a worker process, and how to close them. */
export interface TemporalConnections {
  /** The worker's. */
  connection: NativeConnection;
  /** The client's (starting workflows), and the client on it. */
  clientConnection: Connection;
  client: Client;
  /** What the TLS files held when they were made (read just before them), for onTlsFilesChanged. */
  tlsFiles: string | undefined;
  /** Closes both (and stops reading the key file). */
  close(): Promise<void>;
}

/**
 * One gRPC connection for the client (starting workflows) and one native one for the worker. With
 * TEMPORAL_API_KEY_FILE both send the key the file holds now: the client's asks on every call, the
 * native one, which takes no function, is told each new key (`setApiKey`): the file is read again
 * every KEY_FILE_RECHECK_MS whether or not the client calls, so an idle worker's polls carry it too.
 */
export async function connectTemporal(temporal: TemporalConfig, opts: { tracing?: boolean; log?: KeyLog } = {}): Promise<TemporalConnections> {
  const apiKey = temporalApiKey(temporal, opts.log);
  const tlsFiles = temporal.tls ? tlsFilesNow(temporal.tls) : undefined;
  const { apiKey: _asked, ...options } = connectionOptions(temporal, apiKey);
  let connection: NativeConnection;
  try {
    connection = await NativeConnection.connect({ ...options, ...(apiKey ? { apiKey: apiKey() } : {}) });
  } catch (err) {
    throw explain(temporal, err);
  }
  const clientConnection = await connectClient(temporal, apiKey).catch(async (err: unknown) => {
    await connection.close();
    throw err;
  });
  const stopTelling = temporal.apiKeyFile !== undefined && apiKey ? tellNewKeys(connection, apiKey, opts.log) : () => undefined;
  // Tracing on: what this client starts or signals (an operator's retry, a reopen) carries the
  // caller's trace into the workflow, as the relay's starts do.
  const interceptors = opts.tracing ? { workflow: await workflowClientTracing() } : undefined;
  const client = new Client({ connection: clientConnection, namespace: temporal.namespace, ...(interceptors ? { interceptors } : {}) });
  let closing: Promise<unknown> | undefined;
  return {
    connection,
    clientConnection,
    client,
    tlsFiles,
    close: async () => {
      stopTelling();
      await (closing ??= Promise.all([connection.close(), clientConnection.close()]));
    },
  };
}

/**
 * Tells the native connection each new key the file gives, within a second of its being read (the
 * reader reads the file again every KEY_FILE_RECHECK_MS; asking in between costs nothing). A failed
 * telling is tried again a second later.
 */
function tellNewKeys(connection: NativeConnection, apiKey: () => string, log: KeyLog | undefined): () => void {
  let told = apiKey();
  const timer = setInterval(() => {
    const key = apiKey();
    if (key === told) return;
    told = key;
    connection.setApiKey(key).catch((err: unknown) => {
      told = '';
      log?.warn({ err: String(err) }, 'Temporal API key: the worker connection did not take the new key; trying again');
    });
  }, 1_000);
  timer.unref();
  return () => clearInterval(timer);
}

/**
 * What the TLS files (the CA, the client certificate and its key) hold now, as a digest; undefined
 * when one cannot be read or the certificate and key are not a pair (one rewritten, the other not
 * yet: cert-manager and Kubernetes write a secret's files one by one).
 */
export function tlsFilesNow(tls: NonNullable<TemporalConfig['tls']>): string | undefined {
  try {
    const digest = createHash('sha256');
    for (const file of [tls.caFile, tls.certFile, tls.keyFile]) digest.update(file ? readFileSync(file) : '').update('\0');
    // Throws when the key is not the certificate's.
    if (tls.certFile && tls.keyFile) createSecureContext({ cert: readFileSync(tls.certFile), key: readFileSync(tls.keyFile) });
    return digest.digest('hex');
  } catch {
    return undefined;
  }
}

/**
 * Calls `reconnect` when the TLS files hold something else than the connection was made with: a
 * renewed client certificate (mTLS certificates are short-lived: cert-manager, Temporal Cloud), a
 * new CA. A connection takes its TLS files only when it is made, so a worker must reconnect to use
 * them before the old certificate expires or is revoked. Checked every KEY_FILE_RECHECK_MS; a
 * reconnect that fails is tried again at the next check. `madeWith`: what the files held when the
 * connection was made (TemporalConnections.tlsFiles): files renewed between then and the start of
 * the watch (a worker's start takes seconds) are then news too. Returns a function that stops watching.
 */
export function onTlsFilesChanged(temporal: TemporalConfig, reconnect: () => Promise<void>, everyMs = KEY_FILE_RECHECK_MS, madeWith?: string): () => void {
  const tls = temporal.tls;
  if (!tls || !(tls.caFile || tls.certFile)) return () => undefined;
  let inUse = madeWith ?? tlsFilesNow(tls);
  let busy = false;
  const timer = setInterval(() => {
    if (busy) return;
    const now = tlsFilesNow(tls);
    if (now === undefined || now === inUse) return;
    busy = true;
    reconnect()
      .then(() => void (inUse = now), () => undefined)
      .finally(() => (busy = false));
  }, everyMs);
  timer.unref();
  return () => clearInterval(timer);
}
