// Kontext Trainer: draws a run's loss chart on a canvas: the raw losses as a band (the min /
// max of every pixel column, so a million steps cost one pass and a few hundred segments),
// the bias-corrected smoothed loss as a line, the held-out validation loss as its own line with
// a square at each point (same step and loss axes), and the range and step count as labels.
import { chartEnvelope, smoothLosses, validationShown, valueRange } from "./training_math.js";

const BACKGROUND = "#18181b";
const RAW = "#6e8cbe";
const SMOOTHED = "#ffaa3c";
export const VALIDATION = "#5ad778"; // rgb(90, 215, 120), as trainer_core/loss_chart.py
const MARKER = 2.5; // half the side of a validation point's square, in CSS pixels
const LABEL = "#9a9aa2";
const PAD = { left: 6, right: 6, top: 16, bottom: 14 }; // in CSS pixels, room for the labels
const RESOLUTION = 2; // canvas pixels per CSS pixel: sharp when the graph canvas is zoomed in
// The "no losses yet" line fills the empty chart: still about 10 screen pixels tall at the ~50 %
// zoom a whole training workflow opens at (the axis labels, 10 px, matter only once it draws).
const EMPTY_FONT = "22px sans-serif";

function formatLoss(value) {
  return Math.abs(value) >= 1e-3 && Math.abs(value) < 1e4 ? value.toPrecision(3) : value.toExponential(1);
}

// `validation`: [step, loss] pairs, steps 1-based like the losses' positions.
export function drawChart(canvas, losses, validation = []) {
  const width = canvas.clientWidth || 240; // 0 while the node is hidden: draw at a default size
  const height = canvas.clientHeight || 84;
  const scale = RESOLUTION;
  if (canvas.width !== width * scale) canvas.width = width * scale;
  if (canvas.height !== height * scale) canvas.height = height * scale;
  const ctx = canvas.getContext("2d");
  ctx.setTransform(scale, 0, 0, scale, 0, 0);
  ctx.fillStyle = BACKGROUND;
  ctx.fillRect(0, 0, width, height);
  ctx.font = "10px sans-serif";
  ctx.textBaseline = "alphabetic"; // the context keeps its state between draws
  ctx.fillStyle = LABEL;
  const heldOut = validationShown(validation, losses.length);
  const range = valueRange(losses, heldOut);
  if (losses.length < 2 || range === null) {
    ctx.font = EMPTY_FONT;
    ctx.textAlign = "center";
    ctx.textBaseline = "middle";
    ctx.fillText(losses.length ? "waiting for the second step" : "no losses yet", width / 2, height / 2);
    return;
  }
  const plotWidth = width - PAD.left - PAD.right;
  const plotHeight = height - PAD.top - PAD.bottom;
  const span = range.high - range.low || 1;
  const x = (at) => PAD.left + at * plotWidth;
  const y = (v) => PAD.top + (1 - (v - range.low) / span) * plotHeight;
  const columns = Math.max(1, Math.floor(plotWidth * scale));
  const e = chartEnvelope(losses, smoothLosses(losses), columns);

  if (e.count < losses.length) {
    // a band from the column maxima (left to right) back along the minima
    ctx.beginPath();
    for (let c = 0; c < e.count; c++) ctx.lineTo(x(e.at[c]), y(e.high[c]));
    for (let c = e.count - 1; c >= 0; c--) ctx.lineTo(x(e.at[c]), y(e.low[c]) + 1 / scale);
    ctx.closePath();
    ctx.fillStyle = RAW;
    ctx.globalAlpha = 0.55;
    ctx.fill();
    ctx.globalAlpha = 1;
  } else {
    polyline(ctx, e.count, (c) => x(e.at[c]), (c) => y(e.high[c]), RAW, 1);
  }
  polyline(ctx, e.count, (c) => x(e.at[c]), (c) => y(e.smooth[c]), SMOOTHED, 2);
  if (heldOut.length) {
    const atStep = (i) => x((heldOut[i][0] - 1) / (losses.length - 1));
    polyline(ctx, heldOut.length, atStep, (i) => y(heldOut[i][1]), VALIDATION, 1.5);
    ctx.fillStyle = VALIDATION;
    for (let i = 0; i < heldOut.length; i++) {
      ctx.fillRect(atStep(i) - MARKER, y(heldOut[i][1]) - MARKER, 2 * MARKER, 2 * MARKER);
    }
  }

  ctx.fillStyle = LABEL;
  ctx.textAlign = "left";
  ctx.fillText(`max ${formatLoss(range.high)}`, PAD.left, 11);
  ctx.fillText(`min ${formatLoss(range.low)}`, PAD.left, height - 3);
  ctx.textAlign = "right";
  ctx.fillText(`${losses.length.toLocaleString("en-US")} steps`, width - PAD.right, height - 3);
  // the legend, right to left; "loss" becomes "train" once there is a second loss to tell apart
  const legend = heldOut.length
    ? [["train", RAW], ["smoothed", SMOOTHED], ["validation", VALIDATION]]
    : [["loss", RAW], ["smoothed", SMOOTHED]];
  let right = width - PAD.right;
  for (const [name, color] of legend.reverse()) {
    ctx.fillStyle = color;
    ctx.fillText(name, right, 11);
    right -= ctx.measureText(name).width + 6;
  }
}

function polyline(ctx, count, xAt, yAt, color, lineWidth) {
  ctx.strokeStyle = color;
  ctx.lineWidth = lineWidth;
  ctx.lineJoin = "round";
  ctx.beginPath();
  for (let c = 0; c < count; c++) ctx.lineTo(xAt(c), yAt(c));
  ctx.stroke();
}
