/**
 * An error and the errors it wraps (`cause`), outermost first: the SDKs wrap what the server or
 * the socket said once or twice, and what decides is often inside.
 */
export function* causes(err: unknown): Generator<object> {
  for (let e: unknown = err, depth = 0; e && typeof e === 'object' && depth < 5; e = (e as { cause?: unknown }).cause, depth++) yield e;
}
