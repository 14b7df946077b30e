/** Certificates made by openssl for tests of TLS: a CA, and certificates it signs. */
import { execFileSync } from 'node:child_process';
import { readFileSync, writeFileSync } from 'node:fs';
import net, { type AddressInfo } from 'node:net';
import path from 'node:path';
import tls from 'node:tls';

export interface CertMaker {
  /** A file of the folder (`<name>.pem`, `<name>.key`). */
  file(name: string): string;
  /** A self-signed CA `<name>.pem` with its key. */
  ca(name: string): void;
  /** `<name>.pem` signed by `ca`, with `ext` (openssl extension lines: subjectAltName, extendedKeyUsage). */
  cert(name: string, ca: string, ext: string): void;
}

export const SERVER_EXT = 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n';

export function certMaker(dir: string): CertMaker {
  const file = (name: string) => path.join(dir, name);
  const openssl = (...args: string[]) => execFileSync('openssl', args, { cwd: dir, stdio: ['ignore', 'pipe', 'pipe'] });
  return {
    file,
    ca(name) {
      openssl('req', '-x509', '-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:P-256', '-nodes', '-days', '2', '-subj', `/CN=${name}`, '-keyout', file(`${name}.key`), '-out', file(`${name}.pem`));
    },
    cert(name, ca, ext) {
      openssl('req', '-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:P-256', '-nodes', '-subj', `/CN=${name}`, '-keyout', file(`${name}.key`), '-out', file(`${name}.csr`));
      writeFileSync(file(`${name}.ext`), ext);
      openssl('x509', '-req', '-in', file(`${name}.csr`), '-CA', file(`${ca}.pem`), '-CAkey', file(`${ca}.key`), '-CAcreateserial', '-days', '2', '-extfile', file(`${name}.ext`), '-out', file(`${name}.pem`));
    },
  };
}

export interface MtlsFrontend {
  address: string;
  close(): Promise<void>;
}

/**
 * Temporal behind mTLS: a TLS-terminating proxy to `upstream` (the dev server's plain gRPC) with a
 * certificate `server` signed by `server-ca`, requiring a client certificate signed by `client-ca`
 * (all three made here). `admit` sees each connection whose certificate the CA signed: false closes
 * it, anything else passes its bytes on.
 */
export async function startMtlsFrontend(certs: CertMaker, upstream: string, admit: (socket: tls.TLSSocket) => boolean = () => true): Promise<MtlsFrontend> {
  certs.ca('server-ca');
  certs.ca('client-ca');
  certs.cert('server', 'server-ca', SERVER_EXT);
  const [host, port] = upstream.split(':') as [string, string];
  const server = tls.createServer(
    {
      key: readFileSync(certs.file('server.key')),
      cert: readFileSync(certs.file('server.pem')),
      ca: readFileSync(certs.file('client-ca.pem')),
      requestCert: true,
      rejectUnauthorized: true,
      ALPNProtocols: ['h2'],
    },
    (socket) => {
      if (!admit(socket)) return void socket.destroy();
      const next = net.connect(Number(port), host);
      socket.pipe(next).pipe(socket);
      const end = () => (socket.destroy(), next.destroy());
      socket.on('error', end).on('close', end);
      next.on('error', end).on('close', end);
    },
  );
  server.on('tlsClientError', () => undefined);
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  return {
    address: `127.0.0.1:${(server.address() as AddressInfo).port}`,
    close: () => new Promise((resolve) => server.close(() => resolve())),
  };
}
