/** The console a person reads: a JSON log line made readable, nothing hidden, secrets still scrubbed. */
import { describe, expect, it } from 'vitest';
import { redactUrl } from '../../src/db.js';
import { createLogger, formatForHumans } from '../../src/log.js';

const time = Date.UTC(2026, 11, 3, 9, 30, 5, 123);

describe('formatForHumans', () => {
  it('says time, level and message, then every other field as key=value', () => {
    const line = JSON.stringify({ level: 40, time, pid: 1, hostname: 'h', service: 'billing-outbox', msg: 'port taken', port: 8233, holder: 'temporal (pid 7)', ok: true });
    expect(formatForHumans(line, false)).toBe('09:30:05.123 WARN  port taken  port=8233 holder="temporal (pid 7)" ok=true');
  });

  it("puts an error's message among the fields and its stack below", () => {
    const line = JSON.stringify({ level: 50, time, msg: 'failed', err: { type: 'Error', message: 'boom', stack: 'Error: boom\n    at x' } });
    expect(formatForHumans(line, false).split('\n')).toEqual(['09:30:05.123 ERROR failed  err=boom', '    Error: boom', '        at x']);
  });

  it('colours only when asked, and passes a line that is not JSON through', () => {
    const line = JSON.stringify({ level: 30, time, msg: 'ready' });
    expect(formatForHumans(line, false)).toBe('09:30:05.123 INFO  ready');
    expect(formatForHumans(line, true)).toContain('\x1b[32mINFO \x1b[0m');
    expect(formatForHumans('not json\n', false)).toBe('not json');
  });

  it("shows a client's control and formatting characters as escapes, never raw (they would repaint the terminal)", () => {
    const hostile = 'x\u001b[2J\u001b]0;pwned\u0007\u009b\u202e';
    const line = JSON.stringify({ level: 30, time, msg: `request completed for ${hostile}`, idempotencyKey: `u:acme:${hostile}`, err: { message: hostile, stack: `Error: ${hostile}\n    at x` } });
    const text = formatForHumans(line, false);
    // Nothing unseen but the newlines between the line and its stack.
    expect(text.replaceAll('\n', '')).not.toMatch(/[\p{Cc}\p{Cf}]/u);
    expect(text.split('\n')[0]).toBe(
      '09:30:05.123 INFO  request completed for x\\u001b[2J\\u001b]0;pwned\\u0007\\u009b\\u202e  idempotencyKey="u:acme:x\\u001b[2J\\u001b]0;pwned\\u0007\\u009b\\u202e" err="x\\u001b[2J\\u001b]0;pwned\\u0007\\u009b\\u202e"',
    );
    expect(formatForHumans(`raw \u001b[2J`, false)).toBe('raw \\u001b[2J');
  });

  it('reads what createLogger wrote, scrubbed', () => {
    const lines: string[] = [];
    const log = createLogger('info', { write: (l: string) => void lines.push(l) });
    log.info({ url: 'postgres://u:hunter2@db/x', nested: { a: 1 } }, 'connected');
    const text = formatForHumans(lines[0]!, false);
    expect(text).toMatch(/^\d\d:\d\d:\d\d\.\d{3} INFO {2}connected {2}url=postgres:\/\/u:\*\*\*@db\/x nested=\{"a":1\}$/);
  });

  it('scrubs a password given in the URL\'s query (node-postgres reads password= and sslpassword= there)', () => {
    const lines: string[] = [];
    const log = createLogger('info', { write: (l: string) => void lines.push(l) });
    log.info({ database: 'postgres://u@db/x?sslmode=require&password=S3cret&sslpassword=K3y' }, 'billing-outbox worker running on postgres://u@db/x?password=S3cret');
    expect(lines[0]).not.toMatch(/S3cret|K3y/);
    expect(lines[0]).toContain('postgres://u@db/x?sslmode=require&password=***&sslpassword=***');
  });
});

describe('redactUrl', () => {
  it('replaces the password in the user part and in the query, and nothing else', () => {
    expect(redactUrl('postgres://u:hunter2@db:5432/x')).toBe('postgres://u:***@db:5432/x');
    expect(redactUrl('postgres://u@db/x?sslmode=require&password=S3cret&sslpassword=K3y')).toBe('postgres://u@db/x?sslmode=require&password=***&sslpassword=***');
    expect(redactUrl('postgres://u@db/x?application_name=a')).toBe('postgres://u@db/x?application_name=a');
  });
});
