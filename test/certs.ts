/** Certificates made by openssl for tests of TLS: a CA, and certificates it signs. */
import { execFileSync } from 'node:child_process';
import { writeFileSync } from 'node:fs';
import path from 'node:path';

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
