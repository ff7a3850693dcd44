// Kontext Trainer: the pure numbers behind the loss chart (no DOM, no ComfyUI), written with
// loops so a run of 1,000,000 steps neither overflows the call stack (`Math.min(...losses)`
// does) nor draws a million line segments.

export const SMOOTHING_BETA = 0.9; // the same as ProgressTracker in trainer_core/job.py

// The smoothed loss exactly as Python sends it (`smoothed_loss`):
// 1) ema_k = beta * ema_{k-1} + (1 - beta) * x_k, with ema_0 = 0
// 2) bias correction: ema_k / (1 - beta ** k), so early steps are not pulled towards 0
export function smoothLosses(losses, beta = SMOOTHING_BETA) {
  const smoothed = new Float64Array(losses.length);
  let ema = 0;
  let decay = 1; // beta ** k, kept as a running product
  for (let k = 0; k < losses.length; k++) {
    ema = beta * ema + (1 - beta) * losses[k];
    decay *= beta;
    smoothed[k] = ema / (1 - decay);
  }
  return smoothed;
}

// The lowest and highest finite value (null when there is none), of the values and of the
// losses of [step, loss] points (the validation curve shares the training loss's axis).
export function valueRange(values, points = []) {
  let low = Infinity;
  let high = -Infinity;
  for (let i = 0; i < values.length; i++) {
    const v = values[i];
    if (v < low) low = v;
    if (v > high) high = v;
  }
  for (const [, v] of points) {
    if (v < low) low = v;
    if (v > high) high = v;
  }
  return low <= high ? { low, high } : null;
}

// The validation points the chart can place: steps 1..steps (the steps whose losses it has),
// in step order.
export function validationShown(points, steps) {
  return points.filter(([step]) => step >= 1 && step <= steps).sort((a, b) => a[0] - b[0]);
}

// What one chart column shows when many steps share it: the raw losses' min / max envelope
// and the smoothed loss at the column's last step. With fewer steps than columns every step
// gets its own entry. `at` is the position along the x axis, 0 (first step) to 1 (last).
export function chartEnvelope(losses, smoothed, columns) {
  const n = losses.length;
  const count = Math.min(n, Math.max(1, Math.floor(columns)));
  const at = new Float64Array(count);
  const low = new Float64Array(count);
  const high = new Float64Array(count);
  const smooth = new Float64Array(count);
  for (let c = 0; c < count; c++) {
    const start = Math.floor((c * n) / count);
    const end = Math.floor(((c + 1) * n) / count); // exclusive; never empty since count <= n
    let lo = Infinity;
    let hi = -Infinity;
    for (let i = start; i < end; i++) {
      const v = losses[i];
      if (v < lo) lo = v;
      if (v > hi) hi = v;
    }
    at[c] = n > 1 ? (end - 1) / (n - 1) : 0;
    low[c] = lo;
    high[c] = hi;
    smooth[c] = smoothed[end - 1];
  }
  return { count, at, low, high, smooth };
}
