/**
 * How every process reaches Temporal: the address and namespace, and TLS (a custom CA, a client
 * certificate for mTLS, a server name) or an API key (Temporal Cloud), from TemporalConfig. The
 * worker, the API's health probe and the CLI all connect through here.
 */
import { readFileSync } from 'node:fs';
import { Client, Connection, type TLSConfig } from '@temporalio/client';
import { NativeConnection } from '@temporalio/worker';
import type { TemporalConfig } from '../config.js';
import { workflowClientTracing } from '../tracing.js';

export const DEFAULT_TEMPORAL_ADDRESS = 'localhost:7233';

/** A connection that could not be made, said with what to check. */
export class TemporalConnectionError extends Error {
  override name = 'TemporalConnectionError';
}

/** Options shared by the client's and the worker's connections. */
export function connectionOptions(temporal: TemporalConfig): { address: string; tls?: TLSConfig; apiKey?: string } {
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
    ...(temporal.apiKey ? { apiKey: temporal.apiKey } : {}),
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
export async function connectClient(temporal: TemporalConfig): Promise<Connection> {
  try {
    return await Connection.connect(connectionOptions(temporal));
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

/** One gRPC connection for the client (starting workflows) and one native one for the worker. */
export async function connectTemporal(
  temporal: TemporalConfig,
  opts: { tracing?: boolean } = {},
): Promise<{ connection: NativeConnection; client: Client; clientConnection: Connection }> {
  let connection: NativeConnection;
  try {
    connection = await NativeConnection.connect(connectionOptions(temporal));
  } catch (err) {
    throw explain(temporal, err);
  }
  const clientConnection = await connectClient(temporal).catch(async (err: unknown) => {
    await connection.close();
    throw err;
  });
  // Tracing on: what this client starts or signals (an operator's retry, a reopen) carries the
  // caller's trace into the workflow, as the relay's starts do.
  const interceptors = opts.tracing ? { workflow: await workflowClientTracing() } : undefined;
  const client = new Client({ connection: clientConnection, namespace: temporal.namespace, ...(interceptors ? { interceptors } : {}) });
  return { connection, client, clientConnection };
}
