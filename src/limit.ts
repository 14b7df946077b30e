/**
 * Runs `fn` over `items` with at most `limit` calls in flight. The first failure is thrown once the
 * calls under way end; no item is started after it.
 */
export async function forEachLimit<T>(items: readonly T[], limit: number, fn: (item: T) => Promise<void>): Promise<void> {
  let next = 0;
  let failed = false;
  const lane = async () => {
    while (!failed && next < items.length) {
      try {
        await fn(items[next++]!);
      } catch (err) {
        failed = true;
        throw err;
      }
    }
  };
  const lanes = await Promise.allSettled(Array.from({ length: Math.min(limit, items.length) }, lane));
  const first = lanes.find((l): l is PromiseRejectedResult => l.status === 'rejected');
  if (first) throw first.reason;
}
