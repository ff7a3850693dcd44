// Kontext Trainer: a badge on ComfyUI's About panel naming the installed pack version, so a
// bug report can say which Kontext Trainer it came from. It links to web/README.md, which
// lists the pack's web features and the events each one listens to.
const { app } = window.comfyAPI.app;

export const PACK_VERSION = "0.1.0"; // kept equal to pyproject.toml by tests/test_project.py

app.registerExtension({
  name: "KontextTrainer.About",
  aboutPageBadges: [
    {
      label: `Kontext Trainer v${PACK_VERSION}`,
      url: new URL("../README.md", import.meta.url).href,
      icon: "pi pi-book",
    },
  ],
});
