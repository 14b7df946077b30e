/** The bare shapes' activity: does nothing, so the figure is Temporal's and the worker's alone. */
export const shapeActivities = {
  async work(): Promise<void> {},
};
export type ShapeActivities = typeof shapeActivities;
