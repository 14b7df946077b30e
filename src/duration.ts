/** Durations and instants for people and reports: in CLI tables, operator messages, refusals and --json output. */

/** A duration the way an operator reads it: "45s", "12m30s", "3h05m", "2d04h". */
export function formatDuration(ms: number): string {
  const s = Math.max(0, Math.floor(ms / 1000));
  if (s < 60) return `${s}s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m}m${String(s % 60).padStart(2, '0')}s`;
  const h = Math.floor(m / 60);
  if (h < 48) return `${h}h${String(m % 60).padStart(2, '0')}m`;
  return `${Math.floor(h / 24)}d${String(h % 24).padStart(2, '0')}h`;
}

/** An instant as ISO 8601 text, or null. */
export function iso(date: Date | null | undefined): string | null {
  return date ? date.toISOString() : null;
}

/** Whole seconds from `date` to `now`, or null. */
export function ageSeconds(date: Date | null | undefined, now: number): number | null {
  return date ? Math.max(0, Math.floor((now - date.getTime()) / 1000)) : null;
}
