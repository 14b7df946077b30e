import { mkdir, mkdtemp, rm, writeFile } from 'node:fs/promises';
import os from 'node:os';
import path from 'node:path';
import { expect, it } from 'vitest';
import { onPath } from '../../src/embedded/temporal.js';

it('finds a temporal CLI on PATH (the first folder with one to run), and says none when no folder has', async () => {
  const dirs = await Promise.all([1, 2, 3].map(() => mkdtemp(path.join(os.tmpdir(), 'on-path-'))));
  try {
    // A folder by that name, and a file that cannot be run, are passed over.
    await mkdir(path.join(dirs[0]!, 'temporal'));
    await writeFile(path.join(dirs[1]!, 'temporal'), '', { mode: 0o644 });
    await writeFile(path.join(dirs[2]!, 'temporal'), '', { mode: 0o755 });
    expect(onPath('temporal', ['', dirs[0], dirs[1], dirs[2]].join(path.delimiter))).toBe(path.join(dirs[2]!, 'temporal'));
    expect(onPath('temporal', dirs[0])).toBeUndefined();
    expect(onPath('temporal', undefined)).toBeUndefined();
  } finally {
    await Promise.all(dirs.map((d) => rm(d, { recursive: true, force: true })));
  }
});
