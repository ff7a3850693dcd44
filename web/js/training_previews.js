// Kontext Trainer: the preview history on a TrainLoRA panel: the run's recent PreviewSampler
// images (the event sends up to 24), newest first, each labelled with its step; a click opens
// one large (Escape, or another click, closes it).
const { api } = window.comfyAPI.api;

const THUMBNAIL_PX = 112; // three side by side on the node; a click opens one large
// A row of previews: a thumbnail, 2 px, its step (13 px), 2 px below (the panel reserves it)
export const PREVIEW_ROW_PX = THUMBNAIL_PX + 17;

function previewURL(preview) {
  const query = new URLSearchParams({ filename: preview.filename, subfolder: preview.subfolder, type: preview.type });
  return api.apiURL(`/view?${query}`);
}

export function renderPreviews(container, previews) {
  const key = previews.map((p) => `${p.subfolder}/${p.filename}`).join("|");
  if (container.dataset.key === key) return; // unchanged: keep the loaded images
  container.dataset.key = key;
  container.style.display = previews.length ? "flex" : "none";
  const newestFirst = [...previews].reverse();
  container.replaceChildren(...newestFirst.map((preview, i) => thumbnail(preview, i === 0)));
}

function thumbnail(preview, newest) {
  const figure = document.createElement("figure");
  figure.className = "kt-preview";
  figure.dataset.step = preview.step;
  figure.style.cssText = `margin:0;flex:0 0 ${THUMBNAIL_PX}px;display:flex;flex-direction:column;gap:2px;cursor:zoom-in`;
  const image = document.createElement("img");
  image.src = previewURL(preview);
  image.alt = `preview at step ${preview.step}`;
  image.style.cssText =
    `width:${THUMBNAIL_PX}px;height:${THUMBNAIL_PX}px;object-fit:contain;background:#111;border-radius:4px;` +
    `border:1px solid ${newest ? "#ffaa3c" : "#333"}`;
  const caption = document.createElement("figcaption");
  caption.textContent = `step ${preview.step}`;
  caption.style.cssText = `text-align:center;color:${newest ? "#ffaa3c" : "#aaa"}`;
  figure.append(image, caption);
  figure.addEventListener("click", (event) => {
    event.stopPropagation();
    openLarge(preview);
  });
  return figure;
}

function openLarge(preview) {
  document.querySelector(".kt-preview-large")?.remove();
  const overlay = document.createElement("div");
  overlay.className = "kt-preview-large";
  overlay.style.cssText =
    "position:fixed;inset:0;z-index:10000;background:rgba(0,0,0,.75);display:flex;flex-direction:column;" +
    "align-items:center;justify-content:center;gap:8px;cursor:zoom-out;font:13px sans-serif;color:#ddd";
  const image = document.createElement("img");
  image.src = previewURL(preview);
  image.style.cssText = "width:min(80vw,80vh);height:min(80vw,80vh);object-fit:contain;image-rendering:auto";
  const caption = document.createElement("div");
  caption.textContent = `step ${preview.step} · ${preview.filename}`;
  overlay.append(image, caption);
  const close = () => {
    overlay.remove();
    document.removeEventListener("keydown", onKey, true);
  };
  const onKey = (event) => event.key === "Escape" && close();
  overlay.addEventListener("click", close);
  document.addEventListener("keydown", onKey, true);
  document.body.append(overlay);
}
