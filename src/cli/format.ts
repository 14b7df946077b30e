/**
 * Plain-text output for people: aligned tables, short durations, and a progress bar. Scripts read
 * the `--json` output instead, so nothing here is a stable format.
 */
import type { Output } from './context.js';

export type Align = 'left' | 'right';

export interface Column {
  header: string;
  align?: Align;
  /** Longer cells are cut to this many characters, ending in "…". */
  max?: number;
}

/** One line per value: control characters (a newline inside an error message) would break the columns. */
function cell(value: string, max: number | undefined): string {
  const flat = value.replace(/[\p{Cc}\s]+/gu, ' ').trim();
  return max !== undefined && flat.length > max ? `${flat.slice(0, max - 1)}…` : flat;
}

/** Columns separated by two spaces, each as wide as its widest cell; no trailing spaces. */
export function formatTable(columns: Column[], rows: string[][]): string {
  const cells = rows.map((row) => columns.map((c, i) => cell(row[i] ?? '', c.max)));
  // A loop, not Math.max(...cells): spread as arguments, 120,000 rows (`customers list` of a large
  // platform) pass V8's limit on a call's arguments and throw RangeError.
  const widths = columns.map((c, i) => cells.reduce((w, r) => Math.max(w, r[i]!.length), c.header.length));
  const line = (values: string[]) =>
    values
      .map((v, i) => (columns[i]!.align === 'right' ? v.padStart(widths[i]!) : v.padEnd(widths[i]!)))
      .join('  ')
      .trimEnd();
  return [line(columns.map((c) => c.header)), ...cells.map(line)].join('\n') + '\n';
}

export { ageSeconds, formatDuration, iso } from '../duration.js';

/**
 * A one-line progress bar redrawn in place with "\r". Only meant for a terminal: callers create it
 * when the stream is a TTY. Redraws at most every `everyMs` so a fast loop does not flood the tty.
 */
export class ProgressBar {
  private lastDraw = 0;
  private line = '';

  private readonly out: Output;
  private readonly total: number;
  private readonly width: number;
  private readonly everyMs: number;
  constructor(
    out: Output,
    total: number,
    width = 28,
    everyMs = 100,
  ) {
    this.out = out;
    this.total = total;
    this.width = width;
    this.everyMs = everyMs;
  }

  update(done: number, label: string, force = false): void {
    const now = Date.now();
    if (!force && now - this.lastDraw < this.everyMs) return;
    this.lastDraw = now;
    const ratio = this.total > 0 ? Math.min(1, done / this.total) : 1;
    const filled = Math.round(ratio * this.width);
    this.line = `[${'#'.repeat(filled)}${'-'.repeat(this.width - filled)}] ${done}/${this.total} ${Math.floor(ratio * 100)}% ${label}`;
    this.out.write(`\r${this.line}\x1b[K`);
  }

  /** Writes a whole line above the bar (a failure report), then redraws the bar under it. */
  printAbove(text: string): void {
    this.out.write(`\r\x1b[K${text}\n${this.line}`);
  }

  finish(done: number, label: string): void {
    this.update(done, label, true);
    this.out.write('\n');
  }
}
