/**
 * Every `billing-outbox <command> --option` written in the README and docs/ names a command and
 * options that command's help lists: an operator copying a runbook line gets what it says, not
 * "Unknown option" in the middle of an incident.
 */
import { readdirSync, readFileSync } from 'node:fs';
import path from 'node:path';
import { expect, it } from 'vitest';
import { loadConfig } from '../../src/config.js';
import { runCli } from '../../src/cli/run.js';

const ROOT = path.join(import.meta.dirname, '..', '..');
const DOCS = ['README.md', ...readdirSync(path.join(ROOT, 'docs')).filter((f) => f.endsWith('.md')).map((f) => `docs/${f}`)];

/** Each command line in inline code or a code block: its file, command and options. */
function commandLines(): { file: string; line: string; command: string; options: string[] }[] {
  const found = [];
  for (const file of DOCS) {
    const text = readFileSync(path.join(ROOT, file), 'utf8');
    // Inline code spans, and the lines of fenced blocks.
    const spans = [...text.matchAll(/```[a-z]*\n([\s\S]*?)```/g)].flatMap((m) => m[1]!.split('\n').map((l) => l.replace(/(^| )#.*$/, '')));
    spans.push(...[...text.replace(/```[a-z]*\n[\s\S]*?```/g, '').matchAll(/`([^`\n]+)`/g)].map((m) => m[1]!));
    for (const span of spans) {
      // Not a package being installed (`npm install billing-outbox pg`).
      for (const m of span.matchAll(/(?<!install )\bbilling-outbox ([a-z][a-z-]*)((?: +[^ |;&]+)*)/g)) {
        found.push({ file, line: m[0], command: m[1]!, options: [...m[2]!.matchAll(/(?<![\w-])--[a-z][a-z-]*/g)].map((o) => o[0]) });
      }
    }
  }
  return found;
}

async function helpOf(command: string): Promise<string | undefined> {
  let out = '';
  let err = '';
  const code = await runCli(['help', command], {
    config: loadConfig({}),
    db: () => Promise.reject(new Error('no database in this test')),
    temporal: () => Promise.reject(new Error('no Temporal in this test')),
    out: { write: (s: string) => (out += s) },
    err: { write: (s: string) => (err += s) },
  });
  return code === 0 ? out : undefined;
}

it('every billing-outbox command line in the docs names a command and options its help lists', async () => {
  const lines = commandLines();
  expect(lines.length).toBeGreaterThan(20);
  const wrong: string[] = [];
  for (const { file, line, command, options } of lines) {
    const help = await helpOf(command);
    if (help === undefined) {
      // Prose and package lists (`billing-outbox pg`) name no command; a line with options does.
      if (options.length > 0) wrong.push(`${file}: ${line}: no command ${command}`);
      continue;
    }
    for (const option of options) {
      if (option !== '--help' && !new RegExp(`(?<![\\w-])${option}(?![\\w-])`).test(help)) wrong.push(`${file}: ${line}: ${command} has no ${option}`);
    }
  }
  expect(wrong).toEqual([]);
});
